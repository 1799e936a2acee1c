"""The plumbing of the layer handlers (:mod:`mpidp.sharded.layers`, :mod:`~mpidp.sharded.pooling`,
:mod:`~mpidp.sharded.norms`): a functional call (``F.conv2d(x, w, b, ...)``) turned into its
torch module with the call's tensors as its (shared, not copied) weights, wrapped as mpidp's
domain-parallel layer, and run on the band with the ShardedTensor's partition known
(:func:`mpidp.layers.base.known_spec`: no all-gather to learn it). The result's partition is
the manager's policy applied to the global output length, which a run of the serial function
on meta tensors gives (:func:`meta_result`).

A layer call is planned (:class:`_Plan`): what its handler decided for one call signature (the
band's layout, the other arguments' values, the parameters by identity: :func:`_signature`),
the domain-parallel layer it built and its result's cut, is kept, and the next call of the
same signature runs that layer on its band at once. A call of any other signature (another
layout, shape, argument or parameter) takes the handler, which checks it (and refuses) as
ever, and plans it anew.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from mpidp.layers.base import known_spec
from mpidp.layers.registry import layer_for
from mpidp.ops.collectives import copy_to
from mpidp.runtime.grid import BlockSpec
from mpidp.runtime.partition import _KNOWN, ShardSpec
from mpidp.sharded.dispatch import WATCHERS, Handler, refuse
from mpidp.sharded.dispatch import register as _register
from mpidp.sharded.tensor import Replicated, ShardedTensor

__all__ = [
    "as_tuple",
    "band_weight",
    "bind_args",
    "check_spatial",
    "meta_result",
    "module_with",
    "register",
    "run_layer",
    "spectrum_refused",
]


def register(*funcs: Any, grid: bool = False, spectral: bool = False) -> Any:
    """:func:`mpidp.sharded.register` for the functions of this module, whose input (the
    first argument) is the band: one whose input is not a ShardedTensor (a sharded weight) or,
    unless ``spectral``, is a spectrum of blocks (:attr:`~mpidp.ShardedTensor.spectral`: the
    layers would take its band of modes for rows of the field) is refused before the handler
    runs. ``grid``: it takes latitude x longitude blocks too (its work done by
    :func:`run_layer`). ``spectral``: the handler takes spectra itself, never to a layer."""

    def deco(handler: Handler) -> Handler:
        def checked(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            x = args[0] if args else kwargs.get("input")
            if not isinstance(x, ShardedTensor):
                raise refuse(
                    func,
                    args,
                    kwargs,
                    "its input is not a band (a sharded weight or other argument)",
                    "shard the input, not the weights; or gather them (.full_tensor())",
                )
            if x.spectral and not spectral:
                raise spectrum_refused(func, args, kwargs)
            sig = _signature(func, args, kwargs)
            if sig is None:
                return handler(func, args, kwargs)
            plan = _PLANS.get(sig[0])
            if plan is not None:
                return _on_part(plan.layer, x, plan.call, plan.lat, plan.lon)
            return _planning(handler, func, args, kwargs, sig)

        _register(*funcs, grid=grid)(checked)
        return handler

    return deco


def spectrum_refused(func: Any, args: Any, kwargs: Any) -> Exception:
    """The refusal of a layer (``func``, or a module) called on a spectrum of blocks."""
    return refuse(
        func,
        args,
        kwargs,
        "its input is a spectrum of blocks (the modes cut over the whole domain group), and "
        "this layer reads a field cut into rows and columns",
        "transform back to blocks first (torch.fft.irfft2 / ifft2), or gather the spectrum "
        "(.full_tensor())",
    )


def _meta(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return torch.empty(tuple(a.shape), dtype=a.dtype, device="meta")
    return a


_META: dict[Any, Any] = {}


def _key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), a.dtype)
    try:
        hash(a)
    except TypeError:
        return repr(a)
    return a


def meta_result(func: Any, args: Any, kwargs: Any) -> Any:
    """The shape ``func`` returns for the global shapes (run on meta tensors once per
    distinct call: a layer called at every step asks once)."""
    leaves, spec = tree_flatten((args, kwargs))
    key = (func, str(spec), tuple(_key(a) for a in leaves))
    found = _META.get(key)
    if found is None:
        margs, mkwargs = tree_map(_meta, (args, kwargs))
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            found = func(*margs, **mkwargs).shape
        if len(_META) > 4096:
            _META.clear()
        _META[key] = found
    return found


def band_weight(a: Any, x: ShardedTensor) -> Any:
    """A weight for a band computation: a Replicated one enters through copy_to."""
    if isinstance(a, Replicated):
        return copy_to(a.as_subclass(torch.Tensor), x.transport)
    return a


def run_layer(
    func: Any,
    args: Any,
    kwargs: Any,
    module: nn.Module,
    x: ShardedTensor,
    *call: Any,
    shape: Sequence[int] | None = None,
) -> ShardedTensor:
    """``module``'s domain-parallel wrapper on ``x``'s band; the result on the manager's
    partition of the global output length (of ``shape``, the global output shape where the
    handler knows it: many ops on meta tensors import torch's compiler, 1.7 s; else the
    serial call's on meta tensors, :func:`meta_result`). On a block (``x.grid``) the wrapper
    runs per axis (:meth:`~mpidp.layers.base.DomainParallel._axes`: the longitude is the dim
    after the latitude), and the result is cut by the policy along each axis."""
    m = x.manager
    found = layer_for(type(module))
    if found is None:
        raise refuse(func, args, kwargs, f"no band form of {type(module).__name__}", "gather")
    wrapper = found[1]
    dp = wrapper.from_module(module, m, x.shard_dim - x.dim())
    g = x.grid
    shape = shape or meta_result(func, args, kwargs)
    if g is None:
        lat, lon = m.partition.derived(shape[x.shard_dim], m.domain_world_size), None
    else:
        if g.dims[1] != g.dims[0] + 1:
            raise refuse(
                func,
                args,
                kwargs,
                "a block whose longitude does not follow its latitude",
                "permute",
            )
        lat, lon = (m.partition.derived(shape[d], p) for d, p in zip(g.dims, m.grid, strict=True))
    out = _on_part(dp, x, call, lat, lon)
    if _RECORDING:
        _RECORDING[-1].append((out, dp, x, call, lat, lon))
    return out


def _on_part(
    dp: Any, x: ShardedTensor, call: tuple[Any, ...], lat: ShardSpec, lon: ShardSpec | None
) -> ShardedTensor:
    """The layer ``dp`` on ``x``'s band (or block), its partition known; the result cut by
    ``lat`` (and on a block ``lon`` along the next dim)."""
    g, m, local = x._grid, x._manager, x._local
    if g is None:  # (known_spec's context variable set here, without its generator)
        known = _KNOWN.set(((local, x._dim, x._spec), *_KNOWN.get()))
        try:
            y = dp(local, *call)
        finally:
            _KNOWN.reset(known)
        return ShardedTensor(y, lat, x._dim, m)
    assert lon is not None and isinstance(g, BlockSpec)
    with known_spec(local, g.dims[0], g.lat), known_spec(local, g.dims[1], g.lon):
        y = dp(local, *call)
    return ShardedTensor(y, lat, g.dims[0], m, grid=BlockSpec(lat, lon, g.dims))


class _Plan(NamedTuple):
    """What a layer handler decided for one call signature (:func:`_signature`): the
    domain-parallel layer it built (holding the call's parameters, :attr:`tensors`), the
    further arguments of its call, and the cut of its result."""

    layer: Any
    call: tuple[Any, ...]
    lat: ShardSpec
    lon: ShardSpec | None
    #: the call's parameters, held: the signature names them by ``id``, which no other
    #: tensor takes while they live
    tensors: tuple[torch.Tensor, ...]


#: the plans by call signature; cleared when full (every rank makes the same calls: the same
#: plans everywhere)
_PLANS: dict[Any, _Plan] = {}
#: the layers :func:`run_layer` ran while a handler is planned (one list per planned call)
_RECORDING: list[list[Any]] = []
_VALUES = (bool, int, float, str, type(None), torch.dtype, torch.device)
_VALUE_SET = set(_VALUES)


def _signature(func: Any, args: Any, kwargs: Any) -> tuple[Any, list[Any]] | None:
    """(The key of a plannable call, its parameters), or None: the input a band or block
    ShardedTensor as the first argument, then parameters (``nn.Parameter``: a model's own,
    named by identity, shape and dtype), Python values and tuples of them. What else the
    handler reads of the call (a tensor computed per call, a container) is not a plan's."""
    x = args[0] if args else None
    if type(x) is not ShardedTensor or x._manager.gradients == "whole" or WATCHERS:
        return None
    local = x._local
    sig: list[Any] = [func, local.shape, local.dtype, local.device, local.requires_grad]
    # (a ShardSpec is its sizes, which hash without a Python call)
    sig += (x._spec.sizes, x._dim, x._manager, x._grid, x._blocks, x._spectral, len(args))
    tensors: list[Any] = []
    for k, a in (*enumerate(args[1:]), *kwargs.items()):
        t = type(a)
        if t is nn.Parameter:
            sig += (k, id(a), a.shape, a.dtype)
            tensors.append(a)
        elif t in _VALUES or t is torch.Size:
            sig += (k, t, a)
        elif (t is tuple or t is list) and set(types := tuple(map(type, a))) <= _VALUE_SET:
            sig += (k, t, tuple(a), types)  # (no generator over the items: per call)
        else:
            return None
    return tuple(sig), tensors


def _planning(
    handler: Handler, func: Any, args: Any, kwargs: Any, sig: tuple[Any, list[Any]]
) -> Any:
    """The handler on a call of a new signature; its plan kept when it ran one layer on the
    input as it is (:func:`run_layer`) and returned that layer's result, the layer holding no
    tensor but the call's parameters."""
    ran: list[Any] = []
    _RECORDING.append(ran)
    try:
        out = handler(func, args, kwargs)
    finally:
        _RECORDING.pop()
    if len(ran) == 1 and ran[0][0] is out and ran[0][2] is args[0]:
        _, dp, _, call, lat, lon = ran[0]
        if _holds_only(dp, sig[1]) and not any(isinstance(c, torch.Tensor) for c in call):
            if len(_PLANS) >= 1024:
                _PLANS.clear()
            _PLANS[sig[0]] = _Plan(dp, call, lat, lon, tuple(sig[1]))
    return out


def _holds_only(dp: nn.Module, tensors: list[Any]) -> bool:
    """Whether every tensor ``dp`` holds (attributes, in lists too, parameters, buffers) is
    one of ``tensors``, and it has no submodules."""
    if dp._modules:
        return False
    for v in (*dp.__dict__.values(), *dp._parameters.values(), *dp._buffers.values()):
        for item in v if isinstance(v, (list, tuple)) else (v,):
            if isinstance(item, torch.Tensor) and not any(item is t for t in tensors):
                return False
    return True


def check_spatial(func: Any, args: Any, kwargs: Any, x: ShardedTensor, n: int) -> None:
    """The sharded dim must be one of the ``n`` spatial (last) dims."""
    if x.shard_dim < x.dim() - n:
        raise refuse(
            func,
            args,
            kwargs,
            f"sharded along dim {x.shard_dim}, which is not one of its {n} spatial dims",
            "shard along a spatial dim (H), or redistribute(dim=...) first",
        )


def module_with(cls: type[nn.Module], **attrs: Any) -> nn.Module:
    """A torch module of ``cls`` with ``attrs`` set as they are (tensors shared)."""
    mod = cls.__new__(cls)
    nn.Module.__init__(mod)
    for k, v in attrs.items():
        if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
            object.__setattr__(mod, k, v)
        else:
            setattr(mod, k, v)
    return mod


def as_tuple(v: Any, n: int) -> tuple[Any, ...]:
    return tuple(v) if isinstance(v, Sequence) and not isinstance(v, str) else (v,) * n


def bind_args(
    args: tuple[Any, ...], kwargs: dict[str, Any], names: Sequence[str], defaults: dict[str, Any]
) -> dict[str, Any]:
    out = dict(defaults)
    out.update(zip(names, args, strict=False))
    out.update(kwargs)
    return out
