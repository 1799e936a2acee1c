"""Whole tensors and latitude x longitude blocks: this rank's block of a replicated tensor, the
whole tensor from every rank's block, and a scatter of one rank's tensor into blocks.

Each is the 1-D primitive of :mod:`mpidp.ops.functions` once along each axis group of the grid
(:mod:`mpidp.runtime.grid`): along the longitude within the longitude row, along the latitude
within the latitude column. The adjoints compose the same way, so the gradients are exact for
uneven blocks in both dims, and on bands (the grid ``(P, 1)``: the longitude row is this rank
alone, every primitive there the identity) each is the band primitive it always was.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

from mpidp.comm import Transport
from mpidp.errors import ConfigError
from mpidp.ops.collectives import scatter_v
from mpidp.ops.functions import _AllGatherV, _AllGatherVReplicated, _call, _Shard
from mpidp.runtime.grid import BlockSpec, axis_transport
from mpidp.runtime.manager import DistributedManager, get_manager
from mpidp.runtime.partition import ShardSpec

__all__ = ["block_dims", "gather_blocks", "grid_transports", "scatter_blocks", "shard_blocks"]

SpecLike = BlockSpec | tuple[ShardSpec | Sequence[int], ShardSpec | Sequence[int]]


def block_dims(ndim: int, dims: Sequence[int], rank: int) -> tuple[int, int]:
    """``(lat, lon)`` tensor dims, non-negative; ConfigError unless two distinct dims."""
    dims = tuple(dims)
    ok = len(dims) == 2 and all(-ndim <= d < ndim for d in dims)
    if not ok or dims[0] % ndim == dims[1] % ndim:
        raise ConfigError(
            f"rank {rank}: block dims {dims} for a {ndim}-d tensor: pass two distinct dims "
            f"(latitude, longitude), e.g. dims=(-2, -1)"
        )
    return dims[0] % ndim, dims[1] % ndim


def grid_transports(
    manager: DistributedManager | None, device: torch.device | str | None
) -> tuple[DistributedManager, Transport, Transport]:
    """The manager (default: mpidp's) and the transports of this rank's latitude column and
    longitude row for tensors on ``device``."""
    m = manager if manager is not None else get_manager()
    return m, axis_transport(m, "lat", device), axis_transport(m, "lon", device)


def as_block_spec(
    spec: SpecLike, dims: tuple[int, int], *, rank: int | None = None, fix: str = ""
) -> BlockSpec:
    """A BlockSpec from a BlockSpec or a ``(lat, lon)`` pair of ShardSpecs or sizes. Anything
    else (a band's one cut names no columns) is a ConfigError; ``fix``: the caller's other way
    out, ``rank`` this rank for the message."""
    if isinstance(spec, BlockSpec):
        return spec
    if not _cut_pair(spec):
        raise ConfigError(
            f"{'' if rank is None else f'rank {rank}: '}spec {spec!r} is not the blocks of a "
            f"latitude x longitude grid (a BlockSpec, or a (lat, lon) pair of cuts): one cut, "
            f"as a band's, names no columns; pass manager.block_spec(shape, dims), or the pair "
            f"of the block's cuts{fix}"
        )
    lat, lon = (s if isinstance(s, ShardSpec) else ShardSpec.from_sizes(s) for s in spec)
    return BlockSpec(lat, lon, dims)


def learn_blocks(
    m: DistributedManager, x: torch.Tensor, dims: tuple[int, int], fix: str = ""
) -> BlockSpec:
    """The blocks of ``m``'s grid that every rank's ``x`` is one of, from every rank's extents
    along ``dims`` (one all-gather of two integers over the domain group). Refused on every
    rank alike unless they are blocks of the grid: a block's rows are its longitude row's, its
    columns its latitude column's (a band's rows differ along a longitude row). ``fix``: the
    caller's other way out. Collective over the domain group."""
    t = m.transport(None, x.device)
    ext = [(int(r[0]), int(r[1])) for r in t.all_gather_ints([x.size(dims[0]), x.size(dims[1])])]
    p_lat, p_lon = m.grid
    lat = [ext[i * p_lon][0] for i in range(p_lat)]
    lon = [ext[j][1] for j in range(p_lon)]
    if any(ext[i * p_lon + j] != (lat[i], lon[j]) for i in range(p_lat) for j in range(p_lon)):
        raise ConfigError(
            f"rank {m.rank}: the domain ranks hold {ext} (rows, columns along dims {dims}), "
            f"which are not the blocks of the grid {m.grid}: a block's rows are its longitude "
            f"row's, its columns its latitude column's; pass each rank's block{fix}"
        )
    return BlockSpec(ShardSpec.from_sizes(lat), ShardSpec.from_sizes(lon), dims)


def _cut_pair(spec: Any) -> bool:
    """Whether ``spec`` is two cuts, each a ShardSpec or a sequence of sizes."""

    def cut(c: Any) -> bool:
        if isinstance(c, ShardSpec):
            return True
        return isinstance(c, Sequence) and all(isinstance(n, numbers.Integral) for n in c)

    return isinstance(spec, tuple | list) and len(spec) == 2 and all(cut(c) for c in spec)


def _check(spec: BlockSpec, m: DistributedManager, t_lat: Transport, t_lon: Transport) -> None:
    if spec.grid != (t_lat.size, t_lon.size):
        raise ConfigError(
            f"rank {m.rank}: {spec!r} cuts a {spec.grid[0]} x {spec.grid[1]} grid but the "
            f"domain grid is {t_lat.size} x {t_lon.size}; pass manager.block_spec(shape, dims)"
        )


def shard_blocks(
    x: torch.Tensor,
    dims: Sequence[int] = (-2, -1),
    manager: DistributedManager | None = None,
    spec: SpecLike | None = None,
) -> torch.Tensor:
    """This rank's block of a tensor every domain rank holds whole (no communication).

    ``spec`` defaults to ``manager.block_spec(x.shape, dims)``. The backward all-gathers the
    block gradients (along the latitude column, then the longitude row), so a replicated ``x``
    gets its whole gradient on every rank, as with :func:`mpidp.shard_tensor` on bands.
    """
    m, t_lat, t_lon = grid_transports(manager, x.device)
    d_lat, d_lon = block_dims(x.dim(), dims, m.rank)
    bs = as_block_spec(spec, (d_lat, d_lon)) if spec is not None else m.block_spec(x.shape, dims)
    _check(bs, m, t_lat, t_lon)
    if (x.size(d_lat), x.size(d_lon)) != bs.shape:
        raise ConfigError(
            f"rank {m.rank}: tensor of shape {tuple(x.shape)} has extents "
            f"{(x.size(d_lat), x.size(d_lon))} along dims {(d_lat, d_lon)} but {bs!r} cuts "
            f"{bs.shape}; pass the spec of this tensor's shape"
        )
    columns = _call(_Shard, x, t_lon, list(bs.lon.sizes), d_lon)
    return _call(_Shard, columns, t_lat, list(bs.lat.sizes), d_lat)


def gather_blocks(
    x: torch.Tensor,
    dims: Sequence[int] = (-2, -1),
    manager: DistributedManager | None = None,
    spec: SpecLike | None = None,
    *,
    replicated: bool = True,
) -> torch.Tensor:
    """The whole tensor from every domain rank's block, on every domain rank (uneven blocks
    fine): all-gathered along the latitude column, then along the longitude row.

    Block sizes come from ``spec`` or, when None, from one small all-gather along each axis.
    By default the downstream is **replicated** (every rank computes the same thing from the
    result; the backward hands each rank its own block's gradient once, no communication);
    ``replicated=False`` gives the **partial** downstream of :func:`mpidp.all_gather_v` (the
    backward sums every rank's gradient of this block).

    Collective over the domain group.
    """
    m, t_lat, t_lon = grid_transports(manager, x.device)
    d_lat, d_lon = block_dims(x.dim(), dims, m.rank)
    if spec is not None:
        bs = as_block_spec(spec, (d_lat, d_lon))
        _check(bs, m, t_lat, t_lon)
        lat, lon = list(bs.lat.sizes), list(bs.lon.sizes)
    else:
        lat = [int(r[0]) for r in t_lat.all_gather_ints([x.size(d_lat)])]
        lon = [int(r[0]) for r in t_lon.all_gather_ints([x.size(d_lon)])]
    fn = _AllGatherVReplicated if replicated else _AllGatherV
    rows = _call(fn, x, t_lat, lat, d_lat)
    return _call(fn, rows, t_lon, lon, d_lon)


def scatter_blocks(
    x: torch.Tensor | None,
    dims: Sequence[int] = (-2, -1),
    src: int = 0,
    manager: DistributedManager | None = None,
    spec: SpecLike | None = None,
) -> torch.Tensor:
    """Cut domain rank ``src``'s tensor into blocks: every domain rank gets its own.

    :func:`mpidp.scatter_v` along the longitude within ``src``'s longitude row, then along the
    latitude within every latitude column (from the rank of the column in ``src``'s row).
    Ranks other than ``src`` may pass None; ``spec`` defaults to the manager's blocks of
    ``src``'s shape (learned in one small broadcast). The backward gathers the gradient back
    to ``src``: every rank must run it when ``src``'s tensor requires grad.

    Collective over the domain group.
    """
    m, t_lat, t_lon = grid_transports(manager, x.device if x is not None else None)
    p_lat, p_lon = m.grid
    if not 0 <= src < p_lat * p_lon:
        raise ConfigError(
            f"rank {m.rank}: src {src} is not a domain rank; use 0..{p_lat * p_lon - 1}"
        )
    s_lat, s_lon = divmod(src, p_lon)
    i_lat = m.grid_coords[0]
    mine = x if m.domain_rank == src else None
    if spec is None:
        shape = tuple(mine.shape) if mine is not None else None
        if m.domain_world_size > 1:
            shape = m.transport("domain", x.device if x is not None else None).broadcast_object(
                shape, src
            )
        if shape is None:
            raise ConfigError(f"rank {m.rank}: scatter_blocks src {src} passed None")
        bs = m.block_spec(shape, dims)
    else:
        bs = as_block_spec(spec, (dims[0], dims[1]))
    _check(bs, m, t_lat, t_lon)
    row = None
    if i_lat == s_lat:  # src's longitude row cuts the columns
        row = scatter_v(mine, list(bs.lon.sizes), bs.dims[1], s_lon, t_lon)
    return scatter_v(row, list(bs.lat.sizes), bs.dims[0], s_lat, t_lat)
