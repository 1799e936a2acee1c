"""Handlers: selecting rows by GLOBAL index (slicing, ``narrow``, ``select``, integer
indexing, ``index_select``, ``roll``, ``flip``) and writing into a band (``x[...] = v``, a
plain tensor of the global shape adopting bands: FNO's spectrum).

A slice keeps each rank's rows of the selection (no communication; the partition may become
uneven or empty on some ranks); ``index_select``, ``roll`` and ``flip`` along the sharded dim
move rows (:mod:`mpidp.sharded.rows`); an integer index gives the row on every rank
(Replicated).
"""

from __future__ import annotations

from typing import Any

import torch

from mpidp.runtime.grid import blocks_refused
from mpidp.runtime.partition import ShardSpec
from mpidp.sharded.dispatch import describe, name_of, refuse, register
from mpidp.sharded.rows import remap, to_spec
from mpidp.sharded.shapes import _plain, _wrap
from mpidp.sharded.tensor import Replicated, ShardedTensor, replicated

__all__: list[str] = []


# -- selecting rows --------------------------------------------------------------------------------


def kept(spec: ShardSpec, rank: int, start: int, stop: int, step: int) -> tuple[ShardSpec, slice]:
    """The partition of rows ``range(start, stop, step)`` of ``spec`` when each rank keeps its
    own, and ``rank``'s local slice (a band's rows; one cut axis of a block)."""
    sizes = []
    mine = slice(0, 0)
    for r in range(spec.parts):
        lo, hi = spec.start(r), spec.stop(r)
        first = start if lo <= start else start + -(-(lo - start) // step) * step
        last = min(hi, stop)
        count = max(0, -(-(last - first) // step)) if first < last else 0
        sizes.append(count)
        if r == rank:
            mine = (
                slice(first - lo, first - lo + (count - 1) * step + 1, step)
                if count
                else slice(0, 0)
            )
    return ShardSpec(tuple(sizes)), mine


def _keep(x: ShardedTensor, start: int, stop: int, step: int) -> tuple[ShardSpec, slice]:
    """:func:`kept` for the band ``x``."""
    return kept(x.spec, x.rank, start, stop, step)


def _one_row(x: ShardedTensor, i: int) -> Replicated:
    """Row ``i`` along the sharded dim (the dim removed), on every rank."""
    spec, mine = _keep(x, i, i + 1, 1)
    band = ShardedTensor(
        x.local[(slice(None),) * x.shard_dim + (mine,)], spec, x.shard_dim, x.manager
    )
    whole = band.full_tensor()
    return replicated(whole.as_subclass(torch.Tensor).squeeze(x.shard_dim), x.transport)


def index_parts(x: ShardedTensor, index: Any) -> list[Any]:
    """The index ``x[index]`` as one part per dim of ``x`` (Ellipsis expanded, ``None`` kept)."""
    parts = list(index) if isinstance(index, tuple) else [index]
    used = sum(1 for p in parts if p is not None and p is not Ellipsis and not isinstance(p, bool))
    at = next((i for i, p in enumerate(parts) if p is Ellipsis), None)
    if at is not None:
        parts[at : at + 1] = [slice(None)] * (x.dim() - used)
    return parts + [slice(None)] * (x.dim() - sum(1 for p in parts if p is not None))


@register(torch.Tensor.__getitem__, blocks=True)
def _getitem(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, index = args[0], args[1]
    if not isinstance(x, ShardedTensor):  # a whole tensor read at a band of indices
        if isinstance(index, ShardedTensor) and index.dim() == 1 and not index.is_floating_point():
            if index.dtype == torch.bool:
                raise refuse(func, args, kwargs, "a boolean mask that is a band", "gather it")
            return _index_at(func, (x, 0, index), kwargs)
        raise refuse(
            func,
            args,
            kwargs,
            "indexing a whole tensor by a sharded tensor other than one 1-D integer index",
            "use index_select(dim, index) with a 1-D sharded index",
        )
    parts = index_parts(x, index)
    by_index = _one_index_along_rows(x, parts)
    if by_index is not None:
        return _index_select(torch.index_select, (x, x.shard_dim, by_index), {})
    if any(isinstance(p, (torch.Tensor, list, bool)) for p in parts):
        raise refuse(
            func,
            args,
            kwargs,
            "tensor, list or boolean indexing of a band",
            "index with ints and slices, or use index_select along the sharded dim",
        )
    d, n = x.shard_dim, x.spec.total
    local_idx: list[Any] = []
    dim = out = 0
    axis: int | None = None
    spec = x.spec
    for at, p in enumerate(parts):
        if p is None:
            local_idx.append(None)
            out += 1
            continue
        if dim == d and x.blocks > 1 and p != slice(None):
            raise refuse(
                func,
                args,
                kwargs,
                f"indexing the sharded dim, which holds {x.blocks} blocks merged before the band",
                "unflatten it back to its dims, then index",
            )
        if dim == d:
            if isinstance(p, int):  # the row, on every rank; the other parts index it
                row = _one_row(x, p % n)
                rest = (*local_idx, *parts[at + 1 :])
                return row[rest] if rest else row
            if p == slice(None):  # every row: the band as it is (its blocks too)
                local_idx.append(p)
            else:
                start, stop, step = p.indices(n)
                spec, mine = _keep(x, start, stop, step)
                local_idx.append(mine)
            axis = out
        else:
            local_idx.append(p)
        if not isinstance(p, int):
            out += 1
        dim += 1
    assert axis is not None
    return x.like(x.local[tuple(local_idx)], axis, spec)


def _one_index_along_rows(x: ShardedTensor, parts: list[Any]) -> torch.Tensor | None:
    """The global row ids of ``x[parts]`` when it is one 1-D index (integer tensor or list, or
    a boolean mask, whole or a band) along the sharded dim and full slices elsewhere: it is
    then ``index_select`` along that dim. None otherwise."""
    if x.blocks > 1 or len(parts) != x.dim() or any(p is None for p in parts):
        return None
    d = x.shard_dim
    if any(p != slice(None) for i, p in enumerate(parts) if i != d):
        return None
    p = parts[d]
    if isinstance(p, list) and all(isinstance(i, (int, bool)) for i in p):
        p = torch.tensor(p, dtype=torch.bool if p and isinstance(p[0], bool) else torch.long)
    if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.is_floating_point():
        return None
    if isinstance(p, ShardedTensor):  # a band of ids or of the mask: every rank reads it whole
        p = p.full_tensor().as_subclass(torch.Tensor)
    p = p.as_subclass(torch.Tensor) if isinstance(p, Replicated) else p
    if p.dtype == torch.bool:
        if p.numel() != x.spec.total:
            return None
        return p.nonzero().squeeze(-1)
    return p.to(torch.long)


@register(torch.narrow, torch.Tensor.narrow)
def _narrow(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, dim, start, length = args[0], int(args[1]) % args[0].dim(), int(args[2]), int(args[3])
    if dim != x.shard_dim:
        return _wrap(x, x.local.narrow(dim, start, length), x.shard_dim)
    start %= x.spec.total
    spec, mine = _keep(x, start, start + length, 1)
    return ShardedTensor(
        x.local.narrow(dim, mine.start, mine.stop - mine.start), spec, dim, x.manager
    )


@register(torch.select, torch.Tensor.select)
def _select(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, dim, i = args[0], int(args[1]) % args[0].dim(), int(args[2])
    if dim == x.shard_dim:
        return _one_row(x, i % x.spec.total)
    return _wrap(x, x.local.select(dim, i), x.shard_dim - (1 if dim < x.shard_dim else 0))


def _index_at(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x.index_select(dim, index)`` with ``x`` whole and ``index`` a band: the band of the
    result cut like the index, along ``dim``; no communication (a Replicated ``x`` enters
    through ``copy_to``)."""
    x, dim, index = args[0], int(args[1]) % args[0].dim(), args[2]
    if index.blocks > 1:
        raise refuse(func, args, kwargs, "an index holding merged blocks", "flatten it first")
    x = _plain(x, index.transport)
    return ShardedTensor(x.index_select(dim, index.local), index.spec, dim, index.manager)


@register(torch.index_select, torch.Tensor.index_select)
def _index_select(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, dim, index = args[0], int(args[1]) % args[0].dim(), args[2]
    if not isinstance(x, ShardedTensor):
        return _index_at(func, args, kwargs)
    if dim != x.shard_dim:
        if isinstance(index, ShardedTensor):
            raise refuse(
                func,
                args,
                kwargs,
                "a band indexed along another dim by a sharded index",
                "index it with a whole index (index.full_tensor())",
            )
        return _wrap(x, x.local.index_select(dim, index), x.shard_dim)
    m = x.manager
    if isinstance(index, ShardedTensor):  # each rank gets the rows its part of the index names
        spec = index.spec
        index = index.full_tensor().as_subclass(torch.Tensor)
    rows = [int(i) % x.spec.total for i in index.tolist()]
    if not isinstance(args[2], ShardedTensor):
        spec = m.partition.derived(len(rows), m.domain_world_size)
    return remap(x, spec, runs_of(rows))


def runs_of(rows: list[int]) -> Any:
    """``source(a, b)`` for :func:`mpidp.sharded.rows.remap`: positions ``[a, b)`` take the
    global rows ``rows[a:b]``, consecutive ones as one run."""

    def runs(a: int, b: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for r in rows[a:b]:
            if out and out[-1][1] == r:
                out[-1] = (out[-1][0], r + 1)
            else:
                out.append((r, r + 1))
        return out

    return runs


def gather_rows(
    x: ShardedTensor, index: torch.Tensor, spec: ShardSpec, take: Any = torch.gather
) -> ShardedTensor:
    """``torch.gather(x, x.shard_dim, index)`` for a band ``x`` and the whole ``index`` (global
    row ids, any order, repeats): the result is a band cut by ``spec`` along that dim. Each
    rank fetches the distinct rows its part of the index names (one exchange; the backward
    sends their gradients home and sums repeats), then gathers locally (backward: a
    scatter-add). Collective over the domain group."""
    d = x.shard_dim
    n = x.spec.total
    index = index % n
    parts = [index.narrow(d, spec.start(q), spec.sizes[q]) for q in range(spec.parts)]
    needed = [torch.unique(part) for part in parts]  # sorted
    sizes = ShardSpec(tuple(int(u.numel()) for u in needed))
    rows = [int(r) for u in needed for r in u.tolist()]
    fetched = remap(x, sizes, runs_of(rows))
    mine = needed[x.rank].to(index.device)
    local = torch.searchsorted(mine, parts[x.rank].contiguous())
    return ShardedTensor(take(fetched.local, d, local), spec, d, x.manager)


@register(torch.roll, torch.Tensor.roll)
def _roll(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    shifts = args[1] if len(args) > 1 else kwargs["shifts"]
    dims = args[2] if len(args) > 2 else kwargs.get("dims")
    if dims is None:
        raise refuse(func, args, kwargs, "roll of the flattened tensor", "pass dims")
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    d, n = x.shard_dim, x.spec.total
    own = [(s, i) for s, i in zip(shifts, dims, strict=True) if int(i) % x.dim() == d]
    rest = [(s, i) for s, i in zip(shifts, dims, strict=True) if int(i) % x.dim() != d]
    if rest:
        x = _wrap(x, x.local.roll([s for s, _ in rest], [i for _, i in rest]), d)
    shift = sum(s for s, _ in own) % n
    if not shift:
        return x

    def source(a: int, b: int) -> list[tuple[int, int]]:
        lo, hi = (a - shift) % n, (b - shift) % n  # rows [a, b) come from [a - s, b - s) mod n
        if b <= a:
            return []
        return [(lo, hi)] if lo < hi else [(lo, n), (0, hi)] if hi else [(lo, n)]

    return remap(x, x.spec, source)


@register(torch.flip, torch.Tensor.flip)
def _flip(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    dims = args[1:] if len(args) > 1 else [kwargs["dims"]]
    dims = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else list(dims)
    dims = [int(i) % x.dim() for i in dims]
    d, n = x.shard_dim, x.spec.total
    if d in dims:
        x = remap(x, x.spec, lambda a, b: [(n - b, n - a)] if b > a else [])
    return _wrap(x, x.local.flip(dims), d)


@register(torch.rot90, torch.Tensor.rot90, blocks=True)
def _rot90(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A quarter turn is a flip and a transpose (torch's own definition): the flip moves rows
    where it reverses the sharded dim, the transpose carries the band to the other dim (a
    band along H becomes a band along W, DLWP's cubed-sphere faces)."""
    x = args[0]
    k = int(args[1] if len(args) > 1 else kwargs.get("k", 1)) % 4
    d0, d1 = (int(i) for i in (args[2] if len(args) > 2 else kwargs.get("dims", (0, 1))))
    if k == 0:
        return x.clone()
    if k == 2:
        return x.flip((d0, d1))
    return x.flip(d1 if k == 1 else d0).transpose(d0, d1)


def _adopt(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ShardedTensor:
    """``out = torch.zeros(global shape); out[..., :k, :m] = band`` (FNO's spectral
    convolution): the plain target becomes, in place, a band of the dim the value is sharded
    along, cut by the manager's policy (its whole storage stays allocated, unused)."""
    x, index, value = args
    if not isinstance(value, ShardedTensor) or isinstance(x, Replicated) or x.requires_grad:
        raise refuse(
            func,
            args,
            kwargs,
            "a band written into a tensor that is not a band and cannot become one",
            "make the target from the band (x.new_zeros(global shape)) so it is a band too",
        )
    parts = index_parts(x, index)
    slices = [i for i, p in enumerate(parts) if not isinstance(p, int)]
    at = value.shard_dim + (len(slices) - value.dim())
    if any(p is None or isinstance(p, (torch.Tensor, list, bool)) for p in parts) or not (
        0 <= at < len(slices)
    ):
        raise refuse(func, args, kwargs, "this index with a band value", "use ints and slices")
    d = slices[at]
    m = value.manager
    spec = m.partition.derived(x.shape[d], m.domain_world_size)
    band = x.narrow(d, spec.start(m.domain_rank), spec.sizes[m.domain_rank]).clone()
    shape = x.shape
    x.__class__ = ShardedTensor
    x._local, x._spec, x._dim, x._manager, x._blocks = band, spec, d, m, 1
    x._shape, x._spectral = shape, value.spectral  # (a spectrum's modes: a band of modes)
    return x


def _is_mask(x: ShardedTensor, index: Any) -> bool:
    """Whether ``index`` is a boolean tensor of ``x``'s whole global shape (CREDIT's tracer
    fixer, ``q[q < 0] = 0``): writing a single value through it is ``masked_fill_``."""
    return (
        isinstance(index, torch.Tensor)
        and index.dtype == torch.bool
        and tuple(index.shape) == tuple(x.shape)
    )


@register(torch.Tensor.__setitem__, grid=True)
def _setitem(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x[index] = value`` with GLOBAL indices along the sharded dim: each rank writes the
    part of the selection it holds; a value that is a band is moved to the selection's
    partition first, a plain one of the selection's length is cut to this rank's part."""
    x, index, value = args
    one = not isinstance(value, torch.Tensor) or value.dim() == 0
    if isinstance(x, ShardedTensor) and _is_mask(x, index) and one:
        x.masked_fill_(index, value)  # ``x[x < t] = t``: element-wise, on the band or block
        return None
    block = next((a for a in args if isinstance(a, ShardedTensor) and a.grid is not None), None)
    if block is not None:  # the rest is band code
        raise blocks_refused(block.manager, f"{name_of(func)}({describe(args, kwargs)}) on a block")
    if not isinstance(x, ShardedTensor):
        x = _adopt(func, args, kwargs)
    parts = index_parts(x, index)
    if any(p is None or isinstance(p, (torch.Tensor, list, bool)) for p in parts):
        raise refuse(
            func, args, kwargs, "tensor, list, bool or None indices", "use ints and slices"
        )
    d, n = x.shard_dim, x.spec.total
    local_idx: list[Any] = []
    axis = 0
    spec = None
    for dim, p in enumerate(parts):
        if dim == d:
            if isinstance(p, int):
                i = p % n
                if not x.spec.start(x.rank) <= i < x.spec.stop(x.rank):
                    return _write_elsewhere(func, args, kwargs, x, parts)  # another rank's row
                local_idx.append(i - x.start)
                continue
            start, stop, step = p.indices(n)
            spec, mine = _keep(x, start, stop, step)
            local_idx.append(mine)
            axis = sum(1 for q in parts[:dim] if not isinstance(q, int))
        else:
            local_idx.append(p)
    ndim = sum(1 for q in parts if not isinstance(q, int))
    v = value
    if isinstance(v, ShardedTensor):
        if spec is None or v.dim() - (ndim - axis) != v.shard_dim:
            raise refuse(func, args, kwargs, "a band written across the sharded dim", "align them")
        v = to_spec(v, spec).local
    elif isinstance(v, torch.Tensor):
        v = _plain(v, x.transport)
        i = v.dim() - (ndim - axis)
        if spec is not None and i >= 0 and v.size(i) == spec.total and spec.total != 1:
            v = v.narrow(i, sum(spec.sizes[: x.rank]), spec.sizes[x.rank])
    x.local[tuple(local_idx)] = v
    return None


def _write_elsewhere(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], x: ShardedTensor, parts: list[Any]
) -> None:
    """``x[..., i, ...] = value`` on a rank that does not hold row ``i``: it writes nothing,
    but a value that requires grad still enters the band's history, as it does on the rank
    that writes it (an empty write: the row index as an empty slice, the value with an empty
    dim there). Serially the written tensor requires grad after the write; left out here, the
    band would not on this rank: its backward would skip the value's history, whose messages
    (the ``y[..., 0, :]`` read of another rank's row it was made from) every rank takes part
    in (HEALPix's corner patches: a crash at best, a silent pairing with the wrong message at
    worst)."""
    value, d = args[2], x.shard_dim
    if isinstance(value, ShardedTensor):  # as on the rank that holds the row: every rank
        raise refuse(func, args, kwargs, "a band written across the sharded dim", "align them")
    if not (isinstance(value, torch.Tensor) and value.requires_grad and torch.is_grad_enabled()):
        return None
    v = _plain(value, x.transport)  # as where it is written: its backward is collective
    idx = [slice(0, 0) if k == d else p for k, p in enumerate(parts)]
    pos = sum(1 for p in parts[:d] if not isinstance(p, int))  # where row i's dim would be
    shape = list(x.local[tuple(idx)].shape)  # the selection with an empty dim at ``pos``
    v = v.broadcast_to(shape[:pos] + shape[pos + 1 :]).unsqueeze(pos).narrow(pos, 0, 0)
    x.local[tuple(idx)] = v
    return None
