"""CREDIT's training rule made exact on uneven bands: the row weight sits on each local mean.

CREDIT trains with a loss each rank computes on its own band and then averages the domain
ranks' gradients (``sync_domain_gradients``). On even bands that average is the gradient of
the loss its users write, read on the whole field: a local mean becomes the global mean, a
local sum the global sum over P. On uneven bands the plain average is off, because a mean
over ``n`` rows weights each row by ``1/n``. The weight that fixes it, ``P * n / N``, belongs
to every mean that reduces over the band's rows, and to nothing else: not to a sum, not to
a gradient that reaches the output from a later rollout step.

So the converted model's output band is a :class:`LocalBand`: a plain tensor that follows
its rows through the ops a loss is built of, and puts the weight (on the gradient only; the
values are CREDIT's) on each mean over those rows. What it cannot follow while gradients are
on (an op that moves rows, a nonlinear function of a mean over rows, the row count read
through ``numel()``) is refused on every rank, with the reason and the fix; without
gradients, and after ``detach()``, the band is a plain tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map

from mpidp.errors import ConfigError
from mpidp.ops.bands import learn_spec
from mpidp.ops.training import _MeanShare
from mpidp.runtime.manager import DistributedManager
from mpidp.sharded.pointwise import POINTWISE

__all__ = ["LocalBand", "LocalMean", "plain", "track"]

_MEANS = {torch.mean, torch.Tensor.mean, torch.nanmean, torch.Tensor.nanmean}
_SUMS = {torch.sum, torch.Tensor.sum, torch.nansum, torch.Tensor.nansum}
#: losses whose ``reduction`` reduces every dim ("mean" by default)
_LOSSES = {
    F.mse_loss,
    F.l1_loss,
    F.smooth_l1_loss,
    F.huber_loss,
    F.binary_cross_entropy,
    F.binary_cross_entropy_with_logits,
    F.poisson_nll_loss,
    F.gaussian_nll_loss,
    F.kl_div,
    F.soft_margin_loss,
}
#: reshapes and copies: the rows stay rows when the dims from the row dim on are unchanged
_LAYOUT = {
    torch.Tensor.view,
    torch.Tensor.view_as,
    torch.Tensor.reshape,
    torch.reshape,
    torch.Tensor.reshape_as,
    torch.Tensor.flatten,
    torch.flatten,
    torch.Tensor.unflatten,
    torch.unflatten,
    torch.Tensor.squeeze,
    torch.squeeze,
    torch.Tensor.expand,
    torch.Tensor.expand_as,
    torch.Tensor.to,
    torch.Tensor.float,
    torch.Tensor.double,
    torch.Tensor.half,
    torch.Tensor.bfloat16,
    torch.Tensor.type,
    torch.Tensor.type_as,
    torch.Tensor.contiguous,
    torch.Tensor.clone,
    torch.clone,
    torch.Tensor.cpu,
    torch.Tensor.cuda,
    torch.cat,
    torch.concat,
    torch.concatenate,
    torch.Tensor.split,
    torch.split,
    torch.Tensor.chunk,
    torch.chunk,
    torch.Tensor.unbind,
    torch.unbind,
}
_INSERT = {torch.Tensor.unsqueeze, torch.unsqueeze, torch.stack}
#: ops that are linear in a mean over rows (what may follow one)
_LINEAR = {
    torch.add,
    torch.sub,
    torch.subtract,
    torch.neg,
    torch.Tensor.add,
    torch.Tensor.sub,
    torch.Tensor.neg,
    torch.Tensor.__add__,
    torch.Tensor.__radd__,
    torch.Tensor.__iadd__,
    torch.Tensor.__sub__,
    torch.Tensor.__rsub__,
    torch.Tensor.__isub__,
    torch.Tensor.__neg__,
    torch.Tensor.__pos__,
    *_MEANS,
    *_SUMS,
    torch.stack,
    torch.Tensor.__getitem__,
    torch.Tensor.squeeze,
    torch.Tensor.unsqueeze,
    torch.Tensor.reshape,
    torch.Tensor.view,
    torch.Tensor.flatten,
}
#: linear when the other factor does not hold a mean over rows (and for division, is not
#: the divisor)
_SCALE = {
    torch.mul,
    torch.multiply,
    torch.Tensor.mul,
    torch.Tensor.__mul__,
    torch.Tensor.__rmul__,
    torch.Tensor.__imul__,
}
_DIVIDE = {
    torch.div,
    torch.divide,
    torch.true_divide,
    torch.Tensor.div,
    torch.Tensor.__truediv__,
    torch.Tensor.__itruediv__,
}
#: return the tensor itself (already followed)
_KEEP = {torch.Tensor.requires_grad_, torch.Tensor.retain_grad, torch.Tensor.register_hook}
_FIX = (
    "fix: build the loss from element-wise ops, mean and sum (torch.mean, F.mse_loss...), add "
    "several such losses, or detach what needs no gradient"
)


def _band(x: Any) -> LocalBand | None:
    return x if isinstance(x, LocalBand) else None


class LocalBand(torch.Tensor):
    """A band of a model output (rows along ``row``, counted from the end) whose means over
    the rows carry the weight ``w = P * n / N`` on their gradient."""

    _row: int
    _w: float
    _rank: int

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        bands = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, LocalBand)]
        if func is torch.Tensor.numel and torch.is_grad_enabled() and bands[0].requires_grad:
            raise _refuse(bands[0], func, "a count of the band's elements hides its rows")
        out, followed = _call(func, args, kwargs)
        if not followed:
            return out
        first = bands[0]
        if func in _KEEP:
            return out
        prop = _property(func)
        if prop is not None and prop not in _VALUES:  # .data, ._base, .grad: not the loss's ops
            return _plain_tree(out)
        if any(isinstance(a, LocalMean) for a in tree_flatten((args, kwargs))[0]):
            raise _refuse(first, func, "a mean over rows meets the band again")
        if any(b._row != first._row or b._w != first._w for b in bands):
            raise _refuse(first, func, "it meets a band with other rows")
        return _follow(first, func, args, kwargs, out)


class LocalMean(torch.Tensor):
    """A mean over rows (its gradient weighted): only linear ops may follow it."""

    _rank: int

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        means = [a for a in flat if isinstance(a, LocalMean)]
        if any(isinstance(a, LocalBand) for a in flat):
            raise _refuse(means[0], func, "a mean over rows meets the band again")
        out, followed = _call(func, args, kwargs)
        if not followed:
            return out
        if _linear(func, args, means):
            return tree_map(lambda o: _as(o, LocalMean, means[0]._rank), out)
        raise _refuse(means[0], func, "it is not linear in a mean over the band's rows")


def _call(func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, bool]:
    """``func``'s result on the plain tensors, and whether its rows must be followed (a result
    that needs no gradient, or a backward, is plain)."""
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*args, **kwargs)
    if not _needs_grad(out) or func is torch.Tensor.backward:
        return _plain_tree(out), False
    return out, True


def _linear(func: Any, args: Sequence[Any], means: list[LocalMean]) -> bool:
    if func in _LINEAR:
        return True
    if func in _SCALE:
        return len(means) == 1
    if func in _DIVIDE:
        return len(means) == 1 and _is_mean(args[0]) and not _is_mean(args[1])
    return False


def _is_mean(a: Any) -> bool:
    return isinstance(a, LocalMean)


#: properties whose value is computed from the band's values (the rest: bookkeeping)
_VALUES = {"real", "imag", "T", "mT", "H", "mH"}


def _property(func: Any) -> str | None:
    """The name of the tensor property ``func`` reads, or None."""
    if getattr(func, "__name__", "") != "__get__":
        return None
    return str(getattr(getattr(func, "__self__", None), "__name__", ""))


def _needs_grad(out: Any) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(o, torch.Tensor) and o.requires_grad for o in tree_flatten(out)[0]
    )


def _plain_tree(out: Any) -> Any:
    return tree_map(lambda o: plain(o) if isinstance(o, torch.Tensor) else o, out)


def plain(x: Any) -> Any:
    """``x`` as a plain tensor (autograd history kept): for mpidp's own functions that take
    the band (the model's next step, gathers, unpadding)."""
    if isinstance(x, (LocalBand, LocalMean)):
        return x.as_subclass(torch.Tensor)
    return x


def _as(o: Any, cls: type, rank: int, row: int = 0, w: float = 1.0) -> Any:
    if not isinstance(o, torch.Tensor):
        return o
    t: Any = o.as_subclass(cls)
    t._rank = rank
    if cls is LocalBand:
        t._row, t._w = row, w
    return t


def _wrap(first: LocalBand, out: Any, row: int) -> Any:
    return tree_map(lambda o: _as(o, LocalBand, first._rank, row, first._w), out)


def _refuse(first: LocalBand | LocalMean, func: Any, why: str) -> ConfigError:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    return ConfigError(
        f"rank {first._rank}: {name} on the converted model's output while gradients are on: "
        f"{why}, so mpidp cannot tell which rows a mean averages, and CREDIT's average of "
        f"local gradients (sync_domain_gradients) would be a different gradient on uneven "
        f"bands; {_FIX}"
    )


def _follow(first: LocalBand, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> Any:
    """The output of ``func`` as the band's rows went through it, or refused."""
    src = first.dim() + first._row  # the row dim, counted from the start
    pointwise = func in POINTWISE or _property(func) in ("real", "imag")
    if pointwise or (func in _LOSSES and kwargs.get("reduction", "mean") == "none"):
        if isinstance(out, torch.Tensor) and _rows_kept(first, out, first._row):
            return _wrap(first, out, first._row)
        raise _refuse(first, func, "its result does not keep the band's rows")
    if func in _LOSSES:
        return _reduced(first, func, out, mean=kwargs.get("reduction", "mean") == "mean")
    if func in _MEANS or func in _SUMS:
        dims = _reduce_dims(first, args, kwargs)
        if src in dims:
            return _reduced(first, func, out, mean=func in _MEANS)
        keep = bool(kwargs.get("keepdim", args[2] if len(args) > 2 else False))
        after = sum(1 for d in dims if d > src)
        return _wrap(first, out, first._row if keep else first._row + after)
    if func is torch.Tensor.__getitem__:
        row = _index_row(first, args[1], out)
        if row is not None:
            return _wrap(first, out, row)
        raise _refuse(first, func, "the index selects along the band's rows")
    if func in _INSERT:
        if _inserts_before(first, func, args, kwargs, out):
            return _wrap(first, out, first._row)
        raise _refuse(first, func, "it adds a dim after the band's rows")
    if func in _LAYOUT:
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if outs and all(_rows_kept(first, o, first._row) for o in outs):
            return _wrap(first, out, first._row)
        raise _refuse(first, func, "it changes the dims from the band's rows on")
    raise _refuse(first, func, "mpidp does not know how it treats the band's rows")


def _rows_kept(first: LocalBand, out: torch.Tensor, row: int) -> bool:
    return out.dim() >= -row and tuple(out.shape[row:]) == tuple(first.shape[row:])


def _reduce_dims(first: LocalBand, args: Any, kwargs: dict[str, Any]) -> set[int]:
    dim = kwargs.get("dim", args[1] if len(args) > 1 and not isinstance(args[1], bool) else None)
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return set(range(first.dim()))
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return {int(d) % first.dim() for d in dims}


def _reduced(first: LocalBand, func: Any, out: torch.Tensor, mean: bool) -> Any:
    """A reduction over the rows: a mean carries the weight and only linear ops may follow;
    a sum is a plain value."""
    if not mean:
        return plain(out)
    return _as(_MeanShare.apply(out, first._w), LocalMean, first._rank)


def _index_row(first: LocalBand, key: Any, out: torch.Tensor) -> int | None:
    """Where the rows land in ``first[key]`` (counted from the end), or None when the index
    selects along them (or is a tensor index, whose effect on them is not read here)."""
    items = list(key) if isinstance(key, tuple) else [key]
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) for i in items):
        return None
    if isinstance(key, bool) or any(isinstance(i, bool) for i in items):
        return None
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at : at + 1] = [slice(None)] * (first.dim() - consumed)
    items += [slice(None)] * (first.dim() - sum(1 for i in items if i is not None))
    src, d, pos = first.dim() + first._row, 0, 0
    for i in items:
        if i is None:
            pos += 1
            continue
        if d == src:
            n = first.shape[src]
            if not isinstance(i, slice) or range(n)[i] != range(n):
                return None
            return pos - out.dim()
        pos += 0 if isinstance(i, int) else 1
        d += 1
    return None


def _inserts_before(
    first: LocalBand, func: Any, args: Any, kwargs: dict[str, Any], out: torch.Tensor
) -> bool:
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    at = int(dim) % out.dim()
    return at <= out.dim() + first._row - 1 and _rows_kept(first, out, first._row)


def track(band: torch.Tensor, dim: int, manager: DistributedManager) -> torch.Tensor:
    """``band`` (the output of a converted model, rows along ``dim``) as a :class:`LocalBand`
    when gradients flow through it; else as it is. One all-gather of one integer (the
    ranks' row counts) when gradients are on. Collective over the domain group."""
    if not (torch.is_grad_enabled() and band.requires_grad) or manager.domain_world_size == 1:
        return band

    row = dim if dim < 0 else dim - band.dim()
    spec = learn_spec(band, row % band.dim(), manager.transport(None, band.device))
    w = spec.parts * spec.sizes[manager.domain_rank] / spec.total if spec.total else 0.0
    return _as(plain(band), LocalBand, manager.rank, row, w)
