"""Handlers: convolutions, padding, interpolation and pixel shuffles, through the same
code as the converted layers (one implementation, two front ends); pooling and normalisation
are in :mod:`mpidp.sharded.pooling` and :mod:`mpidp.sharded.norms`, the plumbing they share in
:mod:`mpidp.sharded.layer_calls`.

A functional call (``F.conv2d(x, w, b, ...)``) is turned into its torch module with the call's
tensors as its (shared, not copied) weights, wrapped as mpidp's domain-parallel layer, and run
on the band with the ShardedTensor's partition known (:func:`mpidp.layers.base.known_spec`:
no all-gather to learn it). The result's partition is the manager's policy applied to the
global output length, which a run of the serial function on meta tensors gives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mpidp.layers.periodic import PeriodicConv2d, padded_conv2d, periodic_conv2d
from mpidp.layers.shuffle import shuffle, unshuffle
from mpidp.runtime.partition import ShardSpec
from mpidp.sharded.dispatch import refuse
from mpidp.sharded.layer_calls import (
    as_tuple,
    band_weight,
    bind_args,
    check_spatial,
    meta_result,
    module_with,
    register,
    run_layer,
)
from mpidp.sharded.rows import to_spec
from mpidp.sharded.shapes import _aligned
from mpidp.sharded.tensor import ShardedTensor

__all__ = ["meta_result"]


# -- convolutions -------------------------------------------------------------------------------

_CONV = {F.conv1d: (1, nn.Conv1d), F.conv2d: (2, nn.Conv2d), F.conv3d: (3, nn.Conv3d)}
_CONV_T = {
    F.conv_transpose1d: (1, nn.ConvTranspose1d),
    F.conv_transpose2d: (2, nn.ConvTranspose2d),
    F.conv_transpose3d: (3, nn.ConvTranspose3d),
}


@register(*_CONV, grid=True)
def _conv(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    n, cls = _CONV[func]
    a = bind_args(
        args,
        kwargs,
        ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
        {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1},
    )
    x = a["input"]
    check_spatial(func, args, kwargs, x, n)
    padding = a["padding"] if isinstance(a["padding"], str) else as_tuple(a["padding"], n)
    mod = _conv_module(cls, n, a, padding=padding)
    return run_layer(func, args, kwargs, mod, x)


@register(*_CONV_T, grid=True)
def _conv_t(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    n, cls = _CONV_T[func]
    names = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
    a = bind_args(
        args,
        kwargs,
        names,
        {"bias": None, "stride": 1, "padding": 0, "output_padding": 0, "groups": 1, "dilation": 1},
    )
    x = a["input"]
    check_spatial(func, args, kwargs, x, n)
    w = band_weight(a["weight"], x)
    mod = module_with(
        cls,
        in_channels=w.shape[0],
        out_channels=w.shape[1] * a["groups"],
        kernel_size=tuple(w.shape[2:]),
        stride=as_tuple(a["stride"], n),
        padding=as_tuple(a["padding"], n),
        output_padding=as_tuple(a["output_padding"], n),
        dilation=as_tuple(a["dilation"], n),
        groups=a["groups"],
        padding_mode="zeros",
        transposed=True,
        weight=w,
        bias=band_weight(a["bias"], x),
    )
    return run_layer(func, args, kwargs, mod, x)


@register(periodic_conv2d, grid=True)
def _periodic_conv(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A :class:`~mpidp.layers.PeriodicConv2d` fed a ShardedTensor: its layer in one call (the
    pole rows and the longitude wrap from one halo exchange)."""
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups", "pole")
    a = bind_args(args, kwargs, names, {})
    x = a["input"]
    if x.shard_dim != x.dim() - 2 or (a["pole"] != "reflect" and x.shape[-1] % 2):
        # the layer cuts the latitude (H) and rolls half of an even circle: other layouts op
        # by op, as serial
        return padded_conv2d(*(a[n] for n in names))
    periodic = as_tuple(a["padding"], 2)
    mod = _conv_module(PeriodicConv2d, 2, a, (0, 0), periodic_padding=periodic, pole=a["pole"])
    # the shape of the convolution padded alike (the pole rows' roll would import dynamo)
    conv = (x, a["weight"], a["bias"], a["stride"], periodic, a["dilation"], a["groups"])
    return run_layer(func, args, kwargs, mod, x, shape=meta_result(F.conv2d, conv, {}))


def _conv_module(cls: type[nn.Module], n: int, a: dict[str, Any], padding: Any, **more: Any) -> Any:
    """The ``n``-d convolution module of class ``cls`` for a functional call's bound
    arguments ``a`` (its weights shared), with ``more`` attributes (a periodic conv's)."""
    x, w = a["input"], band_weight(a["weight"], a["input"])
    return module_with(
        cls,
        in_channels=w.shape[1] * a["groups"],
        out_channels=w.shape[0],
        kernel_size=tuple(w.shape[2:]),
        stride=as_tuple(a["stride"], n),
        padding=padding,
        dilation=as_tuple(a["dilation"], n),
        groups=a["groups"],
        padding_mode="zeros",
        transposed=False,
        output_padding=(0,) * n,
        weight=w,
        bias=band_weight(a["bias"], x),
        **more,
    )


# -- padding ------------------------------------------------------------------------------------

_PAD_CLASS = {
    ("constant", 1): nn.ConstantPad1d,
    ("constant", 2): nn.ConstantPad2d,
    ("constant", 3): nn.ConstantPad3d,
    ("reflect", 1): nn.ReflectionPad1d,
    ("reflect", 2): nn.ReflectionPad2d,
    ("reflect", 3): nn.ReflectionPad3d,
    ("replicate", 1): nn.ReplicationPad1d,
    ("replicate", 2): nn.ReplicationPad2d,
    ("replicate", 3): nn.ReplicationPad3d,
    ("circular", 1): nn.CircularPad1d,
    ("circular", 2): nn.CircularPad2d,
    ("circular", 3): nn.CircularPad3d,
}


@register(F.pad, torch._C._nn.pad, grid=True, spectral=True)
def _pad(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    a = bind_args(
        args, kwargs, ("input", "pad", "mode", "value"), {"mode": "constant", "value": None}
    )
    x, pad = a["input"], [int(p) for p in a["pad"]]
    if x.grid is not None:
        return _pad_block(func, args, kwargs, x, pad, a)
    k = x.dim() - 1 - x.shard_dim  # the sharded dim's pair in F.pad's order
    if 2 * k + 1 >= len(pad) or (pad[2 * k] == 0 and pad[2 * k + 1] == 0):
        local = F.pad(x.local, pad, a["mode"], a["value"])
        return ShardedTensor(local, x.spec, x.shard_dim, x.manager)
    if x.spectral:
        return _pad_modes(func, args, kwargs, x, pad, a)
    if len(pad) > 2 * k + 2:  # pads of dims before the sharded one: local (padding is separable)
        outer = [0] * (2 * k + 2) + pad[2 * k + 2 :]
        local = F.pad(x.local, outer, a["mode"], a["value"])
        x, pad = ShardedTensor(local, x.spec, x.shard_dim, x.manager), pad[: 2 * k + 2]
    n = len(pad) // 2
    cls = _PAD_CLASS.get((a["mode"], n))
    if cls is None:
        raise refuse(
            func,
            args,
            kwargs,
            f"mode {a['mode']!r} over the last {n} dims, the sharded one among them",
            "use constant, reflect, replicate or circular padding of at most the last 3 dims",
        )
    attrs: dict[str, Any] = {"padding": tuple(pad)}
    if a["mode"] == "constant":
        attrs["value"] = float(a["value"] or 0.0)
    mod = module_with(cls, **attrs)
    # the wrapper counts the sharded dim from the end; it must be one of the padded dims
    return run_layer(func, args, kwargs, mod, x)


def _pad_modes(
    func: Any, args: Any, kwargs: Any, x: ShardedTensor, pad: list[int], a: dict[str, Any]
) -> Any:
    """A constant pad of a spectrum of blocks along its modes (zeroed modes added back after
    a truncation): the first rank's part grows by the pad before, the last rank's by the pad
    after, no message; the cut stays a band of the domain group. A field's pads (reflect,
    replicate, circular) mean nothing there and are refused."""
    k = x.dim() - 1 - x.shard_dim
    before, after = pad[2 * k], pad[2 * k + 1]
    if a["mode"] != "constant" or min(before, after) < 0:
        raise refuse(
            func,
            args,
            kwargs,
            f"a {a['mode']} pad of {(before, after)} along the modes of a spectrum of blocks",
            "pad the modes with zeros (mode='constant', non-negative pads), or transform back",
        )
    mine = list(pad)
    mine[2 * k] = before if x.rank == 0 else 0
    mine[2 * k + 1] = after if x.rank == x.spec.parts - 1 else 0
    sizes = list(x.spec.sizes)
    sizes[0] += before
    sizes[-1] += after
    local = F.pad(x.local, mine, "constant", a["value"])
    return ShardedTensor(local, ShardSpec(tuple(sizes)), x.shard_dim, x.manager, spectral=True)


def _pad_block(
    func: Any, args: Any, kwargs: Any, x: ShardedTensor, pad: list[int], a: dict[str, Any]
) -> Any:
    """F.pad of a block: a pad of neither cut dim is local (the same blocks); one of a cut
    dim runs the converted pad layer of the last two dims on the block (per axis)."""
    g = x.grid
    assert g is not None
    k = x.dim() - 1 - g.dims[0]  # the latitude's pair in F.pad's order (the longitude's: k - 1)
    if k != 1 or g.dims[1] != x.dim() - 1:
        raise refuse(func, args, kwargs, "a block not cut along the last two dims", "permute")
    if not any(pad[:4]):
        return x.like(F.pad(x.local, pad, a["mode"], a["value"]))
    if len(pad) > 4:  # pads of dims before the cut ones: local (padding is separable)
        x = x.like(F.pad(x.local, [0] * 4 + pad[4:], a["mode"], a["value"]))
    cls = _PAD_CLASS[(a["mode"], 2)] if (a["mode"], 2) in _PAD_CLASS else None
    if cls is None:
        raise refuse(func, args, kwargs, f"mode {a['mode']!r} on blocks", "use a torch mode")
    attrs: dict[str, Any] = {"padding": tuple(pad[:4])}
    if a["mode"] == "constant":
        attrs["value"] = float(a["value"] or 0.0)
    return run_layer(func, args, kwargs, module_with(cls, **attrs), x)


# -- interpolation ------------------------------------------------------------------------------


@register(F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear, grid=True)
def _interpolate(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    names = (
        "input",
        "size",
        "scale_factor",
        "mode",
        "align_corners",
        "recompute_scale_factor",
        "antialias",
    )
    a = bind_args(
        args,
        kwargs,
        names,
        {
            "size": None,
            "scale_factor": None,
            "mode": "nearest",
            "align_corners": None,
            "recompute_scale_factor": None,
            "antialias": False,
        },
    )
    if func is F.upsample_bilinear:
        a["mode"], a["align_corners"] = "bilinear", True
    x = a["input"]
    check_spatial(func, args, kwargs, x, x.dim() - 2)
    if a["antialias"] or a["recompute_scale_factor"]:
        raise refuse(
            func, args, kwargs, "antialias / recompute_scale_factor on bands", "leave them off"
        )
    if x.grid is None and x.dim() > 3 and x.shard_dim != x.dim() - 2:
        raise refuse(func, args, kwargs, "bands along a dim other than H", "shard along H")
    # the converted Upsample on the band, or per axis on the block (a scale factor keeps its
    # meaning)
    keep = {k: a[k] for k in ("size", "scale_factor", "mode", "align_corners")}
    mod = module_with(nn.Upsample, name="", recompute_scale_factor=None, **keep)
    return run_layer(F.interpolate, (x,), keep, mod, x)


@register(F.pixel_shuffle, F.pixel_unshuffle)
def _shuffle(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, r = args[0], int(args[1] if len(args) > 1 else next(iter(kwargs.values())))
    if x.shard_dim == x.dim() - 1 and x.blocks == 1:  # bands along W: local
        return _shuffle_along_w(func, x, r)
    if x.shard_dim != x.dim() - 2:
        raise refuse(func, args, kwargs, "bands along a dim other than H or W", "shard along H")
    if func is F.pixel_shuffle:
        mod = module_with(nn.PixelShuffle, upscale_factor=r)
    else:
        mod = module_with(nn.PixelUnshuffle, downscale_factor=r)
    return run_layer(func, args, kwargs, mod, x)


def _shuffle_along_w(func: Any, x: ShardedTensor, r: int) -> ShardedTensor:
    """A pixel shuffle keeps each input column's pixels in the r output columns it becomes:
    bands along W stay local, their sizes times r (an unshuffle: divided by r, after moving
    the boundary columns to the nearest cut on a multiple of r)."""
    if func is F.pixel_shuffle:
        sizes = tuple(n * r for n in x.spec.sizes)
    else:
        if x.spec.total % r:
            raise refuse(
                func, (x, r), {}, f"a width of {x.spec.total} not a multiple of {r}", "pad W"
            )
        aligned = _aligned(x.spec, r)
        x = to_spec(x, aligned) if aligned != x.spec else x
        sizes = tuple(n // r for n in x.spec.sizes)
    out = (shuffle if func is F.pixel_shuffle else unshuffle)(x.local, r)
    return ShardedTensor(out, ShardSpec(sizes), out.dim() - 1, x.manager)
