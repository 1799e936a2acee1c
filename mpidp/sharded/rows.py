"""Rows that change owner: one primitive under redistribute, roll, flip and index_select.

:func:`fetch_rows` gives every rank the global rows it asks for, in its order: each rank knows
every rank's request (they are computed from the spec and the op, the same everywhere), so one
``all_to_all_v`` moves exactly the rows that change owner; the backward is the reverse
exchange and an index-add. A tensor that moves its sharded dim (a band along H becoming a
band along W) goes through the distributed transpose.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mpidp.collectives import all_to_all_v
from mpidp.errors import ConfigError
from mpidp.partition import ShardSpec
from mpidp.sharded.tensor import ShardedTensor

__all__ = ["fetch_rows", "to_spec", "move_to_dim", "Ranges"]

#: per rank, the global rows it wants, as [lo, hi) runs in the order it wants them
Ranges = list[list[tuple[int, int]]]


def fetch_rows(x: ShardedTensor, wanted: Ranges) -> torch.Tensor:
    """This rank's ``wanted[rank]`` rows of ``x`` (global indices, in that order) along its
    sharded dim, as a plain tensor. ``wanted`` must be the same list on every rank.
    Collective (one all-to-all; none when every rank wants exactly its own rows)."""
    spec, d, t = x.spec, x.shard_dim, x.transport
    me, p = t.rank, t.size
    bad = [(q, a, b) for q in range(p) for a, b in wanted[q] if not 0 <= a <= b <= spec.total]
    if bad:
        raise ConfigError(
            f"rank {x.manager.rank}: internal error: rows {bad[:4]} asked of a tensor of "
            f"{spec.total} rows along dim {d}"
        )
    if all(wanted[q] == [(spec.start(q), spec.stop(q))] for q in range(p)):
        return x.local
    lo, hi = spec.start(me), spec.stop(me)
    send_idx: list[int] = []
    send_counts = []
    for q in range(p):
        count = 0
        for a, b in wanted[q]:
            s, e = max(a, lo), min(b, hi)
            if e > s:
                send_idx.extend(range(s - lo, e - lo))
                count += e - s
        send_counts.append(count)
    # where each received row goes: the rows from rank r arrive in my order of asking
    recv_counts = [0] * p
    places: list[list[int]] = [[] for _ in range(p)]
    at = 0
    for a, b in wanted[me]:
        for r, s, e in spec.overlaps(a, b):
            places[r].extend(range(at + s - a, at + e - a))
            recv_counts[r] += e - s
        at += b - a
    device = x.local.device
    send = x.local.index_select(d, torch.tensor(send_idx, dtype=torch.long, device=device))
    got = all_to_all_v(send, send_counts, recv_counts, d, group=t)
    order = [i for block in places for i in block]  # position of each received row
    if order == list(range(len(order))):
        return got
    inverse = [0] * len(order)
    for k, i in enumerate(order):
        inverse[i] = k
    return got.index_select(d, torch.tensor(inverse, dtype=torch.long, device=device))


def remap(
    x: ShardedTensor, spec: ShardSpec, source: Callable[[int, int], Ranges1]
) -> ShardedTensor:
    """The tensor whose new partition is ``spec`` and whose rows ``[a, b)`` come from the old
    rows ``source(a, b)`` (runs, in order)."""
    wanted = [source(spec.start(q), spec.stop(q)) for q in range(spec.parts)]
    return ShardedTensor(fetch_rows(x, wanted), spec, x.shard_dim, x.manager)


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


def move_to_dim(x: ShardedTensor, new_dim: int, spec: ShardSpec | None = None) -> ShardedTensor:
    """``x`` sharded along ``new_dim`` (cut by ``spec``, default the manager's policy)
    instead: the distributed transpose (every rank sends its band's part of each new band)."""
    m = x.manager
    n = x.local.size(new_dim)
    new = spec if spec is not None else m.partition.spec(n, m.domain_world_size)
    local = all_to_all_v(
        x.local, list(new.sizes), list(x.spec.sizes), new_dim, x.shard_dim, group=x.transport
    )
    return ShardedTensor(local, new, new_dim, m)
