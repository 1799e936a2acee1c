"""Handlers: reductions. Over dims that leave out the sharded dim they run on the band (the
result is a ShardedTensor); over dims that include it the result is the exact global value,
:class:`~mpidp.sharded.tensor.Replicated` on every rank, differentiable where torch's is:

* sums and means: each rank's partial sum, one all-reduce (:func:`mpidp.reduce_from`: every
  rank then holds the whole value and its whole gradient);
* ``amax``/``amin``/``max``/``min``: the maximum by an all-reduce, and torch's gradient rule
  (shared evenly by every entry equal to it, on every rank) through a correction term that is
  exactly zero in the forward;
* ``var``/``std`` (any ``correction``), ``norm`` (p = 1, 2, 'fro', inf, -inf, 0, any p),
  ``logsumexp``, ``softmax``/``log_softmax`` along the sharded dim: composed of the above.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mpidp.ops.collectives import reduce_from
from mpidp.sharded.dispatch import refuse, register
from mpidp.sharded.partial import partial_sum
from mpidp.sharded.pointwise import pointwise
from mpidp.sharded.tensor import Replicated, ShardedTensor, replicated

__all__ = ["global_sum", "global_amax"]


def _dims(x: ShardedTensor, dim: Any) -> list[int]:
    """The reduced dims (non-negative; None or () is every dim)."""
    if dim is None or (isinstance(dim, Sequence) and len(dim) == 0):
        return list(range(x.dim()))
    if isinstance(dim, int):
        dim = [dim]
    return sorted({int(d) % x.dim() for d in dim})


def _finish(x: ShardedTensor, dims: list[int], keepdim: bool, local: Any) -> Any:
    """A band reduction's result as a ShardedTensor (the sharded dim survived)."""
    d = x.shard_dim
    axis = d if keepdim else d - sum(1 for i in dims if i < d)
    return ShardedTensor(local, x.spec, axis, x.manager)


def _count(x: ShardedTensor, dims: list[int]) -> int:
    return math.prod(x.shape[i] for i in dims)


def _squeeze(y: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    return y if keepdim or not dims else y.squeeze(tuple(dims))


def global_sum(
    x: ShardedTensor, dims: list[int], keepdim: bool, dtype: Any = None, nan: bool = False
) -> Replicated:
    """The sum over ``dims`` (which include the sharded dim), on every rank."""
    t = x.transport
    local = x.local
    part = (torch.nansum if nan else torch.sum)(local, dims, keepdim=True, dtype=dtype)
    return partial_sum(_squeeze(part, dims, keepdim), t)


def _lowest(dtype: torch.dtype) -> float:
    if dtype.is_floating_point:
        return -math.inf
    return float(torch.iinfo(dtype).min)


def global_amax(x: ShardedTensor, dims: list[int], keepdim: bool, sign: int = 1) -> Replicated:
    """``amax`` (``sign=-1``: ``amin``) over ``dims`` including the sharded dim, with torch's
    gradient: shared evenly by every entry equal to the result, on every rank."""
    t = x.transport
    local = x.local if sign > 0 else -x.local
    kept = [1 if i in dims else s for i, s in enumerate(local.shape)]
    if local.numel() == 0:
        part = local.new_full(kept, _lowest(local.dtype)).detach()
    else:
        part = local.detach().amax(dims, keepdim=True)
    m = t.all_reduce(part, "max")
    if torch.is_grad_enabled() and local.requires_grad:
        mask = local == m
        cnt = t.all_reduce(mask.sum(dims, keepdim=True).to(local.dtype), "sum")
        corr = reduce_from(((local - m) * mask).sum(dims, keepdim=True), t)
        y = m + corr / cnt  # corr is exactly 0: the value is m, the gradient mask / cnt
    else:
        y = m
    if sign < 0:
        y = -y
    return replicated(_squeeze(y, dims, keepdim), t)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


@register(torch.sum, torch.Tensor.sum, torch.nansum, torch.Tensor.nansum)
def _sum(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    dims = _dims(x, _arg(args, kwargs, 1, "dim", None))
    keepdim = bool(_arg(args, kwargs, 2, "keepdim", False))
    dtype = kwargs.get("dtype")
    nan = func in (torch.nansum, torch.Tensor.nansum)
    if x.shard_dim in dims:
        return global_sum(x, dims, keepdim, dtype, nan)
    local = func(x.local, dims, keepdim, dtype=dtype)
    return _finish(x, dims, keepdim, local)


@register(torch.mean, torch.Tensor.mean, torch.nanmean, torch.Tensor.nanmean)
def _mean(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    dims = _dims(x, _arg(args, kwargs, 1, "dim", None))
    keepdim = bool(_arg(args, kwargs, 2, "keepdim", False))
    dtype = kwargs.get("dtype")
    if x.shard_dim not in dims:
        return _finish(x, dims, keepdim, func(x.local, dims, keepdim, dtype=dtype))
    if func in (torch.nanmean, torch.Tensor.nanmean):
        total = global_sum(x, dims, keepdim, dtype, nan=True)
        count = global_sum(
            ShardedTensor(~x.local.isnan(), x.spec, x.shard_dim, x.manager), dims, keepdim
        )
        return total / count
    return global_sum(x, dims, keepdim, dtype) / _count(x, dims)


@register(torch.amax, torch.Tensor.amax, torch.amin, torch.Tensor.amin)
def _amax(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    dims = _dims(x, _arg(args, kwargs, 1, "dim", ()))
    keepdim = bool(_arg(args, kwargs, 2, "keepdim", False))
    if x.shard_dim not in dims:
        return _finish(x, dims, keepdim, func(x.local, dims, keepdim))
    return global_amax(x, dims, keepdim, 1 if func in (torch.amax, torch.Tensor.amax) else -1)


@register(torch.max, torch.Tensor.max, torch.min, torch.Tensor.min)
def _max(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    other = _arg(args, kwargs, 1, "other", None)
    if isinstance(other, torch.Tensor):  # the element-wise maximum of two tensors
        return pointwise(func, args, kwargs)
    x = args[0]
    sign = 1 if func in (torch.max, torch.Tensor.max) else -1
    dim = _arg(args, kwargs, 1, "dim", None)
    if dim is None:
        return global_amax(x, list(range(x.dim())), False, sign)
    keepdim = bool(_arg(args, kwargs, 2, "keepdim", False))
    if int(dim) % x.dim() == x.shard_dim:
        raise refuse(
            func,
            args,
            kwargs,
            "the indices of a maximum along the sharded dim are not computed on bands yet",
            "use amax/amin for the values, or gather (x.full_tensor()) for the indices",
        )
    values, indices = func(x.local, dim, keepdim)
    d = [int(dim) % x.dim()]
    return torch.return_types.max((_finish(x, d, keepdim, values), _finish(x, d, keepdim, indices)))


def _correction(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, float, bool]:
    """(dim, correction, keepdim) of var/std's overloads."""
    rest = list(args[1:])
    if rest and isinstance(rest[0], bool):  # var(input, unbiased)
        return None, float(rest[0]), bool(kwargs.get("keepdim", False))
    dim = rest[0] if rest else kwargs.get("dim")
    unbiased = rest[1] if len(rest) > 1 else kwargs.get("unbiased")
    keepdim = rest[2] if len(rest) > 2 else kwargs.get("keepdim", False)
    correction = kwargs.get("correction")
    if correction is None:
        correction = 1.0 if unbiased is None else float(bool(unbiased))
    return dim, float(correction), bool(keepdim)


@register(torch.var, torch.Tensor.var, torch.std, torch.Tensor.std)
def _var(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    dim, correction, keepdim = _correction(args, kwargs)
    dims = _dims(x, dim)
    if x.shard_dim not in dims:
        kw = {"correction": correction, "keepdim": keepdim}
        with warnings.catch_warnings():  # an empty band: torch warns of 0 degrees of freedom
            if not x.local.numel():
                warnings.simplefilter("ignore", UserWarning)
            return _finish(x, dims, keepdim, func(x.local, dims, **kw))
    n = _count(x, dims)
    mean = global_sum(x, dims, True) / n
    dev = x - mean
    sq = dev * dev.conj() if dev.is_complex() else dev * dev
    var = global_sum(sq, dims, keepdim) / max(n - correction, 0)
    if var.is_complex():
        var = var.real
    return var.sqrt() if func in (torch.std, torch.Tensor.std) else var


def _norm_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, bool]:
    if func is torch.linalg.vector_norm:
        p = _arg(args, kwargs, 1, "ord", 2)
    else:
        p = _arg(args, kwargs, 1, "p", "fro")
    return p, _arg(args, kwargs, 2, "dim", None), bool(_arg(args, kwargs, 3, "keepdim", False))


@register(torch.norm, torch.Tensor.norm, torch.linalg.vector_norm)
def _norm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    p, dim, keepdim = _norm_args(func, args, kwargs)
    dims = _dims(x, dim)
    if x.shard_dim not in dims:
        return _finish(x, dims, keepdim, func(x.local, p, dims, keepdim))
    a = x.abs()
    if p in ("fro", 2, 2.0, None):
        return global_sum(a * a, dims, keepdim).sqrt()
    if p in (1, 1.0):
        return global_sum(a, dims, keepdim)
    if p == math.inf:
        return global_amax(a, dims, keepdim)
    if p == -math.inf:
        return global_amax(a, dims, keepdim, -1)
    if p == 0:
        return global_sum(
            ShardedTensor((x.local != 0).to(x.dtype), x.spec, x.shard_dim, x.manager), dims, keepdim
        )
    if isinstance(p, (int, float)):
        return global_sum(a**p, dims, keepdim) ** (1.0 / p)
    raise refuse(func, args, kwargs, f"norm p={p!r} over the sharded dim", "use a vector norm")


def _logsumexp(x: ShardedTensor, dims: list[int], keepdim: bool) -> Any:
    with torch.no_grad():
        m = global_amax(x.detach(), dims, True).as_subclass(torch.Tensor)  # type: ignore[arg-type]
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = global_sum((x - m).exp(), dims, True)  # type: ignore[arg-type]
    out = s.log() + m
    return (
        out
        if keepdim
        else replicated(out.as_subclass(torch.Tensor).squeeze(tuple(dims)), x.transport)
    )


@register(torch.logsumexp, torch.Tensor.logsumexp)
def _lse(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    dims = _dims(x, _arg(args, kwargs, 1, "dim", None))
    keepdim = bool(_arg(args, kwargs, 2, "keepdim", False))
    if x.shard_dim not in dims:
        return _finish(x, dims, keepdim, func(x.local, dims, keepdim))
    return _logsumexp(x, dims, keepdim)


@register(
    F.softmax,
    torch.softmax,
    torch.Tensor.softmax,
    F.log_softmax,
    torch.log_softmax,
    torch.Tensor.log_softmax,
)
def _softmax(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    dim = _arg(args, kwargs, 1, "dim", None)
    dtype = kwargs.get("dtype")
    if dim is None:
        raise refuse(func, args, kwargs, "softmax without dim", "pass dim")
    d = int(dim) % x.dim()
    log = func in (F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax)
    # over another dim, the batch rule ran it locally (mpidp.sharded.batch)
    if dtype is not None:
        x = x.to(dtype)
    shifted = x - _logsumexp(x, [d], True)
    return shifted if log else shifted.exp()


@register(torch.all, torch.Tensor.all, torch.any, torch.Tensor.any)
def _all(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    dims = _dims(x, _arg(args, kwargs, 1, "dim", None))
    keepdim = bool(_arg(args, kwargs, 2, "keepdim", False))
    if x.shard_dim not in dims:
        return _finish(x, dims, keepdim, func(x.local, tuple(dims), keepdim))
    is_all = func in (torch.all, torch.Tensor.all)
    part = (x.local.all if is_all else x.local.any)(tuple(dims), keepdim=True).to(torch.int32)
    t = x.transport
    total = t.all_reduce(part, "min" if is_all else "max").bool()
    return replicated(_squeeze(total, dims, keepdim), t)


@register(torch.count_nonzero, torch.Tensor.count_nonzero)
def _count_nonzero(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    dims = _dims(x, _arg(args, kwargs, 1, "dim", None))
    if x.shard_dim not in dims:
        return _finish(x, dims, False, func(x.local, tuple(dims)))
    part = torch.count_nonzero(x.local, tuple(dims))
    t = x.transport
    return replicated(t.all_reduce(part, "sum"), t)
