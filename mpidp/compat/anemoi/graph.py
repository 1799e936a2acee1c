"""anemoi's ``anemoi.models.distributed.graph``: its primitives over node (or edge) dims.

Each is one of mpidp's collectives, under anemoi's name, argument order and meaning:

=======================  ===========================  ========================================
anemoi                   forward / backward           mpidp
=======================  ===========================  ========================================
``shard_tensor``         split / gather               :func:`mpidp.shard_tensor`
``shard_tensor(...,      split / zeros elsewhere      ``Tensor.narrow`` (local)
gather_in_backward=
False)``
``gather_tensor``        gather / split               :func:`mpidp.all_gather_v_replicated`
``reduce_tensor``        all-reduce / identity        :func:`mpidp.reduce_from`
``sync_tensor``          gather / all-reduce + split  :func:`mpidp.all_gather_v`
``reduce_shard_tensor``  all-reduce + split / gather  :func:`mpidp.reduce_scatter_v`
``all_to_all_transpose`` all-to-all / reverse         :func:`mpidp.all_to_all_v`
=======================  ===========================  ========================================

``shapes``: every rank's shard shape (anemoi's, e.g. from
:func:`~mpidp.compat.anemoi.shapes.get_shape_shards`; its ``dim`` entry is taken) or plain
sizes. ``mgroup``: a torch ProcessGroup or anything mpidp's collectives accept; as in anemoi,
None is the identity, forward and backward, and reads no shapes. A group of one rank is the
identity too (mpidp's collectives on one rank), with the shapes checked.

Unlike anemoi's these are right for any cut, uneven and empty shards included (anemoi's
``shard_tensor(..., gather_in_backward=False)`` leaves the rest of the gradient uninitialised:
here it is zeros, the slice's gradient), sum in the input's own precision (anemoi's all-reduce
rounds to float32), and a cut the ranks disagree on raises the same error on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mpidp.compat.anemoi._groups import extents, transport
from mpidp.errors import ConfigError
from mpidp.ops.collectives import (
    all_gather_v,
    all_gather_v_replicated,
    all_to_all_v,
    reduce_from,
    reduce_scatter_v,
)
from mpidp.ops.sharding import shard_tensor as _shard_tensor
from mpidp.runtime.partition import ShardSpec

__all__ = [
    "all_to_all_transpose",
    "gather_tensor",
    "reduce_shard_tensor",
    "reduce_tensor",
    "shard_tensor",
    "sync_tensor",
]


def shard_tensor(
    input_: torch.Tensor,
    dim: int,
    shapes: Sequence[Any],
    mgroup: Any,
    gather_in_backward: bool = True,
) -> torch.Tensor:
    """This rank's part (``shapes[rank][dim]`` entries along ``dim``) of a tensor every rank
    holds whole. Backward: every part's gradient gathered, so each rank gets the whole gradient;
    with ``gather_in_backward=False`` this rank's part and zeros elsewhere. No communication
    forward."""
    t = transport(mgroup, input_)
    if t is None:
        return input_
    sizes = extents(shapes, dim, "shard_tensor", t.rank)
    if gather_in_backward:
        return _shard_tensor(input_, dim, spec=sizes, group=t)
    cut = ShardSpec.from_sizes(sizes) if sizes else None
    if cut is None or cut.parts != t.size or cut.total != input_.size(dim):
        raise ConfigError(
            f"rank {t.rank}: shard_tensor: shapes give sizes {sizes} along dim {dim}, which do "
            f"not cut its {input_.size(dim)} entries over {t.size} ranks; pass one shape per "
            "rank, summing to the tensor's extent"
        )
    return input_.narrow(dim, cut.start(t.rank), cut.sizes[t.rank])


def gather_tensor(
    input_: torch.Tensor, dim: int, shapes: Sequence[Any], mgroup: Any
) -> torch.Tensor:
    """Every rank's part concatenated along ``dim``, on every rank, for a downstream every rank
    computes alike. Backward: this rank's part of the gradient. Collective over ``mgroup``."""
    t = transport(mgroup, input_)
    if t is None:
        return input_
    return all_gather_v_replicated(input_, extents(shapes, dim, "gather_tensor", t.rank), dim, t)


def reduce_tensor(input_: torch.Tensor, mgroup: Any) -> torch.Tensor:
    """The sum over ranks, on every rank. Backward: the identity. Collective over ``mgroup``."""
    t = transport(mgroup, input_)
    return input_ if t is None else reduce_from(input_, group=t)


def sync_tensor(input_: torch.Tensor, dim: int, shapes: Sequence[Any], mgroup: Any) -> torch.Tensor:
    """Every rank's part concatenated along ``dim``, on every rank, for a downstream that
    differs by rank. Backward: the gradients summed over ranks, this rank's part kept.
    Collective over ``mgroup``."""
    t = transport(mgroup, input_)
    if t is None:
        return input_
    return all_gather_v(input_, extents(shapes, dim, "sync_tensor", t.rank), dim, t)


def reduce_shard_tensor(
    input_: torch.Tensor, dim: int, shapes: Sequence[Any], mgroup: Any
) -> torch.Tensor:
    """This rank's part (along ``dim``) of the sum over ranks. Backward: every part's gradient
    gathered. Collective over ``mgroup``."""
    t = transport(mgroup, input_)
    if t is None:
        return input_
    sizes = extents(shapes, dim, "reduce_shard_tensor", t.rank)
    return reduce_scatter_v(input_, sizes, dim, t)


def all_to_all_transpose(
    input_: torch.Tensor,
    dim_split: int,
    split_sizes: Any,
    dim_concat: int,
    concat_sizes: Any,
    mgroup: Any,
) -> torch.Tensor:
    """From cut along ``dim_concat`` (this rank holds ``concat_sizes[rank]``) to cut along
    ``dim_split`` (this rank gets ``split_sizes[rank]``); sizes or shapes. Backward: the
    reverse exchange. From anemoi's later releases (not in the documented API). Collective."""
    t = transport(mgroup, input_)
    if t is None:
        return input_
    split = extents(split_sizes, dim_split, "all_to_all_transpose", t.rank)
    concat = extents(concat_sizes, dim_concat, "all_to_all_transpose", t.rank)
    return all_to_all_v(input_, split, concat, dim_split, dim_concat, group=t)
