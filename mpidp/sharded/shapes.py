"""Handlers: shapes, indexing, joining, and products over unsharded dims.

* ``view``/``reshape``/``flatten``/``unflatten``/``squeeze``/``unsqueeze``: the global shape
  change is split into groups of dims; the sharded dim's group must start with it (dims of
  size 1 aside). Merged with the dims after it (``x.flatten(2)`` of (B, C, H, W)) the new dim is
  sharded by rows x W; split (H -> (H/p, p), a patch or window reshape) it is local when every
  band boundary falls on a multiple of p, and otherwise the tensor first moves to the nearest
  partition where it does (only boundary rows travel).
* ``permute``/``transpose``/``movedim``/``.T``: the sharded dim moves with its band.
* slicing, ``narrow``, ``select``, integer indexing along the sharded dim take GLOBAL indices:
  each rank keeps its rows of the selection (no communication; the partition may become
  uneven or empty on some ranks); ``index_select``, ``roll``, ``flip`` along it move rows
  (:mod:`mpidp.sharded.rows`).
* ``cat``/``stack``/``split``/``chunk``/``unbind``/``expand`` along other dims: local.
* ``F.linear``, ``matmul``, ``einsum``: local when the sharded dim is not contracted; an
  einsum that contracts it gives the global (Replicated) sum.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from mpidp.attention import query_rows_masks
from mpidp.collectives import all_gather_v, copy_to, reduce_from
from mpidp.partition import ShardSpec
from mpidp.sharded.dispatch import first_sharded, refuse, register
from mpidp.sharded.rows import fetch_rows as _fetch
from mpidp.sharded.rows import move_to_dim, remap, to_spec
from mpidp.sharded.tensor import Replicated, ShardedTensor, replicated

__all__: list[str] = []


def _wrap(
    x: ShardedTensor, local: torch.Tensor, axis: int, spec: ShardSpec | None = None
) -> ShardedTensor:
    return ShardedTensor(local, spec or x.spec, axis, x.manager)


def _shape_arg(args: Sequence[Any]) -> list[int]:
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return [int(s) for s in args[0]]
    return [int(s) for s in args]


# -- reshapes -----------------------------------------------------------------------------------


def _infer(old: list[int], new: list[int]) -> list[int]:
    if new.count(-1) == 1:
        known = math.prod(s for s in new if s != -1)
        new = [math.prod(old) // known if s == -1 else s for s in new]
    return new


def _groups(old: list[int], new: list[int]) -> list[tuple[int, int, int, int]]:
    """Runs of old dims [a, b) and new dims [c, e) with equal products."""
    out = []
    i = j = 0
    while i < len(old) and j < len(new):
        oi, nj, po, pn = i + 1, j + 1, old[i], new[j]
        while po != pn:
            if po < pn and oi < len(old):
                po *= old[oi]
                oi += 1
            elif nj < len(new):
                pn *= new[nj]
                nj += 1
            else:
                break
        out.append((i, oi, j, nj))
        i, j = oi, nj
    if i < len(old) or j < len(new):
        out.append((i, len(old), j, len(new)))
    return out


def reshape_sharded(x: ShardedTensor, new: list[int], what: str) -> ShardedTensor:
    old = list(x.shape)
    new = _infer(old, new)
    d, n = x.shard_dim, x.spec.total
    if math.prod(new) != math.prod(old) or 0 in old:
        raise ValueError(f"{what}: shape {new} is invalid for a tensor of shape {tuple(old)}")
    a, b, c, e = next(g for g in _groups(old, new) if g[0] <= d < g[1])
    if math.prod(old[a:d]) != 1 or n == 1:
        raise refuse(
            torch.Tensor.reshape,
            (x,),
            {},
            f"{what} to {tuple(new)} merges dims before the sharded dim {d} into it: the "
            f"result's rows would interleave the ranks' bands",
            "move the sharded dim first (permute) or reshape only the dims after it",
        )
    inner = math.prod(old[d + 1 : b])
    k = next((i for i in range(c, e) if new[i] != 1), c)
    stride = math.prod(new[k + 1 : e])
    if any((s * inner) % stride for s in x.spec.offsets[1:]):
        unit = stride // math.gcd(stride, inner)  # rows per new index
        x = to_spec(x, _aligned(x.spec, unit))
    sizes = tuple(s * inner // stride for s in x.spec.sizes)
    local_new = list(new)
    local_new[k] = sizes[x.rank]
    return _wrap(x, x.local.reshape(local_new), k, ShardSpec(sizes))


def _aligned(spec: ShardSpec, unit: int) -> ShardSpec:
    """The partition whose boundaries are ``spec``'s rounded to multiples of ``unit``."""
    bounds = [0]
    for off in spec.offsets[1:]:
        r = (off + unit // 2) // unit * unit  # the nearest multiple
        bounds.append(min(max(r, bounds[-1]), spec.total))
    bounds.append(spec.total)
    return ShardSpec(tuple(hi - lo for lo, hi in itertools.pairwise(bounds)))


@register(torch.Tensor.view, torch.Tensor.reshape, torch.reshape)
def _view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    rest = list(args[1:]) or [kwargs.get("shape", kwargs.get("size"))]
    if len(rest) == 1 and isinstance(rest[0], torch.dtype):
        if rest[0].itemsize != x.dtype.itemsize:
            raise refuse(func, args, kwargs, "a view as a dtype of another width", "use .to(dtype)")
        return _wrap(x, x.local.view(rest[0]), x.shard_dim)
    return reshape_sharded(x, _shape_arg(rest), "view" if func is torch.Tensor.view else "reshape")


@register(torch.Tensor.view_as, torch.Tensor.reshape_as)
def _view_as(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return reshape_sharded(args[0], list(args[1].shape), "view_as")


@register(torch.flatten, torch.Tensor.flatten)
def _flatten(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    nd = x.dim()
    start = int(args[1] if len(args) > 1 else kwargs.get("start_dim", 0)) % max(nd, 1)
    end = int(args[2] if len(args) > 2 else kwargs.get("end_dim", -1)) % max(nd, 1)
    shape = list(x.shape)
    new = [*shape[:start], math.prod(shape[start : end + 1]), *shape[end + 1 :]]
    return reshape_sharded(x, new, "flatten")


@register(torch.unflatten, torch.Tensor.unflatten)
def _unflatten(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    dim = int(args[1] if len(args) > 1 else kwargs["dim"]) % x.dim()
    sizes = list(args[2] if len(args) > 2 else kwargs["sizes"])
    shape = list(x.shape)
    if -1 in sizes:
        known = math.prod(s for s in sizes if s != -1)
        sizes = [shape[dim] // known if s == -1 else s for s in sizes]
    return reshape_sharded(x, shape[:dim] + sizes + shape[dim + 1 :], "unflatten")


@register(torch.squeeze, torch.Tensor.squeeze)
def _squeeze(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    shape = list(x.shape)
    if dim is None:
        drop = {i for i, s in enumerate(shape) if s == 1}
    else:
        dims = [dim] if isinstance(dim, int) else list(dim)
        drop = {int(i) % x.dim() for i in dims if shape[int(i) % x.dim()] == 1}
    drop.discard(x.shard_dim)  # a sharded dim of global length 1 is kept
    axis = x.shard_dim - sum(1 for i in drop if i < x.shard_dim)
    return _wrap(x, x.local.squeeze(tuple(sorted(drop))) if drop else x.local, axis)


@register(torch.unsqueeze, torch.Tensor.unsqueeze)
def _unsqueeze(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    dim = int(args[1] if len(args) > 1 else kwargs["dim"]) % (x.dim() + 1)
    axis = x.shard_dim + (1 if dim <= x.shard_dim else 0)
    return _wrap(x, x.local.unsqueeze(dim), axis)


# -- dim moves ------------------------------------------------------------------------------------

_MOVES = (
    torch.permute,
    torch.Tensor.permute,
    torch.transpose,
    torch.Tensor.transpose,
    torch.swapaxes,
    torch.Tensor.swapaxes,
    torch.swapdims,
    torch.Tensor.swapdims,
    torch.movedim,
    torch.Tensor.movedim,
    torch.moveaxis,
    torch.Tensor.moveaxis,
    torch.t,
    torch.Tensor.t,
    torch.adjoint,
    torch.Tensor.adjoint,
    ("__get__", "T"),
    ("__get__", "mT"),
    ("__get__", "H"),
    ("__get__", "mH"),
)


@register(*_MOVES)
def _move(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Where the sharded dim goes: the op applied to a meta tensor whose only dim of size 2 is
    the sharded one."""
    x = args[0]
    key = (func, x.dim(), x.shard_dim, repr(args[1:]), repr(kwargs))
    axis = _MOVED.get(key)
    if axis is None:
        marker = [1] * x.dim()
        marker[x.shard_dim] = 2
        probe = func(torch.empty(marker, device="meta"), *args[1:], **kwargs)
        axis = _MOVED.setdefault(key, list(probe.shape).index(2))
    return _wrap(x, func(x.local, *args[1:], **kwargs), axis)


_MOVED: dict[Any, int] = {}


# -- selecting rows --------------------------------------------------------------------------------


def _keep(x: ShardedTensor, start: int, stop: int, step: int) -> tuple[ShardSpec, slice]:
    """The partition of rows ``range(start, stop, step)`` when each rank keeps its own, and
    this rank's local slice."""
    sizes = []
    mine = slice(0, 0)
    for r in range(x.spec.parts):
        lo, hi = x.spec.start(r), x.spec.stop(r)
        first = start if lo <= start else start + -(-(lo - start) // step) * step
        last = min(hi, stop)
        count = max(0, -(-(last - first) // step)) if first < last else 0
        sizes.append(count)
        if r == x.rank:
            mine = (
                slice(first - lo, first - lo + (count - 1) * step + 1, step)
                if count
                else slice(0, 0)
            )
    return ShardSpec(tuple(sizes)), mine


def _one_row(x: ShardedTensor, i: int) -> Replicated:
    """Row ``i`` along the sharded dim (the dim removed), on every rank."""
    spec, mine = _keep(x, i, i + 1, 1)
    band = ShardedTensor(
        x.local[(slice(None),) * x.shard_dim + (mine,)], spec, x.shard_dim, x.manager
    )
    whole = band.full_tensor()
    return replicated(whole.as_subclass(torch.Tensor).squeeze(x.shard_dim), x.transport)


def _index_parts(x: ShardedTensor, index: Any) -> list[Any]:
    parts = list(index) if isinstance(index, tuple) else [index]
    used = sum(1 for p in parts if p is not None and p is not Ellipsis and not isinstance(p, bool))
    at = next((i for i, p in enumerate(parts) if p is Ellipsis), None)
    if at is not None:
        parts[at : at + 1] = [slice(None)] * (x.dim() - used)
    return parts + [slice(None)] * (x.dim() - sum(1 for p in parts if p is not None))


@register(torch.Tensor.__getitem__)
def _getitem(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, index = args[0], args[1]
    parts = _index_parts(x, index)
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
        if dim == d:
            if isinstance(p, int):  # the row, on every rank; the other parts index it
                row = _one_row(x, p % n)
                rest = (*local_idx, *parts[at + 1 :])
                return row[rest] if rest else row
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
    return ShardedTensor(x.local[tuple(local_idx)], spec, axis, x.manager)


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


@register(torch.index_select, torch.Tensor.index_select)
def _index_select(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, dim, index = args[0], int(args[1]) % args[0].dim(), args[2]
    if dim != x.shard_dim:
        return _wrap(x, x.local.index_select(dim, index), x.shard_dim)
    rows = [int(i) % x.spec.total for i in index.tolist()]
    m = x.manager
    spec = m.partition.spec(len(rows), m.domain_world_size)

    def runs(a: int, b: int) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for r in rows[a:b]:
            if out and out[-1][1] == r:
                out[-1] = (out[-1][0], r + 1)
            else:
                out.append((r, r + 1))
        return out

    return remap(x, spec, runs)


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


# -- joining and splitting ------------------------------------------------------------------------


def _bands(
    func: Any,
    args: Any,
    kwargs: Any,
    tensors: Sequence[Any],
    ndim: int,
    axis: int,
    ref: ShardedTensor,
) -> list[torch.Tensor]:
    """Each of ``tensors`` as this rank's band of the same partition (the sharded dim at
    ``axis`` of ``ndim`` dims)."""
    out = []
    for a in tensors:
        if isinstance(a, ShardedTensor):
            if a.dim() != ndim or a.shard_dim != axis or a.spec.total != ref.spec.total:
                raise refuse(
                    func,
                    args,
                    kwargs,
                    "ShardedTensors sharded along different dims meet",
                    "redistribute one of them",
                )
            out.append(to_spec(a, ref.spec).local)
            continue
        if isinstance(a, Replicated):
            a = copy_to(a.as_subclass(torch.Tensor), ref.transport)
        if a.dim() == ndim and a.size(axis) == ref.spec.total:
            out.append(a.narrow(axis, ref.start, ref.spec.sizes[ref.rank]))
        else:
            raise refuse(
                func,
                args,
                kwargs,
                f"a plain tensor of shape {tuple(a.shape)} joins a band",
                "pass a tensor of the global shape (it is cut to each rank's rows)",
            )
    return out


@register(torch.cat, torch.concat, torch.concatenate)
def _cat(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors = list(args[0] if args else kwargs["tensors"])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
    ref = first_sharded(tensors)
    dim = int(dim) % ref.dim()
    if dim == ref.shard_dim:
        return _cat_rows(func, args, kwargs, tensors, ref)
    locals_ = _bands(func, args, kwargs, tensors, ref.dim(), ref.shard_dim, ref)
    return _wrap(ref, torch.cat(locals_, dim), ref.shard_dim)


def _cat_rows(
    func: Any, args: Any, kwargs: Any, tensors: Sequence[Any], ref: ShardedTensor
) -> ShardedTensor:
    """Concatenation along the sharded dim (pole rows around a band, a padded border): the
    result is cut by the manager's policy of the total length, and each rank fetches its rows
    from every piece (one all-to-all per ShardedTensor piece; a plain piece is whole on every
    rank and is cut locally)."""
    d, m, t = ref.shard_dim, ref.manager, ref.transport
    lengths = [int(a.shape[d]) for a in tensors]
    spec = m.partition.spec(sum(lengths), m.domain_world_size)
    me = ref.rank
    parts = []
    at = 0
    for a, n in zip(tensors, lengths, strict=True):
        lo, hi = at, at + n

        def mine(q: int, lo: int = lo, hi: int = hi) -> list[tuple[int, int]]:
            s, e = max(spec.start(q), lo), min(spec.stop(q), hi)
            return [(s - lo, e - lo)] if e > s else []

        if isinstance(a, ShardedTensor):
            if a.dim() != ref.dim() or a.shard_dim != d:
                raise refuse(
                    func, args, kwargs, "pieces sharded along different dims", "redistribute"
                )
            parts.append(_fetch(a, [mine(q) for q in range(spec.parts)]))
        else:
            a = _plain(a, t)
            runs = mine(me)
            s, e = runs[0] if runs else (0, 0)
            parts.append(a.narrow(d, s, e - s))
        at = hi
    return ShardedTensor(torch.cat(parts, d), spec, d, m)


@register(torch.stack)
def _stack(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors = list(args[0] if args else kwargs["tensors"])
    ref = first_sharded(tensors)
    dim = int(args[1] if len(args) > 1 else kwargs.get("dim", 0)) % (ref.dim() + 1)
    locals_ = _bands(func, args, kwargs, tensors, ref.dim(), ref.shard_dim, ref)
    axis = ref.shard_dim + (1 if dim <= ref.shard_dim else 0)
    return _wrap(ref, torch.stack(locals_, dim), axis)


@register(
    torch.split,
    torch.Tensor.split,
    torch.chunk,
    torch.Tensor.chunk,
    torch.unbind,
    torch.Tensor.unbind,
    torch.tensor_split,
    torch.Tensor.tensor_split,
)
def _split(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    is_unbind = func in (torch.unbind, torch.Tensor.unbind)
    dim_at = 1 if is_unbind else 2
    dim = int(args[dim_at] if len(args) > dim_at else kwargs.get("dim", 0)) % x.dim()
    if dim == x.shard_dim:
        raise refuse(
            func,
            args,
            kwargs,
            "splitting along the sharded dim",
            "narrow or slice with global rows",
        )
    parts = func(x.local, *args[1:], **kwargs)
    axis = x.shard_dim - (1 if is_unbind and dim < x.shard_dim else 0)
    return type(parts)(_wrap(x, p, axis) for p in parts)


@register(
    torch.Tensor.expand, torch.broadcast_to, torch.Tensor.broadcast_to, torch.Tensor.expand_as
)
def _expand(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    if func is torch.Tensor.expand_as:
        sizes = list(args[1].shape)
    else:
        sizes = _shape_arg(args[1:] or [kwargs.get("size")])
    axis = len(sizes) - x.dim() + x.shard_dim
    if sizes[axis] not in (-1, x.spec.total):
        raise refuse(func, args, kwargs, "expanding the sharded dim", "expand other dims")
    sizes[axis] = x.spec.sizes[x.rank]
    return _wrap(x, x.local.expand(sizes), axis)


@register(torch.Tensor.repeat)
def _repeat(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    reps = _shape_arg(args[1:])
    axis = len(reps) - x.dim() + x.shard_dim
    if reps[axis] != 1:
        raise refuse(func, args, kwargs, "repeating along the sharded dim", "repeat other dims")
    return _wrap(x, x.local.repeat(reps), axis)


# -- products over unsharded dims ---------------------------------------------------------------


def _plain(a: Any, t: Any) -> Any:
    if isinstance(a, Replicated):
        return copy_to(a.as_subclass(torch.Tensor), t)
    return a


@register(F.linear)
def _linear(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    if not isinstance(x, ShardedTensor) or x.shard_dim == x.dim() - 1:
        raise refuse(
            func, args, kwargs, "a linear map over the sharded dim", "shard along another dim"
        )
    t = x.transport
    rest = tree_map(lambda a: _plain(a, t), (args[1:], kwargs))
    return _wrap(x, F.linear(x.local, *rest[0], **rest[1]), x.shard_dim)


def whole(x: ShardedTensor) -> torch.Tensor:
    """``x`` gathered on every rank for a computation that differs by rank (the partial
    rule: the backward sums every rank's gradient and hands each band its rows)."""
    return all_gather_v(x.local, list(x.spec.sizes), x.shard_dim, group=x.transport)


@register(
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__,
    torch.mm,
    torch.bmm,
    torch.Tensor.mm,
    torch.Tensor.bmm,
)
def _matmul(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if len(args) != 2 or kwargs:
        raise refuse(func, args, kwargs, "a product of other than two tensors", "pass two")
    a, b = args[0], args[1]
    if func is torch.Tensor.__rmatmul__:
        a, b = b, a
    out_ndim = max(a.dim(), b.dim())
    ok = True
    if isinstance(a, ShardedTensor) and isinstance(b, ShardedTensor):
        na, nb = a.dim(), b.dim()
        if a.shard_dim < na - 2 and na - a.shard_dim == nb - b.shard_dim:  # a batch dim of both
            b = to_spec(b, a.spec)
        elif a.shard_dim == na - 2 and nb >= 2:  # a's rows: b whole on every rank (k, v)
            b = whole(b)
        elif nb >= 2 and b.shard_dim == nb - 1 and na >= 2:  # b's columns: a whole
            a = whole(a)
        elif a.shard_dim == na - 1 and nb >= 2 and b.shard_dim == nb - 2:  # both contracted
            t = a.transport
            partial = torch.matmul(a.local, to_spec(b, a.spec).local)
            return replicated(reduce_from(partial, t), t)
        else:
            ok = False
    elif isinstance(a, ShardedTensor):
        ok = a.shard_dim != a.dim() - 1 and a.dim() >= 2
    else:
        ok = b.dim() >= 2 and b.shard_dim != b.dim() - 2
    ref = first_sharded((a, b))
    t = ref.transport
    if not ok:
        raise refuse(
            func,
            args,
            kwargs,
            "a product that contracts the sharded dim (or two bands of different rows)",
            "contract other dims, or gather one side (full_tensor())",
        )
    x = ref
    axis = out_ndim - x.dim() + x.shard_dim
    if b.dim() == 1 and x is a:
        axis = x.shard_dim  # the last dim is dropped, the sharded dim is before it

    def band_of(op: Any) -> torch.Tensor:
        if isinstance(op, ShardedTensor):
            return op.local
        op = _plain(op, t)
        i = op.dim() - (x.dim() - x.shard_dim)  # the plain operand's dim beside the bands'
        if op.dim() > 2 and i >= 0 and i < op.dim() - 2 and op.size(i) != 1:
            if op.size(i) != x.spec.total:
                raise refuse(
                    func,
                    args,
                    kwargs,
                    f"a plain operand of shape {tuple(op.shape)} has {op.size(i)} entries "
                    f"along the batch dim the bands are cut along ({x.spec.total} rows)",
                    "pass the global length or 1 there",
                )
            op = op.narrow(i, x.start, x.spec.sizes[x.rank])
        return op

    return _wrap(x, torch.matmul(band_of(a), band_of(b)), axis)


def _expand_ellipsis(eq: str, ops: Sequence[Any]) -> str:
    """``eq`` with each '...' spelled out in letters the equation does not use (right-aligned
    broadcasting dims, as torch aligns them)."""
    if "..." not in eq and "->" in eq:
        return eq
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in eq]
    widths = [op.dim() - len(term.replace("...", "")) for term, op in zip(terms, ops, strict=True)]
    most = max((w for t, w in zip(terms, widths, strict=True) if "..." in t), default=0)
    fill = "".join(spare[:most])
    terms = [t.replace("...", fill[most - w :]) for t, w in zip(terms, widths, strict=True)]
    if arrow:
        rhs = rhs.replace("...", fill)
    else:
        counted = "".join(t for t in terms)
        rhs = fill + "".join(sorted(c for c in set(counted) - set(fill) if counted.count(c) == 1))
    return ",".join(terms) + "->" + rhs


@register(torch.einsum)
def _einsum(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    eq = _expand_ellipsis(args[0].replace(" ", ""), ops)
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    ref = first_sharded(ops)
    letter = terms[next(i for i, o in enumerate(ops) if o is ref)][ref.shard_dim]
    t = ref.transport
    local_ops = []
    for term, op in zip(terms, ops, strict=True):
        if isinstance(op, ShardedTensor):
            if term[op.shard_dim] != letter:
                raise refuse(
                    func,
                    args,
                    kwargs,
                    "operands sharded along different letters",
                    "redistribute one",
                )
            local_ops.append(to_spec(op, ref.spec).local)
        else:
            op = _plain(op, t)
            if letter in term and op.size(term.index(letter)) == ref.spec.total:
                op = op.narrow(term.index(letter), ref.start, ref.spec.sizes[ref.rank])
            elif letter in term and op.size(term.index(letter)) != 1:
                raise refuse(
                    func,
                    args,
                    kwargs,
                    "a plain operand of another length along the sharded letter",
                    "pass the global length",
                )
            local_ops.append(op)
    out = torch.einsum(f"{lhs}->{rhs}", *local_ops)
    if letter in rhs:
        return _wrap(ref, out, rhs.index(letter))
    return replicated(reduce_from(out, t), t)


@register(torch.view_as_complex, torch.view_as_real)
def _view_complex(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The last dim of two (real, imaginary) taken away or added: the sharded dim stays."""
    x = args[0]
    if func is torch.view_as_complex and x.shard_dim == x.dim() - 1:
        raise refuse(
            func,
            args,
            kwargs,
            "the (real, imaginary) dim is the sharded one",
            "shard along another dim",
        )
    return _wrap(
        x, func(x.local.contiguous() if func is torch.view_as_complex else x.local), x.shard_dim
    )


@register(
    torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty, torch.Tensor.new_full
)
def _new(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A new tensor of a global shape whose length along the sharded dim is the global one is
    a band of the same partition (zeros to fill with ``out[..., :k] = ...``); any other shape
    is a plain tensor, the same on every rank."""
    x = args[0]
    if func is torch.Tensor.new_full:
        size, rest = list(args[1]), args[2:]
    else:
        size, rest = _shape_arg(args[1:] or [kwargs.pop("size")]), ()
    if len(size) == x.dim() and size[x.shard_dim] == x.spec.total:
        size[x.shard_dim] = x.spec.sizes[x.rank]
        return _wrap(x, func(x.local, size, *rest, **kwargs), x.shard_dim)
    return func(x.local, size, *rest, **kwargs)


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
    parts = _index_parts(x, index)
    slices = [i for i, p in enumerate(parts) if not isinstance(p, int)]
    at = value.shard_dim + (len(slices) - value.dim())
    if any(p is None or isinstance(p, (torch.Tensor, list, bool)) for p in parts) or not (
        0 <= at < len(slices)
    ):
        raise refuse(func, args, kwargs, "this index with a band value", "use ints and slices")
    d = slices[at]
    m = value.manager
    spec = m.partition.spec(x.shape[d], m.domain_world_size)
    band = x.narrow(d, spec.start(m.domain_rank), spec.sizes[m.domain_rank]).clone()
    x.__class__ = ShardedTensor
    x._local, x._spec, x._dim, x._manager = band, spec, d, m
    return x


@register(torch.Tensor.__setitem__)
def _setitem(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``x[index] = value`` with GLOBAL indices along the sharded dim: each rank writes the
    part of the selection it holds; a value that is a band is moved to the selection's
    partition first, a plain one of the selection's length is cut to this rank's part."""
    x, index, value = args
    if not isinstance(x, ShardedTensor):
        x = _adopt(func, args, kwargs)
    parts = _index_parts(x, index)
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
                    return None  # another rank holds that row
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


def _ulysses(
    func: Any, q: ShardedTensor, k: Any, v: Any, a: dict[str, Any]
) -> ShardedTensor | None:
    """DeepSpeed-Ulysses on uneven cuts: one all-to-all each takes q, k and v from
    sequence-cut to head-cut (7 heads over 4 ranks: 2, 2, 2, 1), every rank attends its heads
    over the whole sequence with torch's kernel, one all-to-all takes the result back to q's
    rows. K and V are never whole on a rank. None when it does not apply (fewer heads than
    ranks, grouped-query heads, keys not cut along the sequence, a mask cut into bands):
    then the keys and values are gathered instead."""
    p, n = q.spec.parts, q.dim()
    mask = a.get("attn_mask")
    if (
        n != 4
        or q.shape[1] < p
        or not all(isinstance(z, ShardedTensor) and z.shard_dim == n - 2 for z in (k, v))
        or k.shape[1] != q.shape[1]
        or isinstance(mask, ShardedTensor)
    ):
        return None
    heads = ShardSpec.balanced(q.shape[1], p)
    qh, kh, vh = (move_to_dim(z, 1, heads) for z in (q, k, v))
    if isinstance(mask, torch.Tensor):
        mask = _plain(mask, q.transport)
        if mask.dim() == 4 and mask.size(1) == q.shape[1] and q.shape[1] != 1:
            mask = mask.narrow(1, heads.start(q.rank), heads.sizes[q.rank])
    kw = {**a, "attn_mask": mask}
    y = ShardedTensor(func(qh.local, kh.local, vh.local, **kw), heads, 1, q.manager)
    return move_to_dim(y, n - 2, q.spec)


@register(F.scaled_dot_product_attention)
def _sdpa(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Attention with the queries cut along the sequence (dim -2): every rank gathers the keys
    and values whole and attends its own queries to all of them (exact: torch's kernel on
    every query row; K and V whole on every rank, the attention matrix only for its rows). An
    additive or boolean mask of the global (L, S) shape is cut to the rows; ``is_causal``
    becomes the mask of the rows' global positions. Queries cut along a batch or head dim
    (keys and values cut the same way) attend locally."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    a = dict(zip(names, args, strict=False))
    a.update(kwargs)
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    if not isinstance(q, ShardedTensor):
        raise refuse(func, args, kwargs, "keys or values cut but not the queries", "shard q")
    t, n = q.transport, q.dim()
    if q.shard_dim < n - 2:  # heads or batch: independent problems
        k2, v2 = (to_spec(z, q.spec).local if isinstance(z, ShardedTensor) else z for z in (k, v))
        mask = a.get("attn_mask")
        if isinstance(mask, ShardedTensor):
            a["attn_mask"] = to_spec(mask, q.spec).local
        return _wrap(q, func(q.local, k2, v2, **a), q.shard_dim)
    if q.shard_dim != n - 2:
        raise refuse(func, args, kwargs, "queries cut along the head dim size", "cut the sequence")
    ulysses = _ulysses(func, q, k, v, a)
    if ulysses is not None:
        return ulysses
    k2, v2 = (whole(z) if isinstance(z, ShardedTensor) else _plain(z, t) for z in (k, v))
    rows, start = q.spec.sizes[q.rank], q.start
    mask = a.get("attn_mask")
    if isinstance(mask, ShardedTensor):
        mask = to_spec(mask, q.spec).local if mask.shard_dim == mask.dim() - 2 else whole(mask)
    elif isinstance(mask, torch.Tensor):
        mask = _plain(mask, t)
        if mask.dim() >= 2 and mask.size(-2) == q.spec.total and q.spec.total != 1:
            mask = mask.narrow(-2, start, rows)
    if a.pop("is_causal", False):
        s = k2.size(-2)
        r = torch.arange(start, start + rows, device=q.local.device).unsqueeze(-1)
        causal = torch.arange(s, device=q.local.device) <= r
        mask = causal if mask is None else mask & causal
    a["attn_mask"] = mask
    return _wrap(q, func(q.local, k2, v2, **a), q.shard_dim)


_MHA_ARGS = tuple(inspect.signature(F.multi_head_attention_forward).parameters)


@register(F.multi_head_attention_forward)
def _mha(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``nn.MultiheadAttention`` with the queries cut along the sequence (dim 0 of the
    ``(L, B, E)`` or ``(L, E)`` torch's module passes): the keys and values are gathered whole
    and each rank attends its queries to all of them with torch's code (as the converted
    module does; exact for any heads, masks, ``bias_k``, ``need_weights``). Masks of the
    global shapes are cut to the rows; output and weights are cut along L."""
    a = dict(zip(_MHA_ARGS, args, strict=False))
    a.update(kwargs)
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    if not isinstance(q, ShardedTensor) or q.shard_dim != 0:
        raise refuse(func, args, kwargs, "queries not cut along the sequence", "cut the tokens")
    t = q.transport
    k2 = whole(k) if isinstance(k, ShardedTensor) else _plain(k, t)
    v2 = k2 if v is k else whole(v) if isinstance(v, ShardedTensor) else _plain(v, t)
    kpm = a.get("key_padding_mask")
    kpm = whole(kpm) if isinstance(kpm, ShardedTensor) else _plain(kpm, t)
    a["key_padding_mask"] = kpm
    mask = a.get("attn_mask")
    mask = whole(mask) if isinstance(mask, ShardedTensor) else _plain(mask, t)
    a["attn_mask"] = query_rows_masks(mask, kpm, q.spec, q.rank, k2.size(0), func.__name__)
    if a.get("is_causal") and a["attn_mask"] is None:
        raise refuse(func, args, kwargs, "is_causal without attn_mask", "pass the causal mask")
    a["is_causal"] = False
    a = {n: _plain(z, t) for n, z in a.items()}
    out, weights = func(q.local, k2, v2, **a)
    return _wrap(q, out, 0), None if weights is None else _wrap(q, weights, weights.dim() - 2)
