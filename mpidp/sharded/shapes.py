"""Handlers: reshapes, dim moves and new tensors of a ShardedTensor's global shape.

* ``view``/``reshape``/``flatten``/``unflatten``/``squeeze``/``unsqueeze``: the global shape
  change is split into groups of dims; the sharded dim's group must start with it (dims of
  size 1 aside). Merged with the dims after it (``x.flatten(2)`` of (B, C, H, W)) the new dim is
  sharded by rows x W; split (H -> (H/p, p), a patch or window reshape) it is local when every
  band boundary falls on a multiple of p, and otherwise the tensor first moves to the nearest
  partition where it does (only boundary rows travel).
* ``permute``/``transpose``/``movedim``/``.T``: the sharded dim moves with its band.
* ``view_as_complex``/``view_as_real``; ``new_zeros`` & co. of the global shape (a band).

Selecting rows is in :mod:`mpidp.sharded.select`, joining in :mod:`mpidp.sharded.join`,
products and attention in :mod:`mpidp.sharded.products`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

from mpidp.ops.collectives import copy_to
from mpidp.runtime.partition import ShardSpec
from mpidp.sharded.dispatch import refuse, register
from mpidp.sharded.rows import to_spec
from mpidp.sharded.tensor import Replicated, ShardedTensor

__all__: list[str] = []


def _wrap(
    x: ShardedTensor, local: torch.Tensor, axis: int, spec: ShardSpec | None = None
) -> ShardedTensor:
    return x.like(local, axis, spec)


def _plain(a: Any, t: Any) -> Any:
    """A Replicated value entering a band computation: through ``copy_to`` (its gradient the
    sum of every rank's share, whole again)."""
    if isinstance(a, Replicated):
        return copy_to(a.as_subclass(torch.Tensor), t)
    return a


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
    """The reshape of ``x`` to ``new``, in the layout that describes each rank's part
    (:func:`plan_cut`); where a band boundary falls off the new dim's unit, the tensor first
    moves to the nearest partition where it does not (only boundary rows travel)."""
    old = list(x.shape)
    new = _infer(old, new)
    if math.prod(new) != math.prod(old) or 0 in old:
        raise ValueError(f"{what}: shape {new} is invalid for a tensor of shape {tuple(old)}")
    call: tuple[Any, Any, Any] = (torch.Tensor.reshape, (x,), {})
    k, blocks, unit, scale = plan_cut(old, new, x.shard_dim, x.spec, x.blocks, what, call)
    if unit > 1:
        x = to_spec(x, _aligned(x.spec, unit))
    sizes = tuple(s * scale[0] // scale[1] for s in x.spec.sizes)
    local_new = list(new)
    local_new[k] = blocks * sizes[x.rank]
    return ShardedTensor(x.local.reshape(local_new), ShardSpec(sizes), k, x.manager, blocks)


def plan_cut(
    old: list[int],
    new: list[int],
    d: int,
    spec: ShardSpec,
    blocks: int,
    what: str,
    call: tuple[Any, Any, Any],
) -> tuple[int, int, int, tuple[int, int]]:
    """Where the cut dim ``d`` of a reshape from ``old`` to ``new`` goes: ``(k, blocks, unit,
    (num, den))``, the new dim holding it, the blocks merged before it, the rows per new
    index (every boundary of the cut must fall on a multiple of ``unit``) and the factor
    ``num / den`` that turns a part's rows into its entries of dim ``k``. Local; the same for
    each cut dim of a block (with ``blocks`` 1) as for a band. ``call`` names the op in a
    refusal.

    Within the run of old dims that holds the cut one, the global index is (``before``
    blocks: the dims merged before the band and ``blocks``) x (``n`` rows) x (``inner``
    entries per row). The new dim holding the bands is the one whose running product passes
    ``before``: what of ``before`` it holds becomes its blocks, and each rank's rows become
    ``rows * inner / stride`` of its entries (``stride``: the product of the new dims after
    it)."""
    n = spec.total
    a, b, c, e = next(g for g in _groups(old, new) if g[0] <= d < g[1])
    before = math.prod(old[a:d]) * blocks
    inner = math.prod(old[d + 1 : b])
    run, k = 1, None
    for i in range(c, e):
        if run * new[i] > before:
            k = i
            break
        run *= new[i]
    if k is None and n * inner == 1:  # one row of one entry: the last new dim holds it
        k = e - 1
        run = math.prod(new[c:k])
    if k is None or before % run or (run * new[k]) % before:
        raise refuse(
            *call,
            f"{what} of {tuple(old)} to {tuple(new)} splits the sharded dim {d} ({blocks} "
            f"block(s) of {n} rows, {math.prod(old[a:d])} merged before it) across new dims: "
            f"no rank's part of the result is a block of rows of one dim",
            "reshape so that the dims merged before the band stay whole (or permute the "
            "sharded dim first)",
        )
    stride = math.prod(new[k + 1 : e])
    unit = 1
    if any((s * inner) % stride for s in spec.offsets[1:]):
        unit = stride // math.gcd(stride, inner)  # rows per new index
    return k, before // run, unit, (inner, stride)


def _aligned(spec: ShardSpec, unit: int) -> ShardSpec:
    """The partition whose boundaries are ``spec``'s rounded to multiples of ``unit``."""
    bounds = [0]
    for off in spec.offsets[1:]:
        r = (off + unit // 2) // unit * unit  # the nearest multiple
        bounds.append(min(max(r, bounds[-1]), spec.total))
    bounds.append(spec.total)
    return ShardSpec(tuple(hi - lo for lo, hi in itertools.pairwise(bounds)))


@register(torch.Tensor.view, torch.Tensor.reshape, torch.reshape, blocks=True)
def _view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    rest = list(args[1:]) or [kwargs.get("shape", kwargs.get("size"))]
    if len(rest) == 1 and isinstance(rest[0], torch.dtype):
        if rest[0].itemsize != x.dtype.itemsize:
            raise refuse(func, args, kwargs, "a view as a dtype of another width", "use .to(dtype)")
        return _wrap(x, x.local.view(rest[0]), x.shard_dim)
    return reshape_sharded(x, _shape_arg(rest), "view" if func is torch.Tensor.view else "reshape")


@register(torch.Tensor.view_as, torch.Tensor.reshape_as, blocks=True)
def _view_as(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return reshape_sharded(args[0], list(args[1].shape), "view_as")


@register(torch.flatten, torch.Tensor.flatten, blocks=True)
def _flatten(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return reshape_sharded(args[0], flattened(args, kwargs), "flatten")


def flattened(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int]:
    """The shape ``flatten(x, start_dim, end_dim)`` gives (``args[0]`` is ``x``)."""
    x = args[0]
    nd = max(x.dim(), 1)
    start = int(args[1] if len(args) > 1 else kwargs.get("start_dim", 0)) % nd
    end = int(args[2] if len(args) > 2 else kwargs.get("end_dim", -1)) % nd
    shape = list(x.shape)
    return [*shape[:start], math.prod(shape[start : end + 1]), *shape[end + 1 :]]


def unflattened(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int]:
    """The shape ``unflatten(x, dim, sizes)`` gives (``args[0]`` is ``x``; one -1 inferred)."""
    x = args[0]
    dim = int(args[1] if len(args) > 1 else kwargs["dim"]) % x.dim()
    sizes = list(args[2] if len(args) > 2 else kwargs["sizes"])
    shape = list(x.shape)
    return _infer(shape, shape[:dim] + sizes + shape[dim + 1 :])


@register(torch.unflatten, torch.Tensor.unflatten, blocks=True)
def _unflatten(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return reshape_sharded(args[0], unflattened(args, kwargs), "unflatten")


@register(torch.squeeze, torch.Tensor.squeeze, blocks=True)
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


@register(torch.unsqueeze, torch.Tensor.unsqueeze, blocks=True)
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


@register(*_MOVES, blocks=True)
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


@register(torch.view_as_complex, torch.view_as_real, blocks=True)
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
