"""A value every rank will hold, not yet summed: each rank holds one summand (a contraction
over the sharded dim: ``x.sum()``, ``x.mean((-2, -1))``, ``einsum``/``matmul`` over it).

A :class:`PartialSum` is a :class:`~mpidp.sharded.Replicated` whose all-reduce has not run yet.
Ops that are linear in it run on the summand and stay partial: reshapes and views, sums and
means over its dims, adding another partial value, scaling by a value every rank holds, a
product with one. Any other consumer (a nonlinear op, a band, ``.item()``, ``float()``,
``backward()``, printing) first sums the summands, once (one all-reduce, cached), and then
sees a plain :class:`Replicated`. So ``(err ** 2).mean((-2, -1)).sum()`` or
``a.sum() + b.sum()`` costs one all-reduce of the final value instead of one per reduction.

Gradients: the sum's backward hands every summand the value's whole gradient (the
replicated rule); a Replicated factor that joins a partial value enters through
:func:`mpidp.copy_to` (its gradient, summed over the ranks' shares, is whole again); a plain
tensor factor (a parameter) keeps this rank's share, summed by ``mpidp.sync_gradients``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map

from mpidp.comm import Transport
from mpidp.errors import MpidpError
from mpidp.ops.collectives import copy_to, reduce_from
from mpidp.sharded.tensor import (
    META_GETTERS,
    META_METHODS,
    Replicated,
    ShardedTensor,
    replicated,
    written,
)
from mpidp.sharded.walk import holds

__all__ = ["PartialSum", "partial_sum", "summed"]


class PartialSum(Replicated):
    """This rank's summand of a Replicated value (``summand()``); the value is their sum."""

    _local: torch.Tensor
    _cache: list[tuple[bool, Replicated]]
    _settled: bool  # written in place: its value is the cached sum, not the summands' sum

    @staticmethod
    def __new__(cls, summand: torch.Tensor, t: Transport) -> PartialSum:
        out = torch.Tensor._make_wrapper_subclass(
            cls, summand.shape, dtype=summand.dtype, device=summand.device, requires_grad=False
        )
        out._local, out._t, out._cache, out._settled = summand, t, [], False
        return out

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()

    def _settle(self) -> None:
        """Before an in-place write into this value (``p.mul_(2)``, ``p[0] = v``, ``out=p``):
        sum it once; the write lands in that sum, which every later use reads, in either grad
        mode (the summands no longer hold the value: the linear rules no longer apply)."""
        if not self._settled:
            with torch.enable_grad():  # the value keeps its history under no_grad too
                v = self.value()
            self._cache, self._settled = [(True, v), (False, v)], True

    def summand(self) -> torch.Tensor:
        """This rank's summand (a plain tensor with its autograd history)."""
        return self._local

    def value(self) -> Replicated:
        """The value on every rank: the summands' sum (one all-reduce, the first time in this
        grad mode). Collective over the domain group."""
        mode = torch.is_grad_enabled()
        for cached_mode, v in self._cache:
            if cached_mode == mode or not self._local.requires_grad:
                return v
        v = replicated(reduce_from(self._local, self._t), self._t)
        self._cache.append((mode, v))
        return v

    # Python's number protocols and as_subclass bypass __torch_function__: the value here
    def as_subclass(self, cls: Any) -> Any:
        return self.value().as_subclass(cls)

    def __float__(self) -> float:
        return float(self.value())

    def __int__(self) -> int:
        return int(self.value())

    def __bool__(self) -> bool:
        return bool(self.value())

    def __index__(self) -> int:
        return self.value().__index__()

    def __complex__(self) -> complex:
        return complex(self.value())

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"PartialSum(value={self.value().as_subclass(torch.Tensor)!r})"

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in META_METHODS or _getter(func) in META_GETTERS | _SUMMAND_GETTERS:
            args = tree_map(lambda a: a._local if isinstance(a, PartialSum) else a, args)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        target = written(func, args, kwargs)
        if isinstance(target, PartialSum):
            target._settle()
        rule = _LINEAR.get(func)
        if (
            rule is not None
            and target is None  # out=: the tensor written gets the value, not the summand
            and not any(p._settled for p in _partials(tree_flatten((args, kwargs))[0]))
            and not _has(args, kwargs, ShardedTensor)
        ):
            out = rule(func, args, kwargs)
            if out is not NotImplemented:
                return out
        args, kwargs = summed((args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise MpidpError(
            f"{func} reached a partial value outside torch functions (a buffer, a C extension): "
            f"its summands are not summed yet; call .value() first (a Replicated tensor)"
        )


def partial_sum(summand: torch.Tensor, t: Transport) -> Replicated:
    """The value whose summand this rank holds: lazy over a group of several ranks."""
    return PartialSum(summand, t) if t.size > 1 else replicated(summand, t)


def summed(tree: Any) -> Any:
    """``tree`` with every partial value replaced by its value (a Replicated). A tree that
    holds none (most calls) comes back as it is, after one walk of its containers."""
    if not holds(tree, PartialSum):
        return tree
    return tree_map(lambda a: a.value() if isinstance(a, PartialSum) else a, tree)


_SUMMAND_GETTERS = {"requires_grad", "grad_fn", "is_leaf", "_version"}


def _getter(func: Any) -> str:
    if getattr(func, "__name__", "") == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "")
    return ""


def _has(args: Any, kwargs: Any, kind: type) -> bool:
    return holds(args, kind) or holds(kwargs, kind)


def _partials(leaves: list[Any]) -> list[PartialSum]:
    return [a for a in leaves if isinstance(a, PartialSum)]


def _factor(a: Any, t: Transport) -> Any:
    """A factor every rank holds, as the plain tensor a summand is scaled by."""
    if isinstance(a, Replicated):
        plain = a.as_subclass(torch.Tensor)
        return copy_to(plain, t) if plain.requires_grad else plain
    return a


def _run(func: Any, args: Any, kwargs: Any, t: Transport) -> Any:
    local = tree_map(lambda a: a._local if isinstance(a, PartialSum) else _factor(a, t), args)
    lkw = tree_map(lambda a: a._local if isinstance(a, PartialSum) else _factor(a, t), kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*local, **lkw)
    return tree_map(lambda o: PartialSum(o, t) if isinstance(o, torch.Tensor) else o, out)


def _structural(func: Any, args: Any, kwargs: Any) -> Any:
    """A view, reshape, copy or reduction of the partial value alone (the first argument)."""
    if not isinstance(args[0], PartialSum):
        return NotImplemented
    rest, _ = tree_flatten((args[1:], kwargs))
    if any(isinstance(a, Replicated) for a in rest):
        return NotImplemented
    return _run(func, args, kwargs, args[0]._t)


def _sum_of_partials(func: Any, args: Any, kwargs: Any) -> Any:
    """``a + b``, ``a - b`` of partial values of one group: the summands add."""
    if len(args) != 2 or "other" in kwargs or not all(isinstance(a, PartialSum) for a in args):
        return NotImplemented  # p + 1 is not the sum of (p_r + 1)
    if args[0]._t is not args[1]._t:
        return NotImplemented
    return _run(func, args, kwargs, args[0]._t)


def _scaled(func: Any, args: Any, kwargs: Any) -> Any:
    """A product with exactly one partial value (linear in it): ``a * c``, ``a / c`` (``a``
    the numerator), ``a @ w``, ``einsum``, ``linear`` without bias."""
    leaves, _ = tree_flatten((args, kwargs))
    parts = _partials(leaves)
    if len(parts) != 1:
        return NotImplemented
    if func in _DIVISIONS and (args[0] is not parts[0] or kwargs.get("rounding_mode")):
        return NotImplemented
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if func is F.linear and bias is not None:
        return NotImplemented
    return _run(func, args, kwargs, parts[0]._t)


_T = torch.Tensor
_STRUCTURAL = [
    _T.view, _T.reshape, _T.flatten, _T.unflatten, _T.permute, _T.transpose, _T.t,
    _T.squeeze, _T.unsqueeze, _T.expand, _T.contiguous, _T.clone, _T.narrow, _T.select,
    _T.__getitem__, _T.movedim, _T.detach, _T.neg, _T.__neg__, _T.sum, _T.mean, _T.to,
    _T.float, _T.double, _T.half, _T.bfloat16, _T.real, _T.conj,
    torch.reshape, torch.flatten, torch.permute, torch.transpose, torch.squeeze,
    torch.unsqueeze, torch.sum, torch.mean, torch.neg, torch.narrow, torch.select,
    torch.movedim, torch.clone, torch.conj, torch.real,
]  # fmt: skip
_SUMS = [torch.add, _T.add, _T.__add__, _T.__radd__, torch.sub, _T.sub, _T.__sub__]
_DIVISIONS = {torch.div, _T.div, _T.__truediv__}
_PRODUCTS = [
    torch.mul, _T.mul, _T.__mul__, _T.__rmul__, *_DIVISIONS, torch.matmul, _T.matmul,
    _T.__matmul__, _T.__rmatmul__, torch.mm, torch.bmm, torch.einsum, F.linear,
]  # fmt: skip
_LINEAR: dict[Any, Callable[[Any, Any, Any], Any]] = {
    **{f: _structural for f in _STRUCTURAL},
    **{f: _sum_of_partials for f in _SUMS},
    **{f: _scaled for f in _PRODUCTS},
}
