"""Handlers: convolutions, padding, interpolation, pooling, normalisation, pixel shuffles and
FFTs, through the same code as the converted layers (one implementation, two front ends).

A functional call (``F.conv2d(x, w, b, ...)``) is turned into its torch module with the call's
tensors as its (shared, not copied) weights, wrapped as mpidp's domain-parallel layer, and run
on the band with the ShardedTensor's partition known (:func:`mpidp.layers.base.known_spec`:
no all-gather to learn it). The result's partition is the manager's policy applied to the
global output length, which a run of the serial function on meta tensors gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

import mpidp.ops.fft as dfft
from mpidp.layers.base import DomainParallel, known_spec
from mpidp.layers.interpolate import interpolate as band_interpolate
from mpidp.layers.registry import layer_for
from mpidp.layers.shuffle import shuffle, unshuffle
from mpidp.ops.collectives import copy_to
from mpidp.runtime.partition import ShardSpec
from mpidp.sharded.dispatch import Handler, refuse
from mpidp.sharded.dispatch import register as _register
from mpidp.sharded.rows import move_to_dim, to_spec
from mpidp.sharded.shapes import _aligned
from mpidp.sharded.tensor import Replicated, ShardedTensor

__all__ = ["meta_result"]


def register(*funcs: Any) -> Any:
    """:func:`mpidp.sharded.register` for the functions of this module, whose input (the
    first argument) is the band: one whose input is not a ShardedTensor (a sharded weight) is
    refused before the handler runs."""

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
            return handler(func, args, kwargs)

        _register(*funcs)(checked)
        return handler

    return deco


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


def _weight(a: Any, x: ShardedTensor) -> Any:
    """A weight for a band computation: a Replicated one enters through copy_to."""
    if isinstance(a, Replicated):
        return copy_to(a.as_subclass(torch.Tensor), x.transport)
    return a


def _run(
    func: Any, args: Any, kwargs: Any, module: nn.Module, x: ShardedTensor, *call: Any
) -> ShardedTensor:
    """``module``'s domain-parallel wrapper on ``x``'s band; the result on the manager's
    partition of the global output length."""
    m = x.manager
    found = layer_for(type(module))
    if found is None:
        raise refuse(func, args, kwargs, f"no band form of {type(module).__name__}", "gather")
    wrapper = found[1]
    dp = wrapper.from_module(module, m, x.shard_dim - x.dim())
    with known_spec(x.local, x.shard_dim, x.spec):
        y = dp(x.local, *call)
    n_out = meta_result(func, args, kwargs)[x.shard_dim]
    spec = m.partition.derived(n_out, m.domain_world_size)
    return ShardedTensor(y, spec, x.shard_dim, m)


def _spatial(func: Any, args: Any, kwargs: Any, x: ShardedTensor, n: int) -> None:
    """The sharded dim must be one of the ``n`` spatial (last) dims."""
    if x.shard_dim < x.dim() - n:
        raise refuse(
            func,
            args,
            kwargs,
            f"sharded along dim {x.shard_dim}, which is not one of its {n} spatial dims",
            "shard along a spatial dim (H), or redistribute(dim=...) first",
        )


def _module(cls: type[nn.Module], **attrs: Any) -> nn.Module:
    """A torch module of ``cls`` with ``attrs`` set as they are (tensors shared)."""
    mod = cls.__new__(cls)
    nn.Module.__init__(mod)
    for k, v in attrs.items():
        if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
            object.__setattr__(mod, k, v)
        else:
            setattr(mod, k, v)
    return mod


def _tuple(v: Any, n: int) -> tuple[Any, ...]:
    return tuple(v) if isinstance(v, Sequence) and not isinstance(v, str) else (v,) * n


def _bind(
    args: tuple[Any, ...], kwargs: dict[str, Any], names: Sequence[str], defaults: dict[str, Any]
) -> dict[str, Any]:
    out = dict(defaults)
    out.update(zip(names, args, strict=False))
    out.update(kwargs)
    return out


# -- convolutions -------------------------------------------------------------------------------

_CONV = {F.conv1d: (1, nn.Conv1d), F.conv2d: (2, nn.Conv2d), F.conv3d: (3, nn.Conv3d)}
_CONV_T = {
    F.conv_transpose1d: (1, nn.ConvTranspose1d),
    F.conv_transpose2d: (2, nn.ConvTranspose2d),
    F.conv_transpose3d: (3, nn.ConvTranspose3d),
}


@register(*_CONV)
def _conv(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    n, cls = _CONV[func]
    a = _bind(
        args,
        kwargs,
        ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
        {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1},
    )
    x = a["input"]
    _spatial(func, args, kwargs, x, n)
    w = _weight(a["weight"], x)
    mod = _module(
        cls,
        in_channels=w.shape[1] * a["groups"],
        out_channels=w.shape[0],
        kernel_size=tuple(w.shape[2:]),
        stride=_tuple(a["stride"], n),
        padding=a["padding"] if isinstance(a["padding"], str) else _tuple(a["padding"], n),
        dilation=_tuple(a["dilation"], n),
        groups=a["groups"],
        padding_mode="zeros",
        transposed=False,
        output_padding=(0,) * n,
        weight=w,
        bias=_weight(a["bias"], x),
    )
    return _run(func, args, kwargs, mod, x)


@register(*_CONV_T)
def _conv_t(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    n, cls = _CONV_T[func]
    names = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
    a = _bind(
        args,
        kwargs,
        names,
        {"bias": None, "stride": 1, "padding": 0, "output_padding": 0, "groups": 1, "dilation": 1},
    )
    x = a["input"]
    _spatial(func, args, kwargs, x, n)
    w = _weight(a["weight"], x)
    mod = _module(
        cls,
        in_channels=w.shape[0],
        out_channels=w.shape[1] * a["groups"],
        kernel_size=tuple(w.shape[2:]),
        stride=_tuple(a["stride"], n),
        padding=_tuple(a["padding"], n),
        output_padding=_tuple(a["output_padding"], n),
        dilation=_tuple(a["dilation"], n),
        groups=a["groups"],
        padding_mode="zeros",
        transposed=True,
        weight=w,
        bias=_weight(a["bias"], x),
    )
    return _run(func, args, kwargs, mod, x)


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


@register(F.pad, torch._C._nn.pad)
def _pad(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    a = _bind(args, kwargs, ("input", "pad", "mode", "value"), {"mode": "constant", "value": None})
    x, pad = a["input"], [int(p) for p in a["pad"]]
    k = x.dim() - 1 - x.shard_dim  # the sharded dim's pair in F.pad's order
    if 2 * k + 1 >= len(pad) or (pad[2 * k] == 0 and pad[2 * k + 1] == 0):
        local = F.pad(x.local, pad, a["mode"], a["value"])
        return ShardedTensor(local, x.spec, x.shard_dim, x.manager)
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
    mod = _module(cls, **attrs)
    # the wrapper counts the sharded dim from the end; it must be one of the padded dims
    return _run(func, args, kwargs, mod, x)


# -- interpolation ------------------------------------------------------------------------------


@register(F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear)
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
    a = _bind(
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
    _spatial(func, args, kwargs, x, x.dim() - 2)
    if a["antialias"] or a["recompute_scale_factor"]:
        raise refuse(
            func, args, kwargs, "antialias / recompute_scale_factor on bands", "leave them off"
        )
    if x.dim() > 3 and x.shard_dim != x.dim() - 2:
        raise refuse(func, args, kwargs, "bands along a dim other than H", "shard along H")
    shard_dim = x.shard_dim - x.dim()
    with known_spec(x.local, x.shard_dim, x.spec):
        y = band_interpolate(
            x.local,
            a["size"],
            a["scale_factor"],
            a["mode"],
            a["align_corners"],
            shard_dim=shard_dim,
            layer=_owner(x),
        )
    m = x.manager
    n_out = meta_result(
        F.interpolate, (x,), {k: a[k] for k in ("size", "scale_factor", "mode", "align_corners")}
    )[x.shard_dim]
    return ShardedTensor(y, m.partition.derived(n_out, m.domain_world_size), x.shard_dim, m)


def _owner(x: ShardedTensor) -> DomainParallel:
    """The layer :func:`mpidp.layers.interpolate.interpolate` asks for its manager."""
    owner = DomainParallel()
    owner._dp_setup(x.manager, x.shard_dim - x.dim())
    return owner


# -- pooling ------------------------------------------------------------------------------------


def _pool_handler(n: int, kind: str) -> Any:
    cls = getattr(nn, f"{kind}Pool{n}d")

    def handler(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kind == "Max":
            names = (
                "input",
                "kernel_size",
                "stride",
                "padding",
                "dilation",
                "ceil_mode",
                "return_indices",
            )
            defaults = {
                "stride": None,
                "padding": 0,
                "dilation": 1,
                "ceil_mode": False,
                "return_indices": False,
            }
        else:
            names = (
                "input",
                "kernel_size",
                "stride",
                "padding",
                "ceil_mode",
                "count_include_pad",
                "divisor_override",
            )
            defaults = {
                "stride": None,
                "padding": 0,
                "ceil_mode": False,
                "count_include_pad": True,
                "divisor_override": None,
            }
        a = _bind(args, kwargs, names, defaults)
        x = a.pop("input")
        _spatial(func, args, kwargs, x, n)
        if a.get("return_indices"):
            raise refuse(func, args, kwargs, "pooling indices on bands", "pool without indices")
        if a["stride"] is None or (isinstance(a["stride"], Sequence) and not a["stride"]):
            a["stride"] = a["kernel_size"]
        if n == 1 and kind == "Avg":
            a.pop("divisor_override")
        mod = _module(cls, **a)
        return _run(func, args, kwargs, mod, x)

    return handler


def _adaptive_handler(n: int, kind: str) -> Any:
    cls = getattr(nn, f"Adaptive{kind}Pool{n}d")

    def handler(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        a = _bind(
            args, kwargs, ("input", "output_size", "return_indices"), {"return_indices": False}
        )
        x = a["input"]
        _spatial(func, args, kwargs, x, n)
        if a["return_indices"]:
            raise refuse(func, args, kwargs, "pooling indices on bands", "pool without indices")
        size = _tuple(a["output_size"], n)
        k = x.shard_dim - (x.dim() - n)
        oh = size[k] if size[k] is not None else x.shape[x.shard_dim]
        if oh < x.spec.parts:  # a few rows: every rank gets them whole (Replicated)
            return _adaptive_few(x, size, k, oh, n, kind, func)
        mod = _module(
            cls,
            output_size=a["output_size"],
            **({"return_indices": False} if kind == "Max" else {}),
        )
        return _run(func, args, kwargs, mod, x)

    return handler


def _adaptive_few(
    x: ShardedTensor, size: tuple[Any, ...], k: int, oh: int, n: int, kind: str, func: Any
) -> Any:
    """An adaptive pool to fewer rows than ranks: each output row is the mean (max) of its
    window of rows, a global reduction; the other dims pooled by torch on that row."""
    h, d = x.shape[x.shard_dim], x.shard_dim
    rows = []
    for o in range(oh):
        a, b = (o * h) // oh, -(-((o + 1) * h) // oh)
        seg = x.narrow(d, a, b - a)
        rows.append(seg.amax(d, keepdim=True) if kind == "Max" else seg.mean(d, keepdim=True))
    joined = torch.cat(rows, d) if len(rows) > 1 else rows[0]
    rest = list(size)
    rest[k] = oh
    pool = getattr(F, f"adaptive_{kind.lower()}_pool{n}d")
    return pool(joined, tuple(rest))


for _n in (1, 2, 3):
    for _kind in ("Max", "Avg"):
        register(getattr(F, f"{_kind.lower()}_pool{_n}d"))(_pool_handler(_n, _kind))
        register(getattr(F, f"adaptive_{_kind.lower()}_pool{_n}d"))(_adaptive_handler(_n, _kind))
register(F.max_pool2d_with_indices, F.max_pool1d_with_indices, F.max_pool3d_with_indices)(
    lambda func, args, kwargs: (_ for _ in ()).throw(
        refuse(func, args, kwargs, "pooling indices on bands", "pool without indices")
    )
)


# -- normalisation ------------------------------------------------------------------------------


@register(F.group_norm)
def _group_norm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    a = _bind(
        args,
        kwargs,
        ("input", "num_groups", "weight", "bias", "eps"),
        {"weight": None, "bias": None, "eps": 1e-5},
    )
    x = a["input"]
    if x.shard_dim < 2:
        raise refuse(func, args, kwargs, "sharded along the batch or channel dim", "shard along H")
    w = _weight(a["weight"], x)
    mod = _module(
        nn.GroupNorm,
        num_groups=a["num_groups"],
        num_channels=x.shape[1],
        eps=a["eps"],
        affine=w is not None,
        weight=w,
        bias=_weight(a["bias"], x),
    )
    return _run(func, args, kwargs, mod, x)


def _statistics_norm(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], flag: str, flag_default: bool
) -> tuple[ShardedTensor, dict[str, Any], dict[str, Any]]:
    """F.batch_norm / F.instance_norm's arguments (``flag``: ``training`` or
    ``use_input_stats``) and the attributes of the module that computes them."""
    names = ("input", "running_mean", "running_var", "weight", "bias", flag, "momentum", "eps")
    defaults = {"running_mean": None, "running_var": None, "weight": None, "bias": None}
    a = _bind(args, kwargs, names, {**defaults, flag: flag_default, "momentum": 0.1, "eps": 1e-5})
    x = a["input"]
    if x.dim() not in (4, 5) or x.shard_dim < 2:
        raise refuse(
            func,
            args,
            kwargs,
            "a normalisation of this layout on bands",
            "use (B, C, H, W) or (B, C, T, H, W) bands along H",
        )
    w = _weight(a["weight"], x)
    attrs = {
        "num_features": x.shape[1],
        "eps": a["eps"],
        "momentum": a["momentum"],
        "affine": w is not None,
        "track_running_stats": a["running_mean"] is not None,
        "weight": w,
        "bias": _weight(a["bias"], x),
        "running_mean": a["running_mean"],
        "running_var": a["running_var"],
    }
    return x, a, attrs


@register(F.batch_norm)
def _batch_norm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, a, attrs = _statistics_norm(func, args, kwargs, "training", False)
    # F.batch_norm gets the momentum already resolved: the counter is the module's, not ours
    track = attrs["track_running_stats"]
    attrs["num_batches_tracked"] = torch.zeros((), dtype=torch.long) if track else None
    mod = _module(nn.BatchNorm2d if x.dim() == 4 else nn.BatchNorm3d, **attrs)
    mod.training = bool(a["training"])
    if mod.momentum is None:
        mod.momentum = 0.0
    return _run(func, args, kwargs, mod, x)


@register(F.instance_norm)
def _instance_norm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, a, attrs = _statistics_norm(func, args, kwargs, "use_input_stats", True)
    mod = _module(nn.InstanceNorm2d if x.dim() == 4 else nn.InstanceNorm3d, **attrs)
    mod.training = bool(a["use_input_stats"])
    return _run(func, args, kwargs, mod, x)


@register(F.layer_norm)
def _layer_norm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    a = _bind(
        args,
        kwargs,
        ("input", "normalized_shape", "weight", "bias", "eps"),
        {"weight": None, "bias": None, "eps": 1e-5},
    )
    x = a["input"]
    shape = tuple(a["normalized_shape"])
    w, b = _weight(a["weight"], x), _weight(a["bias"], x)
    # normalising dims after the sharded one, the batch rule ran it locally
    mod = _module(
        nn.LayerNorm,
        normalized_shape=shape,
        eps=a["eps"],
        elementwise_affine=w is not None,
        weight=w,
        bias=b,
    )
    return _run(func, args, kwargs, mod, x)


@register(F.pixel_shuffle, F.pixel_unshuffle)
def _shuffle(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, r = args[0], int(args[1] if len(args) > 1 else next(iter(kwargs.values())))
    if x.shard_dim == x.dim() - 1 and x.blocks == 1:  # bands along W: local
        return _shuffle_along_w(func, x, r)
    if x.shard_dim != x.dim() - 2:
        raise refuse(func, args, kwargs, "bands along a dim other than H or W", "shard along H")
    if func is F.pixel_shuffle:
        mod = _module(nn.PixelShuffle, upscale_factor=r)
    else:
        mod = _module(nn.PixelUnshuffle, downscale_factor=r)
    return _run(func, args, kwargs, mod, x)


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


# -- FFTs ------------------------------------------------------------------------------------------

_FFT2 = {
    torch.fft.rfft2: (dfft.rfft2, True),
    torch.fft.fft2: (dfft.fft2, True),
    torch.fft.irfft2: (dfft.irfft2, False),
    torch.fft.ifft2: (dfft.ifft2, False),
}
_FFT1 = {
    torch.fft.rfft: dfft.rfft,
    torch.fft.irfft: dfft.irfft,
    torch.fft.fft: dfft.fft,
    torch.fft.ifft: dfft.ifft,
}


@register(*_FFT2)
def _fft2(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    a = _bind(
        args, kwargs, ("input", "s", "dim", "norm"), {"s": None, "dim": (-2, -1), "norm": None}
    )
    x = a["input"]
    nd = x.dim()
    dims = [int(i) % nd for i in a["dim"]]
    fn, forward = _FFT2[func]
    if x.shard_dim not in dims:
        local = func(x.local, a["s"], a["dim"], a["norm"])
        return ShardedTensor(local, x.spec, x.shard_dim, x.manager)
    # the forward transforms want bands along dim[0]; the inverse the modes along dim[1]
    want = dims[0] if forward else dims[1]
    if x.shard_dim != want:
        x = move_to_dim(x, want)
    m = x.manager
    y = fn(x.local, a["s"], a["dim"], a["norm"], manager=m, spec=x.spec, shard_dim=dims[0] - nd)
    if forward:
        lay = dfft.layout(y)
        return ShardedTensor(y, lay.spec, y.dim() + lay.dim, m)
    n_out = meta_result(func, args, kwargs)[dims[0]]
    return ShardedTensor(y, m.partition.derived(n_out, m.domain_world_size), dims[0], m)


@register(*_FFT1)
def _fft1(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    a = _bind(args, kwargs, ("input", "n", "dim", "norm"), {"n": None, "dim": -1, "norm": None})
    x = a["input"]
    d = int(a["dim"]) % x.dim()
    if d != x.shard_dim:
        local = func(x.local, a["n"], d, a["norm"])
        return ShardedTensor(local, x.spec, x.shard_dim, x.manager)
    m = x.manager
    y = _FFT1[func](x.local, a["n"], d, a["norm"], manager=m, spec=x.spec, shard_dim=d)
    n_out = meta_result(func, args, kwargs)[d]
    return ShardedTensor(y, m.partition.derived(n_out, m.domain_world_size), d, m)
