"""PhysicsNeMo's ``physicsnemo.distributed.mappings`` over :mod:`mpidp.ops.collectives`.

``group`` is the *name* of a group of the compat :class:`DistributedManager` (None: the
world), as in PhysicsNeMo. Megatron's pairs: copy (identity, all-reduce backward) and reduce
(all-reduce, identity backward); scatter (this rank's part, all-gather backward) and gather
(all-gather, this rank's part backward). Uneven cuts work; the gather's backward cuts by the
``shapes`` it was given (PhysicsNeMo's re-derives an even-ish cut).
"""

from __future__ import annotations

from typing import Any

import torch

from mpidp.compat.physicsnemo.distributed.manager import DistributedManager, transport_for
from mpidp.compat.physicsnemo.distributed.utils import _sizes, split_to_group
from mpidp.ops import collectives as core

__all__ = [
    "copy_to_parallel_region",
    "gather_from_parallel_region",
    "reduce_from_parallel_region",
    "scatter_to_parallel_region",
]


def _group(name: str | None) -> Any:
    return DistributedManager().group(name)


def copy_to_parallel_region(input: torch.Tensor, group: str | None) -> torch.Tensor:
    """Identity; the backward sums the gradient over the group. Collective in backward."""
    return core.copy_to(input, group=transport_for(_group(group), input.device))


def reduce_from_parallel_region(input: torch.Tensor, group: str | None) -> torch.Tensor:
    """Sum over the group; the backward passes the gradient through. Collective."""
    return core.reduce_from(input, group=transport_for(_group(group), input.device))


def scatter_to_parallel_region(input: torch.Tensor, dim: int, group: str | None) -> torch.Tensor:
    """This rank's part along ``dim`` (PhysicsNeMo's ``compute_split_shapes`` cut); the
    backward all-gathers. No communication forward."""
    return split_to_group(input, dim, _group(group))


def gather_from_parallel_region(
    input: torch.Tensor, dim: int, shapes: list[int] | None, group: str | None
) -> torch.Tensor:
    """Every rank's part (``shapes``: one size per rank, learned when None) concatenated
    along ``dim``; every rank uses it alike, so the backward keeps this rank's part. Collective."""
    t = transport_for(_group(group), input.device)
    return core.all_gather_v_replicated(input, _sizes(input, shapes, dim, t), dim, group=t)
