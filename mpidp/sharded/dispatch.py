"""The dispatch registry: which torch function runs how on a ShardedTensor.

Every torch function called with a :class:`~mpidp.ShardedTensor` argument arrives at
:func:`dispatch` (``__torch_function__``, so ``F.conv2d`` is seen whole, before torch splits it
into kernels). Its handler computes this rank's band of the serial result; a function without
a handler raises :class:`UnsupportedOp` naming it, the shapes and the fixes -- never a result
computed on the band as if it were the whole field. Register your own with
:func:`register`::

    @mpidp.sharded.register(my_op)
    def _(func, args, kwargs):
        x = args[0]                      # a ShardedTensor
        return ShardedTensor(my_op(x.local), x.spec, x.shard_dim, x.manager)

The opt-in fallback (:func:`allow_fallback`, or ``MPIDP_SHARDED_FALLBACK=1`` on every rank)
gathers the whole tensors, runs the serial function on every rank and cuts the result back
into bands: slow (it moves every tensor to every rank) and warned once per function, but a
model runs first and is made fast op by op.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from mpidp.errors import ConfigError, MpidpError
from mpidp.ops.collectives import copy_to
from mpidp.runtime.grid import BlockSpec, blocks_refused
from mpidp.sharded.batch import NOT_LOCAL, READS, batch_local
from mpidp.sharded.block_layout import TokenSpec, spectral_call
from mpidp.sharded.kept import KEPT, Kept, Routed, Table, forget, plan, signature
from mpidp.sharded.partial import summed
from mpidp.sharded.tensor import (
    GRID_SEEN,
    MERGED_SEEN,
    Replicated,
    ShardedTensor,
    has_sharded,
    replicated,
    shard,
)
from mpidp.sharded.walk import first
from mpidp.sharded.where import relocated

__all__ = [
    "UnsupportedOp",
    "allow_fallback",
    "dispatch",
    "handled",
    "has_sharded",
    "register",
]

Handler = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]

_HANDLERS: dict[Any, Handler] = Table()
#: handlers that take ShardedTensors whose sharded dim holds blocks (``blocks > 1``)
_BLOCKS_OK: set[Handler] = set()
#: on latitude x longitude blocks (``ShardedTensor.grid``): the handlers of calls with a block
#: argument (:func:`register_grid`), and the band handlers that take blocks as they are
#: (``register(..., grid=True)``); any other call with a block is refused
_GRID: dict[Any, Handler] = Table()
_GRID_OK: set[Handler] = set()
#: on tokens of blocks (``ShardedTensor.grid`` a TokenSpec): their handlers alone
#: (:mod:`mpidp.sharded.tokens`); any other call with tokens is refused
_TOKENS: dict[Any, Handler] = Table()
#: functions with a fast path beside their handler (:func:`fast_path`): tried first on calls
#: whose keyword arguments are plain values; it answers :data:`NOT_LOCAL` when the call is not
#: its kind
_FAST: dict[Any, Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]] = {}
#: the keyword values a fast path is given (``F.silu(x, inplace=False)``): no tensor, no tree
_PLAIN_VALUES = (bool, int, float, str, type(None))
_FALLBACK = Table(on=os.environ.get("MPIDP_SHARDED_FALLBACK", "") not in ("", "0"))
_WARNED: set[str] = set()


class UnsupportedOp(MpidpError, NotImplementedError):
    """A torch function that mpidp cannot compute exactly on bands (and no fallback)."""


def key(func: Any) -> Any:
    """The registry key of ``func``: the function itself, or ``("__get__", name)`` for a
    tensor property (a new method-wrapper object at every access)."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__") and hasattr(func, "__self__"):
        return (name, getattr(func.__self__, "__name__", ""))
    return func


def op_named(name: str) -> list[Any]:
    """The torch operator a custom op's (or an aten op's) name means: ``"ns::op"``,
    ``"ns.op"`` (the op and its default overload) or ``"ns.op.overload"`` (that overload)."""
    parts = name.replace("::", ".").split(".")
    if len(parts) not in (2, 3):
        raise ConfigError(f"register({name!r}): name a custom op as 'ns::op' or 'ns.op.overload'")
    try:
        packet = getattr(getattr(torch.ops, parts[0]), parts[1])
        if len(parts) == 3:
            return [getattr(packet, parts[2])]
        return [packet, *([packet.default] if "default" in packet.overloads() else [])]
    except (AttributeError, RuntimeError):
        raise ConfigError(
            f"register({name!r}): torch.ops has no such operator; define it (torch.library."
            f"custom_op) before registering its handler"
        ) from None


def register(*funcs: Any, blocks: bool = False, grid: bool = False) -> Callable[[Handler], Handler]:
    """Decorator: the handler of ``funcs`` on ShardedTensors: torch functions, Tensor methods,
    ``("__get__", "name")`` for properties, operator overloads (``torch.ops.aten.add.Tensor``,
    a ``torch.library.custom_op``), or an operator's name (``"mylib::fused_op"``, see
    :func:`op_named`). It is called as ``handler(func, args, kwargs)``. A later registration wins.
    ``blocks=True``: the handler also takes tensors whose sharded dim holds blocks merged
    before the band (``ShardedTensor.blocks > 1``); any other handler never sees one (the
    call is refused first). ``grid=True``: it also takes latitude x longitude blocks
    (``ShardedTensor.grid``); see :func:`register_grid` for a handler of blocks alone."""

    def deco(handler: Handler) -> Handler:
        forget()  # (the handler sets below are no Table)
        for f in funcs:
            for op in op_named(f) if isinstance(f, str) else [f]:
                _HANDLERS[key(op)] = handler
                _FAST.pop(key(op), None)  # a later handler wins over an earlier fast path
        if blocks:
            _BLOCKS_OK.add(handler)
        if grid:
            _GRID_OK.add(handler)
        return handler

    return deco


def register_grid(
    *funcs: Any, tokens: bool = False, blocks: bool = False
) -> Callable[[Handler], Handler]:
    """Decorator: the handler of ``funcs`` when a call has a latitude x longitude block among
    its arguments (the band handler, if any, keeps the calls without one); ``tokens=True``:
    when it has tokens of blocks. ``blocks=True``: it also takes blocks whose cuts hold
    blocks merged before them (``BlockSpec.lead``), as :func:`register`'s ``blocks``."""

    def deco(handler: Handler) -> Handler:
        for f in funcs:
            (_TOKENS if tokens else _GRID)[key(f)] = handler
        if blocks:
            _BLOCKS_OK.add(handler)
        return handler

    return deco


def fast_path(
    fast: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any], funcs: Any, handler: Handler
) -> None:
    """Try ``fast(func, args, kwargs)`` before the general dispatch of each of ``funcs`` when
    every keyword value is a plain Python value (``inplace=False``; a tensor or a container
    among them takes the general path): the common case of a handler, answered without the
    walks and rules that every other case needs, or :data:`NOT_LOCAL` to take the general
    path. It must give what ``handler`` gives. A later :func:`register` of a function drops
    its fast path."""
    for f in funcs:
        # (the batch rule runs before any handler)
        if f not in READS and _HANDLERS.get(key(f)) is handler:
            _FAST[f] = fast


#: the operator forms of an aten op, where the operands keep the op's order
_OPERATORS = {
    "add": ("__add__", "__radd__", "__iadd__"),
    "mul": ("__mul__", "__rmul__", "__imul__"),
    "sub": ("__sub__", "__isub__"),
    "div": ("__truediv__", "__itruediv__"),
    "pow": ("__pow__", "__ipow__"),
    "matmul": ("__matmul__",),
    "neg": ("__neg__",),
    "abs": ("__abs__",),
}


def public_forms(op: Any) -> list[Any]:
    """The public torch functions that run an aten operator (``torch.ops.aten.sigmoid.default``:
    ``torch.sigmoid``, ``Tensor.sigmoid``, ``torch.special.expit`` is another name and not
    found), which ``__torch_function__`` sees instead of the operator: ``torch.X``,
    ``Tensor.X``, ``F.X``, ``torch.special.X``, ``torch.linalg.X``, ``torch.fft.X`` and the
    operators of :data:`_OPERATORS`. Empty for other operators."""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.name.startswith("aten::"):
        return []
    name = schema.name.split("::", 1)[1]
    spaces = (torch, torch.Tensor, torch.nn.functional, torch.special, torch.linalg, torch.fft)
    found = [getattr(space, name) for space in spaces if callable(getattr(space, name, None))]
    found += [getattr(torch.Tensor, n) for n in _OPERATORS.get(name, ())]
    return list({key(f): f for f in found}.values())


def handled(func: Any) -> bool:
    """Whether ``func`` has a handler."""
    return key(func) in _HANDLERS


def allow_fallback(on: bool = True) -> None:
    """Let functions without a handler run by gathering (see the module doc). Set it the same
    on every rank. Each function warns once after it is turned on."""
    _FALLBACK["on"] = on
    _WARNED.clear()


def first_sharded(args: Any, kwargs: Any = None) -> ShardedTensor:
    return first((args, kwargs or {}), _is_sharded)


def name_of(func: Any) -> str:
    k = key(func)
    if isinstance(k, tuple):
        return f"Tensor.{k[1]} ({k[0]})"
    mod = str(getattr(func, "__module__", None) or "")
    qual = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))
    if mod.startswith("torch.nn.functional"):
        return f"F.{qual}"
    if qual.startswith("_VariableFunctionsClass."):
        return f"torch.{qual.split('.', 1)[1]}"
    if qual.startswith("TensorBase.") or qual.startswith("Tensor."):
        return f"Tensor.{qual.split('.', 1)[1]}"
    return f"{mod}.{qual}" if mod and not mod.startswith("torch._C") else f"torch.{qual}"


def describe(args: Any, kwargs: Any) -> str:
    def one(a: Any) -> str:
        if isinstance(a, ShardedTensor):
            blocks = f" in {a.blocks} blocks" if a.blocks > 1 else ""
            if a.grid is not None:
                blocks += f" and along dim {a.grid.dims[1]} {list(a.grid.lon.sizes)}"
                if isinstance(a.grid, BlockSpec) and a.grid.merged:
                    blocks += f", blocks merged before each cut {a.grid.lead}"
            if a.spectral:
                blocks += " (a spectrum of blocks)"
            return (
                f"ShardedTensor{tuple(a.shape)} sharded along dim {a.shard_dim} "
                f"{list(a.spec.sizes)}{blocks}"
            )
        if isinstance(a, torch.Tensor):
            return f"{'Replicated' if isinstance(a, Replicated) else 'tensor'}{tuple(a.shape)}"
        return repr(a) if len(repr(a)) < 40 else type(a).__name__

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def refuse(func: Any, args: Any, kwargs: Any, why: str, fix: str) -> UnsupportedOp:
    x = first_sharded(args, kwargs)
    return UnsupportedOp(
        f"rank {x.manager.rank}: {name_of(func)}({describe(args, kwargs)}) on a ShardedTensor: "
        f"{why}; fix: {fix}"
    )


#: the watcher of outermost calls while one is installed (:func:`mpidp.preflight.explain.explain`):
#: ``watcher.observe(what, args, kwargs, run)`` runs ``run()`` and records it
WATCHERS: list[Any] = []


def observed(what: Any, args: Any, kwargs: Any, run: Callable[[], Any]) -> Any:
    """``run()``, reported to the installed watcher when this is its outermost call."""
    if not WATCHERS or WATCHERS[-1].busy:
        return run()
    return WATCHERS[-1].observe(what, args, kwargs, run)


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` on ShardedTensor arguments through its handler (or refuse). Partial
    values among the arguments are summed first: handlers see Replicated values. A call of
    a signature seen before takes the rule kept for it (:mod:`mpidp.sharded.kept`)."""
    if not WATCHERS:
        fast = _FAST.get(func)
        if fast is not None and all(type(v) in _PLAIN_VALUES for v in kwargs.values()):
            out = fast(func, args, kwargs)
            if out is not NOT_LOCAL:
                return out
    if kwargs.get("out") is not None:  # handlers compute bands: out= would get one rank's part
        raise refuse(func, args, kwargs, "out= with a band among the arguments", "assign: y = f(x)")
    if not WATCHERS:
        found = signature(func, args, kwargs)
        if found is not None:  # (no partial value, not the "whole" convention)
            rule = KEPT.get(found[0])
            if type(rule) is Kept:
                return rule(found[1])
            if isinstance(rule, Routed):
                return _located(rule.handler, func, args, kwargs)
            run = functools.partial(_located, _dispatch, func, args, kwargs)
            return plan(found[0], found[1], run)
    args, kwargs = summed((args, kwargs))
    if not _DEPTH and _whole(args, kwargs):
        args, kwargs = whole_gradients((args, kwargs))
        _DEPTH.append(func)
        try:
            return _run(func, args, kwargs)
        finally:
            _DEPTH.pop()
    return _run(func, args, kwargs)


def _run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if WATCHERS:
        return observed(func, args, kwargs, lambda: _located(_dispatch, func, args, kwargs))
    return _located(_dispatch, func, args, kwargs)


#: the outermost call under the ``"whole"`` convention (a handler's own calls nest in it)
_DEPTH: list[Any] = []


def _whole(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the call's ShardedTensors live under the ``"whole"`` gradient convention (one
    attribute read on the common path: a ShardedTensor among the positional arguments)."""
    for ref in args:
        if isinstance(ref, ShardedTensor):
            break
    else:
        ref = first((args, kwargs), _is_sharded)
    return ref is not None and ref.manager.gradients == "whole" and torch.is_grad_enabled()


def whole_gradients(tree: Any) -> Any:
    """Under the ``"whole"`` convention (:mod:`mpidp.runtime.adopt`: PhysicsNeMo's and
    DTensor's set-up), each plain tensor that needs a gradient and meets a band enters through
    :func:`mpidp.ops.collectives.copy_to`, so its gradient, this rank's share, is summed over
    the domain group in the backward: every rank holds the whole gradient, as PhysicsNeMo's
    parameters do. Called at the outermost call only (a handler's own calls see those tensors
    already)."""
    leaves, spec = tree_flatten(tree)
    t = next(a for a in leaves if isinstance(a, ShardedTensor)).transport
    plain = [
        copy_to(a, t)
        if isinstance(a, torch.Tensor)
        and not isinstance(a, (ShardedTensor, Replicated))
        and a.requires_grad
        else a
        for a in leaves
    ]
    return tree_unflatten(plain, spec)


def _located(rule: Handler, func: Any, *call: Any) -> Any:
    """``rule(func, *call)``; a refusal names where in the model it was raised."""
    try:
        return rule(func, *call)
    except UnsupportedOp as err:
        located = relocated(err)
        if located is None:
            raise
        raise located from None


def _dispatch(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], route: list[Any] | None = None
) -> Any:
    """The general path of a call: its rule, or refused. ``route``: set to the handler run
    (:mod:`mpidp.sharded.kept`), on a call of no spectrum."""
    if GRID_SEEN:  # (no block was ever made: nothing to look for, no spectrum of one)
        spectrum = first((args, kwargs), _is_spectrum)
        if spectrum is not None:
            if first((args, kwargs), _is_block) is not None:
                raise refuse(
                    func,
                    args,
                    kwargs,
                    "a spectrum of blocks (its modes cut over the whole domain group) meets a "
                    "block (a field cut into rows x columns): no rank holds matching parts of "
                    "both",
                    "transform the spectrum back to blocks first (torch.fft.irfft2 / ifft2), "
                    "or gather one of them (.full_tensor())",
                )
            with spectral_call():  # the band rules, over the domain group
                return _band_dispatch(func, args, kwargs, spectral=True)
    return _band_dispatch(func, args, kwargs, route=route)


def _band_dispatch(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    spectral: bool = False,
    route: list[Any] | None = None,
) -> Any:
    """A call on bands or blocks: the batch rule (bands and blocks alike), a block's rules,
    the band handler, the gathering fallback, or refused. On a spectrum of blocks
    (``spectral``) the handlers that run a layer refuse it themselves
    (:func:`mpidp.sharded.layer_calls.register`), and there is no fallback."""
    out = batch_local(func, args, kwargs)
    if out is not NOT_LOCAL:
        return out
    if GRID_SEEN and not spectral:  # (no block was ever made: nothing to look for)
        block = first((args, kwargs), _is_block)
        if block is not None:
            return _grid_dispatch(func, args, kwargs, block, route)
    handler = _HANDLERS.get(key(func))
    if handler is not None:
        # (no merged blocks were ever made: nothing to look for)
        if handler not in _BLOCKS_OK and MERGED_SEEN and _has_blocks(args, kwargs):
            raise refuse(
                func,
                args,
                kwargs,
                "its sharded dim holds blocks merged before the band (windows folded into the "
                "batch, (Z, H, W) tokens) and this function reads across that dim",
                "unflatten the dim back (reshape/view to the separate dims) before the call",
            )
        if route is not None:
            route[0] = handler
        return handler(func, args, kwargs)
    if spectral:
        raise refuse(
            func,
            args,
            kwargs,
            "mpidp has no rule for this function on the spectrum of blocks (a band of modes "
            "over the domain group)",
            "transform back to blocks first (torch.fft.irfft2 / ifft2), or gather the "
            "spectrum (.full_tensor())",
        )
    if _FALLBACK["on"]:
        return _gather_fallback(func, args, kwargs)
    raise refuse(
        func,
        args,
        kwargs,
        "mpidp has no band form of this function, and computing it on this rank's band "
        "alone could mix in (or miss) other ranks' rows",
        "register a handler (mpidp.sharded.register), call .full_tensor() before it, or "
        "let mpidp gather for it (mpidp.sharded.allow_fallback(), or "
        "MPIDP_SHARDED_FALLBACK=1: slow, every rank runs the serial op)",
    )


def _is_sharded(a: Any) -> bool:
    return isinstance(a, ShardedTensor)


def _is_block(a: Any) -> bool:
    return isinstance(a, ShardedTensor) and a._grid is not None


def _is_spectrum(a: Any) -> bool:
    return isinstance(a, ShardedTensor) and a._spectral


#: the fix for a call on a block whose cut holds merged blocks (``BlockSpec.lead``)
MERGED_FIX = "reshape the window index back out of the batch (window_reverse) first"


def _is_merged_block(a: Any) -> bool:
    return isinstance(a, ShardedTensor) and isinstance(a._grid, BlockSpec) and a._grid.merged


def _is_merged(a: Any) -> bool:
    return isinstance(a, ShardedTensor) and a._blocks > 1


def _grid_dispatch(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    block: ShardedTensor,
    route: list[Any] | None = None,
) -> Any:
    """A call with a latitude x longitude block that the batch rule does not take: its block
    handler, a band handler that takes blocks, the gathering fallback, or refused on every
    rank alike (before any message)."""
    k = key(func)
    if isinstance(block.grid, TokenSpec):
        handler = _TOKENS.get(k)  # (no gathering fallback: tokens are no block to cut back)
        if handler is None:
            raise refuse(func, args, kwargs, TOKENS_MIX, TOKENS_FIX)
        if route is not None:
            route[0] = handler
        return handler(func, args, kwargs)
    handler = _GRID.get(k)
    if handler is None:
        band = _HANDLERS.get(k)
        handler = band if band in _GRID_OK else None
    if handler is not None:
        if handler not in _BLOCKS_OK and first((args, kwargs), _is_merged_block) is not None:
            raise refuse(
                func,
                args,
                kwargs,
                "a cut of its block holds blocks merged before it (a batch folded into a "
                "window index) and this function reads across that dim",
                MERGED_FIX,
            )
        if route is not None:
            route[0] = handler
        return handler(func, args, kwargs)
    if _FALLBACK["on"]:
        return _gather_fallback(func, args, kwargs)
    raise blocks_refused(
        block.manager, f"{name_of(func)}({describe(args, kwargs)}) on a block ShardedTensor"
    )


TOKENS_MIX = (
    "its argument holds tokens of blocks (a block's rows x columns flattened into one dim, "
    "each rank's in block order, not the global one) and this function mixes tokens or "
    "indexes them by position (a convolution over tokens, a product contracting the "
    "queries' tokens)"
)
TOKENS_FIX = (
    "reshape the tokens back into (..., H, W) before it (attention with the queries' tokens as "
    "rows is exact: q @ k.transpose(-2, -1), @ v, scaled_dot_product_attention, causal too, "
    "nn.MultiheadAttention); or bands "
    "(mpidp.init(domain_parallel_size=P): the tokens are a band), or gather (.full_tensor())"
)


def _has_blocks(args: Any, kwargs: Any) -> bool:
    return first((args, kwargs), _is_merged) is not None


def _gather_fallback(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    ref = first_sharded(args, kwargs)
    name = name_of(func)
    if name not in _WARNED:
        _WARNED.add(name)
        nbytes = sum(
            a.numel() * a.element_size()
            for a in tree_flatten((args, kwargs))[0]
            if isinstance(a, ShardedTensor)
        )
        warnings.warn(
            f"mpidp: {name} has no band form; gathering {nbytes} bytes to every rank and "
            f"running it whole (mpidp.sharded.allow_fallback is on). Register a handler to "
            f"make it fast",
            stacklevel=3,
        )
    full_args, full_kwargs = tree_map(
        lambda a: a.full_tensor() if isinstance(a, ShardedTensor) else a, (args, kwargs)
    )
    out = func(*full_args, **full_kwargs)
    d, n, g = ref.shard_dim, ref.spec.total, ref.grid

    def back(o: Any) -> Any:
        if isinstance(g, BlockSpec) and isinstance(o, torch.Tensor) and o.dim() == ref.dim():
            if (o.size(g.dims[0]), o.size(g.dims[1])) == g.shape:
                return shard(o, g.dims, ref.manager, g)
        elif isinstance(o, torch.Tensor) and o.dim() == ref.dim() and o.size(d) == n:
            return shard(o, d, ref.manager, ref.spec)
        if isinstance(o, torch.Tensor) and not isinstance(o, Replicated):
            return replicated(o, ref.transport)
        return o

    return tree_map(back, out)
