"""Rows that change owner: one primitive under redistribute, roll, flip and index_select.

:func:`fetch_rows` gives every rank the global rows it asks for, in its order: each rank knows
every rank's request (they are computed from the spec and the op, the same everywhere), so one
``all_to_all_v`` moves exactly the rows that change owner; the backward is the reverse
exchange and an index-add. A tensor that moves its sharded dim (a band along H becoming a
band along W) goes through the distributed transpose.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from mpidp.errors import ConfigError
from mpidp.ops.collectives import all_to_all_v, fetch_global_rows
from mpidp.runtime.partition import ShardSpec

if TYPE_CHECKING:  # rows sit below the tensor type: its redistribute moves them
    from mpidp.sharded.tensor import ShardedTensor

__all__ = ["fetch_rows", "to_spec", "move_to_dim", "Ranges"]

#: per rank, the global rows it wants, as [lo, hi) runs in the order it wants them
Ranges = list[list[tuple[int, int]]]


def fetch_rows(x: ShardedTensor, wanted: Ranges) -> torch.Tensor:
    """This rank's ``wanted[rank]`` rows of ``x`` (global indices, in that order) along its
    sharded dim, as a plain tensor (of every block, when ``x.blocks > 1``). ``wanted`` must be
    the same list on every rank. Collective (one all-to-all; none when every rank wants
    exactly its own rows)."""
    local, d = x.unblocked()
    out = fetch_global_rows(local, x.spec, d, wanted, x.transport)
    return out if d == x.shard_dim else out.flatten(d - 1, d)


def remap(
    x: ShardedTensor, spec: ShardSpec, source: Callable[[int, int], Ranges1]
) -> ShardedTensor:
    """The tensor whose new partition is ``spec`` and whose rows ``[a, b)`` come from the old
    rows ``source(a, b)`` (runs, in order)."""
    wanted = [source(spec.start(q), spec.stop(q)) for q in range(spec.parts)]
    return x.like(fetch_rows(x, wanted), spec=spec)


Ranges1 = list[tuple[int, int]]


def to_spec(x: ShardedTensor, spec: ShardSpec) -> ShardedTensor:
    """``x`` on the partition ``spec`` (same global rows)."""
    if spec == x.spec:
        return x
    if spec.total != x.spec.total or spec.parts != x.spec.parts:
        raise ConfigError(
            f"rank {x.manager.rank}: a tensor of {x.spec.total} rows along dim {x.shard_dim} "
            f"cannot take the partition {list(spec.sizes)} ({spec.total} rows): the shapes "
            f"differ along the sharded dim"
        )
    return remap(x, spec, lambda a, b: [(a, b)] if b > a else [])


def along(x: ShardedTensor, dim: int) -> ShardedTensor:
    """``x`` sharded along ``dim`` (the distributed transpose when it is cut along another:
    a rotated cubed-sphere face, cut along W, meeting faces cut along H). A dim of fewer
    entries than ranks (a one-row strip) is cut with empty parts: the caller moves it on to
    the cut it meets."""
    if x.shard_dim == dim:
        return x
    return move_to_dim(x, dim)


def move_to_dim(x: ShardedTensor, new_dim: int, spec: ShardSpec | None = None) -> ShardedTensor:
    """``x`` sharded along ``new_dim`` (cut by ``spec``, default the manager's policy)
    instead: the distributed transpose (every rank sends its band's part of each new band)."""
    m = x.manager
    if x.blocks > 1:
        raise ConfigError(
            f"rank {m.rank}: moving the sharded dim {x.shard_dim} of {tuple(x.shape)} to dim "
            f"{new_dim}: it holds {x.blocks} blocks merged before the band (windows in the "
            f"batch, tokens); unflatten it back to its dims first"
        )
    n = x.local.size(new_dim)
    new = spec if spec is not None else m.partition.derived(n, m.domain_world_size)
    local = all_to_all_v(
        x.local, list(new.sizes), list(x.spec.sizes), new_dim, x.shard_dim, group=x.transport
    )
    return x.like(local, new_dim, new)
