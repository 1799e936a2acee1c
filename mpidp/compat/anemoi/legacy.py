"""Moved: anemoi's primitives are now :mod:`mpidp.compat.anemoi`, with anemoi's documented
signatures (``mgroup`` required; None there means "not distributed", as in anemoi). This
module goes after one release; change ``mpidp.anemoi`` to ``mpidp.compat.anemoi``.

Until then its names keep their pre-move forms, each a call of the compat layer:
``(input_, dim, sizes, mgroup=None, ...)`` with ``mgroup`` None the domain group,
``sync_tensor(..., gather_in_fwd=False)`` (identity forward, gradients summed: anemoi's later
releases), and ``shard_heads`` / ``shard_sequence`` are :mod:`mpidp.ops.attention`'s
(``shard_sequence(x, shapes, num_heads, group)``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from mpidp.comm import Transport
from mpidp.compat.anemoi import graph as _graph
from mpidp.ops.attention import shard_heads, shard_sequence
from mpidp.ops.collectives import copy_to, resolve_transport

__all__ = [
    "all_to_all_transpose",
    "gather_tensor",
    "reduce_shard_tensor",
    "reduce_tensor",
    "shard_heads",
    "shard_sequence",
    "shard_tensor",
    "sync_tensor",
]

warnings.warn(
    "mpidp.anemoi has moved to mpidp.compat.anemoi (anemoi's signatures) and goes after one "
    "release",
    DeprecationWarning,
    stacklevel=2,
)


def _group(mgroup: Any, x: torch.Tensor) -> Transport:
    """The pre-move default: None is the domain group."""
    return resolve_transport(mgroup, x.device)


def shard_tensor(
    input_: torch.Tensor,
    dim: int,
    sizes: Sequence[Any],
    mgroup: Any = None,
    gather_in_backward: bool = True,
) -> torch.Tensor:
    """:func:`mpidp.compat.anemoi.shard_tensor`; ``mgroup`` None: the domain group."""
    return _graph.shard_tensor(input_, dim, sizes, _group(mgroup, input_), gather_in_backward)


def gather_tensor(
    input_: torch.Tensor, dim: int, sizes: Sequence[Any], mgroup: Any = None
) -> torch.Tensor:
    """:func:`mpidp.compat.anemoi.gather_tensor`; ``mgroup`` None: the domain group."""
    return _graph.gather_tensor(input_, dim, sizes, _group(mgroup, input_))


def reduce_tensor(input_: torch.Tensor, mgroup: Any = None) -> torch.Tensor:
    """:func:`mpidp.compat.anemoi.reduce_tensor`; ``mgroup`` None: the domain group."""
    return _graph.reduce_tensor(input_, _group(mgroup, input_))


def sync_tensor(
    input_: torch.Tensor,
    dim: int,
    sizes: Sequence[Any],
    mgroup: Any = None,
    gather_in_fwd: bool = True,
) -> torch.Tensor:
    """:func:`mpidp.compat.anemoi.sync_tensor`; ``mgroup`` None: the domain group. With
    ``gather_in_fwd=False``: the identity on a tensor every rank holds, the gradients summed
    over ranks in backward (:func:`mpidp.copy_to`)."""
    if not gather_in_fwd:
        return copy_to(input_, group=_group(mgroup, input_))
    return _graph.sync_tensor(input_, dim, sizes, _group(mgroup, input_))


def reduce_shard_tensor(
    input_: torch.Tensor, dim: int, sizes: Sequence[Any], mgroup: Any = None
) -> torch.Tensor:
    """:func:`mpidp.compat.anemoi.reduce_shard_tensor`; ``mgroup`` None: the domain group."""
    return _graph.reduce_shard_tensor(input_, dim, sizes, _group(mgroup, input_))


def all_to_all_transpose(
    input_: torch.Tensor,
    dim_split: int,
    split_sizes: Sequence[Any],
    dim_concat: int,
    concat_sizes: Sequence[Any],
    mgroup: Any = None,
) -> torch.Tensor:
    """:func:`mpidp.compat.anemoi.all_to_all_transpose`; ``mgroup`` None: the domain group."""
    return _graph.all_to_all_transpose(
        input_, dim_split, split_sizes, dim_concat, concat_sizes, _group(mgroup, input_)
    )
