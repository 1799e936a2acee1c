"""anemoi's distributed primitives under their names and meanings, for users migrating from
anemoi-models (``anemoi.models.distributed.graph`` and ``.transformer``).

Each is one of mpidp's collectives, with anemoi's argument order ``(input_, dim, sizes,
mgroup)``: ``sizes`` are every rank's extent along ``dim`` (ints, or anemoi's per-rank shapes,
whose ``dim`` entry is taken), ``mgroup`` any group mpidp's collectives accept (None: the
domain group). Unlike anemoi's they take any cut (uneven, empty shards), check that the ranks
agree on the sizes, and raise the same error on every rank when they do not.

=============================  ===========================  ==================================
anemoi                         forward / backward           mpidp
=============================  ===========================  ==================================
``shard_tensor``               split / gather               :func:`mpidp.shard_tensor`
``shard_tensor(...,            split / zeros elsewhere      ``narrow`` (local)
gather_in_backward=False)``
``gather_tensor``              gather / split               :func:`mpidp.all_gather_v_replicated`
``reduce_tensor``              all-reduce / identity        :func:`mpidp.reduce_from`
``sync_tensor``                gather / all-reduce + split  :func:`mpidp.all_gather_v`
``sync_tensor(...,             identity / all-reduce        :func:`mpidp.copy_to`
gather_in_fwd=False)``
``reduce_shard_tensor``        all-reduce + split / gather  :func:`mpidp.reduce_scatter_v`
``all_to_all_transpose``       all-to-all / reverse         :func:`mpidp.all_to_all_v`
``shard_heads``,               head / sequence all-to-all   :mod:`mpidp.attention`
``shard_sequence``
=============================  ===========================  ==================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mpidp.attention import shard_heads, shard_sequence
from mpidp.collectives import (
    all_gather_v,
    all_gather_v_replicated,
    all_to_all_v,
    copy_to,
    reduce_from,
    reduce_scatter_v,
    resolve_transport,
)
from mpidp.errors import ConfigError
from mpidp.partition import ShardSpec
from mpidp.sharding import shard_tensor as _shard_tensor

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


def _sizes(sizes: Sequence[Any], dim: int, what: str) -> list[int]:
    """Per-rank extents along ``dim`` from ints or anemoi's per-rank shapes."""
    out = []
    for s in sizes:
        if isinstance(s, int):
            out.append(s)
        elif isinstance(s, (tuple, list, torch.Size)) and -len(s) <= dim < len(s):
            out.append(int(s[dim]))
        else:
            raise ConfigError(f"{what}: {s!r} is neither a size nor a shape with a dim {dim}")
    return out


def shard_tensor(
    input_: torch.Tensor,
    dim: int,
    sizes: Sequence[Any],
    mgroup: Any = None,
    gather_in_backward: bool = True,
) -> torch.Tensor:
    """This rank's part of a tensor every rank holds whole. Backward: the parts' gradients
    gathered (every rank gets the whole gradient), or with ``gather_in_backward=False`` this
    rank's part and zeros elsewhere. No communication forward."""
    n = _sizes(sizes, dim, "shard_tensor")
    if gather_in_backward:
        return _shard_tensor(input_, dim, spec=n, group=mgroup)
    t = resolve_transport(mgroup, input_.device)
    spec = ShardSpec.from_sizes(n)
    if spec.parts != t.size or spec.total != input_.size(dim):
        raise ConfigError(
            f"rank {t.rank}: shard_tensor: sizes {n} do not cut {input_.size(dim)} entries "
            f"along dim {dim} over {t.size} ranks"
        )
    return input_.narrow(dim, spec.start(t.rank), spec.sizes[t.rank])


def gather_tensor(
    input_: torch.Tensor, dim: int, sizes: Sequence[Any], mgroup: Any = None
) -> torch.Tensor:
    """Every rank's part concatenated along ``dim``, on every rank, for a downstream that every
    rank computes alike. Backward: this rank's part of the gradient."""
    return all_gather_v_replicated(input_, _sizes(sizes, dim, "gather_tensor"), dim, group=mgroup)


def reduce_tensor(input_: torch.Tensor, mgroup: Any = None) -> torch.Tensor:
    """The sum over ranks, on every rank. Backward: the identity."""
    return reduce_from(input_, group=mgroup)


def sync_tensor(
    input_: torch.Tensor,
    dim: int,
    sizes: Sequence[Any],
    mgroup: Any = None,
    gather_in_fwd: bool = True,
) -> torch.Tensor:
    """Every rank's part concatenated along ``dim``, on every rank, for a downstream that
    differs by rank. Backward: the gradients summed over ranks, this rank's part kept. With
    ``gather_in_fwd=False``: the identity, and the gradients summed in backward."""
    if not gather_in_fwd:
        return copy_to(input_, group=mgroup)
    return all_gather_v(input_, _sizes(sizes, dim, "sync_tensor"), dim, group=mgroup)


def reduce_shard_tensor(
    input_: torch.Tensor, dim: int, sizes: Sequence[Any], mgroup: Any = None
) -> torch.Tensor:
    """This rank's part of the sum over ranks. Backward: the parts' gradients gathered."""
    return reduce_scatter_v(input_, _sizes(sizes, dim, "reduce_shard_tensor"), dim, group=mgroup)


def all_to_all_transpose(
    input_: torch.Tensor,
    dim_split: int,
    split_sizes: Sequence[Any],
    dim_concat: int,
    concat_sizes: Sequence[Any],
    mgroup: Any = None,
) -> torch.Tensor:
    """From cut along ``dim_concat`` (this rank holds ``concat_sizes[rank]``) to cut along
    ``dim_split`` (this rank gets ``split_sizes[rank]``). Backward: the reverse exchange."""
    split = _sizes(split_sizes, dim_split, "all_to_all_transpose")
    concat = _sizes(concat_sizes, dim_concat, "all_to_all_transpose")
    return all_to_all_v(input_, split, concat, dim_split, dim_concat, group=mgroup)
