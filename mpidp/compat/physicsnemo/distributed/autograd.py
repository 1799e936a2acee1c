"""PhysicsNeMo's ``physicsnemo.distributed.autograd`` over :mod:`mpidp.ops.collectives`.

Each function is mpidp's differentiable collective with PhysicsNeMo's argument names and order,
``group=None`` meaning the world; each ``*Autograd`` class offers PhysicsNeMo's
``.apply(...)`` call (it is not a ``torch.autograd.Function`` subclass: mpidp's Functions are
underneath, so double backward works). Backward: all_gather_v reduce-scatters (sums),
gather_v scatters from ``dst``, scatter_v gathers to ``src``, indexed_all_to_all_v sends the
gradients back and adds them at their indices. Uneven sizes work on every device.
"""

from __future__ import annotations

from typing import Any

import torch

from mpidp.compat.physicsnemo.distributed import utils

__all__ = [
    "AllGatherVAutograd",
    "GatherVAutograd",
    "IndexedAllToAllVAutograd",
    "ScatterVAutograd",
    "all_gather_v",
    "gather_v",
    "indexed_all_to_all_v",
    "scatter_v",
]


def all_gather_v(
    tensor: torch.Tensor,
    sizes: list[int],
    dim: int = 0,
    use_fp32: bool = True,
    group: Any = None,
) -> torch.Tensor:
    """Every rank's part concatenated along ``dim`` on every rank; the backward sums every
    rank's gradient for this rank's part (float16/bfloat16 in float32). Collective."""
    return utils.all_gather_v_wrapper(tensor, sizes, dim, group)


def gather_v(
    tensor: torch.Tensor,
    sizes: list[int],
    dim: int = 0,
    dst: int = 0,
    group: Any = None,
) -> torch.Tensor:
    """Every rank's part concatenated along ``dim`` on ``dst`` (an empty tensor elsewhere);
    the backward scatters ``dst``'s gradient. Every rank must backpropagate. Collective."""
    return utils.gather_v_wrapper(tensor, sizes, dim, dst, group)


def scatter_v(
    tensor: torch.Tensor,
    sizes: list[int],
    dim: int = 0,
    src: int = 0,
    group: Any = None,
) -> torch.Tensor:
    """Part ``rank`` of ``src``'s tensor along ``dim``; the backward gathers the gradient to
    ``src``. Collective."""
    return utils.scatter_v_wrapper(tensor, sizes, dim, src, group)


def indexed_all_to_all_v(
    tensor: torch.Tensor,
    indices: list[torch.Tensor],
    sizes: list[list[int]],
    use_fp32: bool = True,
    dim: int = 0,
    group: Any = None,
) -> torch.Tensor:
    """The entries ``indices[j]`` of ``tensor`` along ``dim`` sent to rank j, concatenated in
    rank order; ``sizes[i][j]`` entries go from rank i to rank j. Collective."""
    del use_fp32  # mpidp accumulates float16/bfloat16 gradients in float32 always
    return utils.indexed_all_to_all_v_wrapper(tensor, indices, sizes, dim, group)


class AllGatherVAutograd:
    """PhysicsNeMo's ``AllGatherVAutograd.apply(tensor, sizes, dim, use_fp32, group)``."""

    apply = staticmethod(all_gather_v)


class GatherVAutograd:
    """PhysicsNeMo's ``GatherVAutograd.apply(tensor, sizes, dim, dst, group)``."""

    apply = staticmethod(gather_v)


class ScatterVAutograd:
    """PhysicsNeMo's ``ScatterVAutograd.apply(tensor, sizes, dim, src, group)``."""

    apply = staticmethod(scatter_v)


class IndexedAllToAllVAutograd:
    """PhysicsNeMo's ``IndexedAllToAllVAutograd.apply(tensor, indices, sizes, use_fp32, dim,
    group)``."""

    apply = staticmethod(indexed_all_to_all_v)
