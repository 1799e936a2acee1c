"""Handlers: joining and splitting (``cat``, ``stack``, ``split``, ``chunk``, ``unbind``,
``tensor_split``, ``expand``, ``repeat``). Along other dims: local; ``cat`` along the sharded
dim cuts the result by the policy and each rank fetches its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mpidp.ops.collectives import copy_to
from mpidp.sharded.dispatch import first_sharded, refuse, register
from mpidp.sharded.pointwise import home
from mpidp.sharded.rows import along, to_spec
from mpidp.sharded.rows import fetch_rows as _fetch
from mpidp.sharded.shapes import _plain, _shape_arg, _wrap
from mpidp.sharded.tensor import Replicated, ShardedTensor

__all__: list[str] = []


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
            if a.dim() == ndim and a.blocks == 1 == ref.blocks:
                a = along(a, axis)
            if (
                a.dim() != ndim
                or a.shard_dim != axis
                or a.spec.total != ref.spec.total
                or a.blocks != ref.blocks
            ):
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
        if a.dim() == ndim and a.size(axis) == ref.size(ref.shard_dim):
            out.append(ref.rows_of(a, axis))
        else:
            raise refuse(
                func,
                args,
                kwargs,
                f"a plain tensor of shape {tuple(a.shape)} joins a band",
                "pass a tensor of the global shape (it is cut to each rank's rows)",
            )
    return out


@register(torch.cat, torch.concat, torch.concatenate, blocks=True)
def _cat(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    tensors = list(args[0] if args else kwargs["tensors"])
    dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
    ref = home(tensors)
    dim = int(dim) % ref.dim()
    if dim == ref.shard_dim:
        if any(isinstance(a, ShardedTensor) and a.blocks > 1 for a in tensors):
            raise refuse(
                func, args, kwargs, "joining along a dim that holds blocks", "unflatten first"
            )
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
    spec = m.partition.derived(sum(lengths), m.domain_world_size)
    me = ref.rank
    parts = []
    at = 0
    for a, n in zip(tensors, lengths, strict=True):
        lo, hi = at, at + n

        def mine(q: int, lo: int = lo, hi: int = hi) -> list[tuple[int, int]]:
            s, e = max(spec.start(q), lo), min(spec.stop(q), hi)
            return [(s - lo, e - lo)] if e > s else []

        if isinstance(a, ShardedTensor):
            if a.dim() == ref.dim() and a.blocks == 1:
                a = along(a, d)
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


@register(torch.stack, blocks=True)
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
    blocks=True,
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
    torch.Tensor.expand,
    torch.broadcast_to,
    torch.Tensor.broadcast_to,
    torch.Tensor.expand_as,
    blocks=True,
)
def _expand(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    if not isinstance(x, ShardedTensor):  # a plain tensor expanded as a band
        return _expand_to_band(func, args, kwargs)
    if func is torch.Tensor.expand_as:
        sizes = list(args[1].shape)
    else:
        sizes = _shape_arg(args[1:] or [kwargs.get("size")])
    axis = len(sizes) - x.dim() + x.shard_dim
    if sizes[axis] not in (-1, x.size(x.shard_dim)):
        raise refuse(func, args, kwargs, "expanding the sharded dim", "expand other dims")
    sizes[axis] = x.local.size(x.shard_dim)
    return _wrap(x, x.local.expand(sizes), axis)


def _expand_to_band(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``src.expand_as(band)`` (torch_geometric's scatter): ``src`` broadcasts along the
    band's sharded dim (length 1) or has its global length there (cut to this rank's rows);
    the result is a band of ``ref``'s layout."""
    src, ref = args[0], args[1]
    i = src.dim() - (ref.dim() - ref.shard_dim)
    if i >= 0 and src.size(i) == ref.size(ref.shard_dim):
        src = ref.rows_of(src, i)
    elif i >= 0 and src.size(i) != 1:
        raise refuse(
            func,
            args,
            kwargs,
            f"a tensor of shape {tuple(src.shape)} expanded as a band",
            "pass one that broadcasts along the sharded dim",
        )
    if isinstance(src, Replicated):
        src = copy_to(src.as_subclass(torch.Tensor), ref.transport)
    return ref.like(src.expand_as(ref.local))


@register(torch.Tensor.repeat, blocks=True)
def _repeat(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    reps = _shape_arg(args[1:])
    axis = len(reps) - x.dim() + x.shard_dim
    if reps[axis] != 1:
        raise refuse(func, args, kwargs, "repeating along the sharded dim", "repeat other dims")
    return _wrap(x, x.local.repeat(reps), axis)
