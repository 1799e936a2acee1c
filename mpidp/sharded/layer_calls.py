"""The plumbing of the layer handlers (:mod:`mpidp.sharded.layers`, :mod:`~mpidp.sharded.pooling`,
:mod:`~mpidp.sharded.norms`): a functional call (``F.conv2d(x, w, b, ...)``) turned into its
torch module with the call's tensors as its (shared, not copied) weights, wrapped as mpidp's
domain-parallel layer, and run on the band with the ShardedTensor's partition known
(:func:`mpidp.layers.base.known_spec`: no all-gather to learn it). The result's partition is
the manager's policy applied to the global output length, which a run of the serial function
on meta tensors gives (:func:`meta_result`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from mpidp.layers.base import known_spec
from mpidp.layers.registry import layer_for
from mpidp.ops.collectives import copy_to
from mpidp.runtime.grid import BlockSpec
from mpidp.sharded.dispatch import Handler, refuse
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
            return handler(func, args, kwargs)

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
    func: Any, args: Any, kwargs: Any, module: nn.Module, x: ShardedTensor, *call: Any
) -> ShardedTensor:
    """``module``'s domain-parallel wrapper on ``x``'s band; the result on the manager's
    partition of the global output length. On a block (``x.grid``) the wrapper runs per axis
    (:meth:`~mpidp.layers.base.DomainParallel._axes`: the longitude is the dim after the
    latitude), and the result is cut by the policy along each axis."""
    m = x.manager
    found = layer_for(type(module))
    if found is None:
        raise refuse(func, args, kwargs, f"no band form of {type(module).__name__}", "gather")
    wrapper = found[1]
    dp = wrapper.from_module(module, m, x.shard_dim - x.dim())
    g = x.grid
    if g is None:
        with known_spec(x.local, x.shard_dim, x.spec):
            y = dp(x.local, *call)
        n_out = meta_result(func, args, kwargs)[x.shard_dim]
        spec = m.partition.derived(n_out, m.domain_world_size)
        return ShardedTensor(y, spec, x.shard_dim, m)
    if g.dims[1] != g.dims[0] + 1:
        raise refuse(
            func, args, kwargs, "a block whose longitude does not follow its latitude", "permute"
        )
    with known_spec(x.local, g.dims[0], g.lat), known_spec(x.local, g.dims[1], g.lon):
        y = dp(x.local, *call)
    shape = meta_result(func, args, kwargs)
    lat, lon = (m.partition.derived(shape[d], p) for d, p in zip(g.dims, m.grid, strict=True))
    return ShardedTensor(y, lat, g.dims[0], m, grid=BlockSpec(lat, lon, g.dims))


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
