"""A user's ``torch.autograd.Function`` on ShardedTensors: forward and backward both run with
ShardedTensor semantics.

``Function.apply`` does not go through ``__torch_function__``: left alone, torch would attach
the Function's backward to the ShardedTensor wrapper, which carries no gradient (the band
does), and every gradient before the Function would be lost without an error; torch offers
no hook for it. mpidp therefore wraps ``torch.autograd.Function.apply``, once, when the first
ShardedTensor of the process is made (:func:`mpidp.sharded.tensor.on_first`): importing mpidp
changes nothing in torch, and a Function can only meet a ShardedTensor after one exists. Once
wrapped, a call with no ShardedTensor argument goes to torch's own ``apply`` unchanged (one
scan of its arguments); a call with one runs the Function inside a bridge Function on the
bands:

* the user's ``forward`` gets ShardedTensors (global shapes, every torch call dispatched) and
  a context with torch's ctx API (``save_for_backward``, ``saved_tensors``,
  ``needs_input_grad``, ``mark_non_differentiable``, ``set_materialize_grads``, attributes);
* its ``backward`` gets the output gradients as ShardedTensors (Replicated for a Replicated
  output) and returns the input gradients in any of the forms the rest of mpidp takes: a
  ShardedTensor (moved to the input's partition if it is on another), a tensor of the input's
  whole global shape (cut to this rank's rows), and for a plain input (a parameter) a
  Replicated or plain gradient, which is whole on every rank: its share goes to domain rank 0
  (the rule of every plain tensor, docs/sharded_tensor.md).

Non-torch code inside the Function (``.numpy()``) meets dispatch and is refused on every rank
unless the gathering fallback is on. ``mark_dirty`` (in-place Functions) is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from mpidp.errors import ConfigError
from mpidp.sharded.dispatch import UnsupportedOp
from mpidp.sharded.partial import summed
from mpidp.sharded.tensor import Replicated, ShardedTensor, on_first, replicated
from mpidp.sharded.where import locate, running

__all__ = ["install"]

_TORCH_APPLY = torch.autograd.Function.__dict__["apply"]


class _Ctx:
    """What a user's Function sees as ``ctx`` when it runs on ShardedTensors."""

    def __init__(self, bridge: Any, needs: tuple[bool, ...], rank: int) -> None:
        self._bridge, self._rank = bridge, rank
        self.needs_input_grad = needs
        self._saved: list[tuple[Any, ...]] = []
        self._non_differentiable: list[Any] = []
        self.materialize_grads = True

    def save_for_backward(self, *tensors: Any) -> None:
        self._saved = [_meta(t) for t in tensors]
        self._bridge.save_for_backward(*(_band_of(t) for t in tensors))

    @property
    def saved_tensors(self) -> tuple[Any, ...]:
        bands = self._bridge.saved_tensors
        return tuple(_rebuild(b, meta) for b, meta in zip(bands, self._saved, strict=True))

    def mark_non_differentiable(self, *tensors: Any) -> None:
        self._non_differentiable.extend(tensors)

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value

    def mark_dirty(self, *tensors: Any) -> None:
        raise UnsupportedOp(
            locate(
                f"rank {self._rank}: an autograd.Function that modifies its input in place "
                f"(ctx.mark_dirty) on a ShardedTensor; fix: return a new tensor"
            )
        )


def _meta(t: Any) -> tuple[Any, ...]:
    if isinstance(t, ShardedTensor):
        return ("sharded", t.spec, t.shard_dim, t.manager)
    if isinstance(t, Replicated):
        return ("replicated", t._t)
    return ("plain",)


def _band_of(t: Any) -> Any:
    if isinstance(t, ShardedTensor):
        return t.local
    if isinstance(t, Replicated):
        return summed(t).as_subclass(torch.Tensor)
    return t


def _rebuild(band: Any, meta: tuple[Any, ...]) -> Any:
    if band is None:
        return None
    if meta[0] == "sharded":
        return ShardedTensor(band, meta[1], meta[2], meta[3])
    if meta[0] == "replicated":
        return replicated(band, meta[1])
    return band


class _Bridge(torch.autograd.Function):
    """The user's Function ``fn`` on bands: the inputs and outputs of this Function are the
    bands (so autograd follows them), the user's code sees ShardedTensors."""

    @staticmethod
    def forward(ctx: Any, call: dict[str, Any], *tensors: Any) -> Any:
        fn, metas = call["fn"], call["in"]
        it = iter(tensors)
        args = [
            _rebuild(next(it), m) if m is not None else a
            for a, m in zip(call["args"], metas, strict=True)
        ]
        uctx = _Ctx(ctx, call["needs"], call["rank"])
        with torch._C._EnableTorchFunction(), running(f"{fn.__name__}.forward"):
            if torch.autograd.function._is_setup_context_defined(fn.setup_context):
                out = fn.forward(*args)
                fn.setup_context(uctx, tuple(args), out)
            else:
                out = fn.forward(uctx, *args)
        single = not isinstance(out, tuple)
        outs = (out,) if single else out
        call.update(ctx=uctx, single=single, out=[_meta(o) for o in outs])
        bands = tuple(_band_of(o) if isinstance(o, torch.Tensor) else o for o in outs)
        marked = {id(t) for t in uctx._non_differentiable}
        frozen = [b for o, b in zip(outs, bands, strict=True) if id(o) in marked]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        ctx.set_materialize_grads(uctx.materialize_grads)
        ctx.call = call
        return bands

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        call = ctx.call
        fn = call["fn"]
        g = [_rebuild(gr, m) for gr, m in zip(grads, call["out"], strict=True)]
        # torch functions are off inside a Replicated loss's backward(): on for the user's
        with torch._C._EnableTorchFunction(), running(f"{fn.__name__}.backward"):
            got = fn.backward(call["ctx"], *g)
        got = got if isinstance(got, tuple) else (got,)
        out: list[Any] = [None]
        for a, meta, gr in zip(call["args"], call["in"], got, strict=False):
            if meta is not None:
                out.append(_input_grad(a, meta, gr, fn, call["rank"]))
        return tuple(out)


def _input_grad(arg: Any, meta: tuple[Any, ...], grad: Any, fn: Any, rank: int) -> Any:
    """The gradient of one input in the bridge's terms (the band's, or a plain share)."""
    if grad is None:
        return None
    if meta[0] == "sharded":
        x = arg
        if isinstance(grad, ShardedTensor):
            if grad.shard_dim != x.shard_dim:
                grad = grad.redistribute(dim=x.shard_dim - grad.dim())
            return (grad.redistribute(spec=x.spec) if grad.spec != x.spec else grad).local
        whole = grad.as_subclass(torch.Tensor) if isinstance(grad, Replicated) else grad
        if tuple(whole.shape) == tuple(x.shape):
            return whole.narrow(x.shard_dim, x.start, x.spec.sizes[x.rank])
        raise ConfigError(
            f"rank {x.manager.rank}: {fn.__name__}.backward returned a gradient of shape "
            f"{tuple(whole.shape)} for a ShardedTensor input of global shape {tuple(x.shape)}; "
            f"return a ShardedTensor or a tensor of the global shape"
        )
    if meta[0] == "replicated":
        return grad.as_subclass(torch.Tensor) if isinstance(grad, Replicated) else grad
    # a plain input (a parameter): its gradient is held as shares summed over the domain
    if isinstance(grad, ShardedTensor):
        share = torch.zeros(tuple(grad.shape), dtype=grad.dtype, device=grad.local.device)
        share.narrow(grad.shard_dim, grad.start, grad.spec.sizes[grad.rank]).copy_(grad.local)
        return share
    whole = grad.as_subclass(torch.Tensor) if isinstance(grad, Replicated) else grad
    return whole if rank == 0 else torch.zeros_like(whole)


def _apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
    sharded = [a for a in args if isinstance(a, ShardedTensor)]
    sharded += [a for a in kwargs.values() if isinstance(a, ShardedTensor)]
    if not sharded:
        return _TORCH_APPLY.__func__(cls, *args, **kwargs)
    if kwargs:
        raise UnsupportedOp(
            locate(
                f"rank {sharded[0].manager.rank}: {cls.__name__}.apply with keyword arguments "
                f"on a ShardedTensor; fix: pass them by position"
            )
        )
    metas = [_meta(a) if isinstance(a, torch.Tensor) else None for a in args]
    grad_on = torch.is_grad_enabled()
    needs = tuple(
        grad_on and isinstance(a, torch.Tensor) and _band_of(a).requires_grad for a in args
    )
    call = {"fn": cls, "args": list(args), "in": metas, "needs": needs, "rank": sharded[0].rank}
    tensors = [_band_of(a) for a, m in zip(args, metas, strict=True) if m is not None]
    bands = _TORCH_APPLY.__func__(_Bridge, call, *tensors)
    outs = [
        _rebuild(b, m) if isinstance(b, torch.Tensor) else b
        for b, m in zip(bands, call["out"], strict=True)
    ]
    return outs[0] if call["single"] else tuple(outs)


def install() -> None:
    """Wrap ``torch.autograd.Function.apply`` (once; called with the first ShardedTensor)."""
    if torch.autograd.Function.__dict__["apply"] is _TORCH_APPLY:
        torch.autograd.Function.apply = classmethod(_apply)  # type: ignore[method-assign,assignment]


on_first(install)
