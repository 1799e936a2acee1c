"""Handlers of calls with a latitude x longitude block (``ShardedTensor.grid``): the views and
joins that leave both cut dims whole, and reductions over them (the element-wise and batch
rules are the bands' own, per cut axis: :mod:`mpidp.sharded.pointwise`,
:mod:`mpidp.sharded.batch`).

A block is cut along its latitude dim over the latitude column and along its longitude dim over
the longitude row (:mod:`mpidp.runtime.grid`). Each rule here is the band rule once per cut
axis; a call these rules (or a band handler registered with ``grid=True``: the converted
layers' calls, metadata, copies) do not know is refused on every rank
(:func:`mpidp.runtime.grid.blocks_refused`), never computed on the block as if it were a band.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from mpidp.ops.collectives import fetch_global_rows
from mpidp.runtime.grid import AXES, BlockSpec, axis_transport
from mpidp.runtime.partition import ShardSpec
from mpidp.sharded.cuts import placed
from mpidp.sharded.dispatch import _HANDLERS, MERGED_FIX, key, refuse, register_grid
from mpidp.sharded.pointwise import to_blocks
from mpidp.sharded.select import index_parts, kept
from mpidp.sharded.shapes import _aligned, _groups, plan_cut
from mpidp.sharded.tensor import ShardedTensor
from mpidp.sharded.tokens import REDUCE as _REDUCE
from mpidp.sharded.tokens import block_to_tokens

__all__: list[str] = []


def _block_of(x: ShardedTensor) -> BlockSpec:
    g = x.grid
    assert isinstance(g, BlockSpec)
    return g


# -- selecting ----------------------------------------------------------------------------------


def _sliced(x: ShardedTensor, parts: list[Any], call: tuple[Any, Any, Any]) -> ShardedTensor:
    """``x[parts]`` for ints and slices: along a cut dim each rank keeps its own rows of the
    slice (no communication; the cut may become uneven, or empty on some ranks), as on bands."""
    g = _block_of(x)
    cuts = dict(zip(g.dims, zip((g.lat, g.lon), x.manager.grid_coords, strict=True), strict=True))
    local_idx: list[Any] = []
    out_specs: dict[int, tuple[int, Any]] = {}
    dim = out = 0
    for p in parts:
        if p is None:
            local_idx.append(None)
            out += 1
            continue
        if not isinstance(p, (int, slice)):
            raise refuse(*call, "tensor, list or boolean indexing of a block", "use slices")
        if dim in cuts:
            spec, i = cuts[dim]
            if isinstance(p, int):
                raise refuse(*call, "an integer index along a cut dim", "slice it (i:i+1)")
            if p != slice(None) and g.lead[g.dims.index(dim)] > 1:
                raise refuse(*call, "a slice of a cut dim that holds merged blocks", MERGED_FIX)
            if p != slice(None):
                spec, p = kept(spec, i, *p.indices(spec.total))
            out_specs[dim] = (out, spec)
        local_idx.append(p)
        if not isinstance(p, int):
            out += 1
        dim += 1
    (lat_at, lat), (lon_at, lon) = out_specs[g.dims[0]], out_specs[g.dims[1]]
    grid = BlockSpec(lat, lon, (lat_at, lon_at), g.lead)
    return ShardedTensor(x.local[tuple(local_idx)], lat, lat_at, x.manager, grid=grid)


@register_grid(torch.Tensor.__getitem__, blocks=True)
def _getitem(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    if not isinstance(x, ShardedTensor) or x.grid is None:
        raise refuse(func, args, kwargs, "indexing by a block", "index with ints and slices")
    return _sliced(x, index_parts(x, args[1]), (func, args, kwargs))


@register_grid(torch.narrow, torch.Tensor.narrow, blocks=True)
def _narrow(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, dim, start, length = args[0], int(args[1]) % args[0].dim(), int(args[2]), int(args[3])
    start %= x.shape[dim]
    parts: list[Any] = [slice(None)] * x.dim()
    parts[dim] = slice(start, start + length)
    return _sliced(x, parts, (func, args, kwargs))


# -- reductions ---------------------------------------------------------------------------------


@register_grid(*_REDUCE, blocks=True)
def _reduce(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A reduction over neither cut dim runs on the block; over both, the band rule's exact
    global value over the domain group (a partial sum and one all-reduce; amax with torch's
    gradient), Replicated. Over one cut dim alone its result would be cut along the other dim
    and repeated along the first: refused."""
    x = args[0]
    g, nd = _block_of(x), x.dim()
    dim = args[1] if len(args) > 1 else kwargs.get("dim", _REDUCE[func])
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        dims = set(range(nd))
    else:
        dims = {int(d) % nd for d in ([dim] if isinstance(dim, int) else dim)}
    cut = dims & set(g.dims)
    if len(cut) == 2:  # the band rule's global path: its "transport" is the domain group
        return _HANDLERS[key(func)](func, args, kwargs)
    if cut:
        raise refuse(
            func,
            args,
            kwargs,
            f"a reduction over one of a block's two cut dims ({sorted(cut)}) leaves a result "
            f"cut along the other and repeated along the first, which no ShardedTensor is",
            "reduce over both cut dims (a global value) or neither, or gather (.full_tensor())",
        )
    local = func(x.local, *args[1:], **kwargs)
    if keepdim:
        return x.like(local)
    return placed(x, local, tuple(d - sum(1 for r in dims if r < d) for d in g.dims))


@register_grid(torch.roll, torch.Tensor.roll, blocks=True)
def _roll(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A roll (a shifted window's cyclic shift): along a cut dim the band rule over that
    axis's group (each rank fetches the rows or columns that roll into its block, one
    all-to-all per axis); along other dims, on the block."""
    x = args[0]
    g, nd = _block_of(x), x.dim()
    shifts = args[1] if len(args) > 1 else kwargs["shifts"]
    dims = args[2] if len(args) > 2 else kwargs.get("dims")
    if dims is None:
        raise refuse(func, args, kwargs, "roll of the flattened tensor", "pass dims")
    pairs = list(
        zip(
            [shifts] if isinstance(shifts, int) else shifts,
            [int(d) % nd for d in ([dims] if isinstance(dims, int) else dims)],
            strict=True,
        )
    )
    rest = [(s, d) for s, d in pairs if d not in g.dims]
    local = x.local.roll(*map(list, zip(*rest, strict=True))) if rest else x.local
    for axis, d, spec, lead in zip(AXES, g.dims, (g.lat, g.lon), g.lead, strict=True):
        n = spec.total
        shift = sum(s for s, e in pairs if e == d) % (n * lead)
        if shift and lead > 1:
            raise refuse(func, args, kwargs, "a roll of a cut dim with merged blocks", MERGED_FIX)
        if shift:  # rows [a, b) come from [a - shift, b - shift) mod n
            wanted = [_rolled(spec.start(q), spec.stop(q), shift, n) for q in range(spec.parts)]
            t = axis_transport(x.manager, axis, local.device)
            local = fetch_global_rows(local, spec, d, wanted, t)
    return ShardedTensor(local, g.lat, g.dims[0], x.manager, grid=g)


def _rolled(a: int, b: int, shift: int, n: int) -> list[tuple[int, int]]:
    lo, hi = (a - shift) % n, (b - shift) % n
    if b <= a:
        return []
    return [(lo, hi)] if lo < hi else [(lo, n), (0, hi)] if hi else [(lo, n)]


# -- views and joins that leave both cut dims whole ---------------------------------------------

_MOVES = (
    torch.permute,
    torch.Tensor.permute,
    torch.transpose,
    torch.Tensor.transpose,
    torch.swapaxes,
    torch.Tensor.swapaxes,
    torch.movedim,
    torch.Tensor.movedim,
    torch.unsqueeze,
    torch.Tensor.unsqueeze,
    torch.squeeze,
    torch.Tensor.squeeze,
)


#: the sizes that mark the cut dims in :func:`_move`'s probe (a meta tensor: nothing allocated)
_MARKS = (1_000_003, 1_000_033)


@register_grid(*_MOVES, blocks=True)
def _move(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Where the cut dims go: the op applied to a meta tensor of the global shape whose cut
    dims are marked by sizes no other dim has. A squeeze that could take a cut dim (a field
    one row tall) is refused."""
    x = args[0]
    g = _block_of(x)
    marker = list(x.shape)
    marker[g.dims[0]], marker[g.dims[1]] = _MARKS
    probe = func(torch.empty(marker, device="meta"), *args[1:], **kwargs)
    shape = list(probe.shape)
    if min(g.shape) == 1 or any(shape.count(k) != 1 for k in _MARKS):
        raise refuse(func, args, kwargs, "it could move a cut dim out of sight", "gather first")
    dims = (shape.index(_MARKS[0]), shape.index(_MARKS[1]))
    return placed(x, func(x.local, *args[1:], **kwargs), dims)


@register_grid(torch.Tensor.view, torch.Tensor.reshape, torch.reshape, blocks=True)
def _view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The band rule once per cut dim (:func:`~mpidp.sharded.shapes.plan_cut`): a cut dim
    merged with the dims after it (a pixel shuffle's (H, r) -> H r) or split (a patch's
    H -> (H / p, p)) stays cut, each rank's rows becoming its entries of the new dim; where a
    boundary falls off the new unit, the rows that change owner move first, along that axis
    alone. The two cut dims merged into one dim are tokens (:mod:`mpidp.sharded.tokens`).
    Kept apart, the dims merged before a cut dim (a batch above 1 with the window index that
    holds the cut) become its ``lead`` (:class:`~mpidp.runtime.grid.BlockSpec`): the band
    rule's merged blocks, each rank holding its part of every run; split off again
    (``window_reverse``) they leave it."""
    x = args[0]
    g = _block_of(x)
    raw = args[1:] if len(args) > 1 else (kwargs.get("shape"),)
    new = list(raw[0]) if len(raw) == 1 and not isinstance(raw[0], int) else list(raw)
    old = list(x.shape)
    if -1 in new:
        i = new.index(-1)
        rest = math.prod(n for j, n in enumerate(new) if j != i)
        new[i] = math.prod(old) // max(rest, 1)
    call = (func, args, kwargs)
    runs = [next(r for r in _groups(old, new) if r[0] <= d < r[1]) for d in g.dims]
    if math.prod(new) != math.prod(old) or 0 in old:
        raise refuse(*call, "a reshape to another number of entries", "give a valid shape")
    if runs[0] == runs[1]:  # rows x columns flattened: tokens (mpidp.sharded.tokens)
        return block_to_tokens(x, new, call)
    plans = [
        plan_cut(old, new, d, spec, lead, "reshape", call)
        for d, spec, lead in zip(g.dims, (g.lat, g.lon), g.lead, strict=True)
    ]
    aligned = [
        _aligned(spec, unit) for spec, (_, _, unit, _) in zip((g.lat, g.lon), plans, strict=True)
    ]
    x = to_blocks(x, replace(g, lat=aligned[0], lon=aligned[1]), call)
    specs = [
        ShardSpec(tuple(s * num // den for s in spec.sizes))
        for spec, (_, _, _, (num, den)) in zip(aligned, plans, strict=True)
    ]
    local_new = list(new)
    for (k, merged, _, _), spec, i in zip(plans, specs, x.manager.grid_coords, strict=True):
        local_new[k] = merged * spec.sizes[i]
    dims, lead = (plans[0][0], plans[1][0]), (plans[0][1], plans[1][1])
    out = BlockSpec(specs[0], specs[1], dims, lead)
    return ShardedTensor(x.local.reshape(local_new), out.lat, out.dims[0], x.manager, grid=out)


@register_grid(torch.flatten, torch.Tensor.flatten, blocks=True)
def _flatten(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    start = int(args[1] if len(args) > 1 else kwargs.get("start_dim", 0)) % max(x.dim(), 1)
    end = int(args[2] if len(args) > 2 else kwargs.get("end_dim", -1)) % max(x.dim(), 1)
    shape = [*x.shape[:start], math.prod(x.shape[start : end + 1]), *x.shape[end + 1 :]]
    return _view(torch.reshape, (x, shape), {})


@register_grid(torch.cat, torch.concat, torch.concatenate, torch.stack, blocks=True)
def _join(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Blocks of one layout joined along a dim that is not cut: the blocks joined."""
    tensors = list(args[0] if args else kwargs["tensors"])
    d = int(args[1] if len(args) > 1 else kwargs.get("dim", 0))
    ref = next(t for t in tensors if isinstance(t, ShardedTensor))
    g, nd = _block_of(ref), ref.dim()
    stack = func is torch.stack
    d = d % (nd + 1 if stack else nd)
    if not all(isinstance(t, ShardedTensor) and t.grid is not None for t in tensors) or (
        not stack and d in g.dims
    ):
        raise refuse(
            func,
            args,
            kwargs,
            "blocks joined along a cut dim, or with tensors cut otherwise",
            "join blocks of one layout along an uncut dim (channels)",
        )
    local = func([to_blocks(t, g, (func, args, kwargs)).local for t in tensors], d)
    dims = tuple(c + 1 if stack and c >= d else c for c in g.dims)
    return placed(ref, local, dims)
