"""Handlers: a ShardedTensor's metadata and autograd methods, and element-wise functions.

Element-wise functions run on the bands or blocks, one rule per cut axis (a band has one cut
dim, a latitude x longitude block two: :mod:`mpidp.sharded.cuts`). Their other tensor
arguments broadcast as in serial: a ShardedTensor of the same global shape (moved to this one's
cut when its cut differs: only boundary rows or columns travel); a plain tensor whose length
along a cut dim is the global length (latitude weights of shape (H, 1)) is cut to this rank's
entries along it, one of length 1 or without that dim is used whole along it; a Replicated
value enters through ``copy_to`` (its gradient is the sum of the ranks' shares). Anything else
along a cut dim is an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map

from mpidp.errors import ConfigError
from mpidp.ops.collectives import copy_to, repartition
from mpidp.runtime.grid import AXES, BlockSpec, axis_transport
from mpidp.runtime.rng import band_stream
from mpidp.sharded.batch import NOT_LOCAL
from mpidp.sharded.block_layout import merged_back, unmerged
from mpidp.sharded.cuts import cuts, part, placed
from mpidp.sharded.dispatch import fast_path, refuse, register
from mpidp.sharded.rows import along, to_spec
from mpidp.sharded.tensor import META_GETTERS, META_METHODS, Replicated, ShardedTensor

__all__ = ["POINTWISE", "home", "pointwise", "local_like", "to_blocks", "to_layout"]


def local_like(x: ShardedTensor, local: torch.Tensor) -> ShardedTensor:
    """``local`` as a ShardedTensor on ``x``'s partition, dim and blocks."""
    return x.like(local)


def home(tensors: Sequence[Any]) -> ShardedTensor:
    """The ShardedTensor whose layout a meeting of several takes: of those longer than one
    row along their sharded dim (a length-1 one broadcasts), one cut along the manager's
    sharded dim (H, where the layers work) if any, else the longest; the first of equals."""
    sharded = [a for a in tensors if isinstance(a, ShardedTensor)]
    tall = [a for a in sharded if a.blocks * a.spec.total > 1] or sharded
    want = tall[0].manager.shard_dim
    for a in tall:
        if (a.shard_dim - a.dim() if want < 0 else a.shard_dim) == want:
            return a
    return max(tall, key=lambda a: a.blocks * a.spec.total)


# -- metadata ----------------------------------------------------------------------------------

_GLOBAL_GETTERS = (
    "shape",
    "dtype",
    "device",
    "ndim",
    "layout",
    "is_cuda",
    "is_cpu",
    "is_sparse",
    "is_quantized",
    "is_meta",
    "is_mkldnn",
    "is_nested",
    "itemsize",
    "nbytes",
    "names",
)
_GLOBAL_METHODS = (
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.ndimension,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.Tensor.element_size,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
    torch.Tensor.is_signed,
    torch.Tensor.get_device,
    torch.Tensor.__len__,
    torch.numel,
    torch.is_floating_point,
    torch.is_complex,
)


META_GETTERS.update(_GLOBAL_GETTERS)  # answered before dispatch (ShardedTensor's fast path)
META_METHODS.update(_GLOBAL_METHODS)


@register(*[("__get__", n) for n in _GLOBAL_GETTERS], *_GLOBAL_METHODS, blocks=True, grid=True)
def _global_meta(func: Any, args: Any, kwargs: Any) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


@register(("__get__", "requires_grad"), blocks=True, grid=True)
def _requires_grad(func: Any, args: Any, kwargs: Any) -> Any:
    return args[0].local.requires_grad


@register(("__get__", "is_leaf"), blocks=True, grid=True)
def _is_leaf(func: Any, args: Any, kwargs: Any) -> Any:
    return args[0].local.is_leaf


@register(("__get__", "grad_fn"), blocks=True, grid=True)
def _grad_fn(func: Any, args: Any, kwargs: Any) -> Any:
    return args[0].local.grad_fn


@register(("__get__", "grad"), blocks=True, grid=True)
def _grad(func: Any, args: Any, kwargs: Any) -> Any:
    x = args[0]
    g = x.local.grad
    return None if g is None else local_like(x, g)


@register(("__set__", "grad"), blocks=True, grid=True)
def _set_grad(func: Any, args: Any, kwargs: Any) -> Any:
    x, g = args
    x.local.grad = g.local if isinstance(g, ShardedTensor) else g


@register(("__set__", "requires_grad"), blocks=True, grid=True)
def _set_requires_grad(func: Any, args: Any, kwargs: Any) -> Any:
    args[0].local.requires_grad = args[1]


@register(("__get__", "_base"), blocks=True, grid=True)
def _base(func: Any, args: Any, kwargs: Any) -> Any:
    """A ShardedTensor is never a view of another tensor (its band may be one: that is the
    band's business, not the global tensor's)."""
    return None


@register(("__get__", "data"), blocks=True, grid=True)
def _data(func: Any, args: Any, kwargs: Any) -> Any:
    return local_like(args[0], args[0].local.data)


@register(torch.Tensor.requires_grad_, blocks=True, grid=True)
def _requires_grad_(func: Any, args: Any, kwargs: Any) -> Any:
    x = args[0]
    x.local.requires_grad_(*args[1:], **kwargs)
    return x


@register(torch.Tensor.retain_grad, blocks=True, grid=True)
def _retain_grad(func: Any, args: Any, kwargs: Any) -> Any:
    args[0].local.retain_grad()


@register(torch.Tensor.backward, blocks=True, grid=True)
def _backward(func: Any, args: Any, kwargs: Any) -> Any:
    x = args[0]
    gradient = args[1] if len(args) > 1 else kwargs.pop("gradient", None)
    if gradient is None:
        raise refuse(
            func,
            args,
            kwargs,
            "backward() without a gradient needs a scalar, and a band is never one",
            "reduce it first (y.sum(), a loss: a replicated scalar), or pass a ShardedTensor "
            "gradient",
        )
    g = gradient.local if isinstance(gradient, ShardedTensor) else gradient
    x.local.backward(g, *args[2:], **kwargs)


@register(torch.Tensor.register_hook, blocks=True, grid=True)
def _register_hook(func: Any, args: Any, kwargs: Any) -> Any:
    x, hook = args[0], args[1]

    def on_band(g: torch.Tensor) -> Any:
        out = hook(local_like(x, g))
        return out.local if isinstance(out, ShardedTensor) else out

    return x.local.register_hook(on_band)


@register(
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.data_ptr,
    torch.Tensor.stride,
    torch.Tensor.storage_offset,
    torch.Tensor.untyped_storage,
    grid=True,
)
def _no_band_value(func: Any, args: Any, kwargs: Any) -> Any:
    raise refuse(
        func,
        args,
        kwargs,
        "a band has no value, storage or strides of the global tensor",
        "reduce it (x.sum(), a replicated value) or gather it (x.full_tensor()) first",
    )


_SAME_LAYOUT = (
    torch.Tensor.detach,
    torch.detach,
    torch.Tensor.detach_,
    torch.Tensor.clone,
    torch.clone,
    torch.Tensor.contiguous,
    torch.Tensor.to,
    torch.Tensor.type,
    torch.Tensor.type_as,
    torch.Tensor.float,
    torch.Tensor.double,
    torch.Tensor.half,
    torch.Tensor.bfloat16,
    torch.Tensor.int,
    torch.Tensor.long,
    torch.Tensor.bool,
    torch.Tensor.cpu,
    torch.Tensor.cuda,
    torch.Tensor.pin_memory,
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
    torch.rand_like,
    torch.randn_like,
    torch.Tensor.zero_,
    torch.Tensor.fill_,
    torch.Tensor.normal_,
    torch.Tensor.uniform_,
)


@register(*_SAME_LAYOUT, blocks=True, grid=True)
def _same_layout(func: Any, args: Any, kwargs: Any) -> Any:
    """Functions of the band alone whose result has the band's shape (a copy, a cast, a
    tensor like it): run on the band, same partition."""
    x = args[0]
    rest = tree_map(_plain_arg, (args[1:], kwargs))
    with band_stream(x.rank, x.local.device, draws(func, args, kwargs)):
        out = func(x.local, *rest[0], **rest[1])
    if out is x.local:  # in place
        return x
    return local_like(x, out) if isinstance(out, torch.Tensor) else out


def _plain_arg(a: Any) -> Any:
    """A non-input argument (``type_as(other)``, ``to(other)``): a ShardedTensor stands for
    its dtype and device, its band does the same."""
    return a.local if isinstance(a, ShardedTensor) else a


# -- element-wise -------------------------------------------------------------------------------

_NAMES = """
abs absolute acos arccos acosh add addcdiv addcmul angle asin arcsin asinh atan arctan atan2
arctan2 atanh bitwise_and bitwise_not bitwise_or bitwise_xor ceil clamp clamp_max clamp_min
clip conj copysign cos cosh deg2rad digamma div divide eq erf erfc erfinv exp exp2 expm1
float_power floor floor_divide fmax fmin fmod frac ge greater greater_equal gt heaviside
hypot i0 igamma igammac imag isclose isfinite isinf isnan isneginf isposinf isreal
ldexp le lerp less less_equal lgamma log log10 log1p log2 logaddexp logaddexp2 logical_and
logical_not logical_or logical_xor logit lt masked_fill maximum minimum mul multiply mvlgamma
nan_to_num ne neg negative nextafter not_equal polygamma positive pow rad2deg real reciprocal
relu remainder round rsqrt sgn sigmoid sign signbit sin sinc sinh sqrt square sub subtract
tan tanh true_divide trunc fix where xlogy complex polar
celu elu gelu hardshrink hardsigmoid hardswish hardtanh leaky_relu logsigmoid
mish relu6 rrelu selu silu softplus softshrink softsign tanhshrink threshold dropout
alpha_dropout
expit ndtr ndtri log_ndtr i0e i1 i1e entr erfcx xlog1py
""".split()

_DUNDERS = """
__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__
__rtruediv__ __itruediv__ __div__ __rdiv__ __idiv__ __floordiv__ __rfloordiv__
__ifloordiv__ __mod__ __rmod__ __imod__ __pow__ __rpow__ __ipow__ __neg__ __pos__ __abs__
__invert__ __and__ __rand__ __iand__ __or__ __ror__ __ior__ __xor__ __rxor__ __ixor__
__eq__ __ne__ __lt__ __le__ __gt__ __ge__ __lshift__ __rshift__
""".split()


def _collect() -> set[Any]:
    found: set[Any] = set()
    spaces = (torch, torch.Tensor, F, torch.special)
    for name in _NAMES:
        for space in spaces:
            for n in (name, name + "_"):
                f = getattr(space, n, None)
                if f is not None and callable(f) and not isinstance(f, type):
                    found.add(f)
    for name in _DUNDERS:
        f = getattr(torch.Tensor, name, None)
        if f is not None:
            found.add(f)
    return found


POINTWISE = _collect()
# element-wise in the values but not in the arguments' roles: (input, dim)-style functions
# whose dim could be the sharded one are handled elsewhere (softmax, cumsum)


POINTWISE |= {("__get__", "real"), ("__get__", "imag")}

#: functions that draw random numbers: on a band, from this rank's own stream
#: (mpidp.runtime.rng.band_stream), so the default generators stay in step across the domain group
RANDOM = {
    f
    for name in (
        "dropout",
        "alpha_dropout",
        "rrelu",
        "rand_like",
        "randn_like",
        "normal_",
        "uniform_",
        "bernoulli_",
        "exponential_",
        "random_",
    )
    for space in (torch, torch.Tensor, F)
    for f in (getattr(space, name, None), getattr(space, name + "_", None))
    if f is not None
}


def draws(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call draws random numbers: a dropout with ``p`` 0 or out of training (and
    an RReLU out of training) draws none, in torch too, so it must not advance the default
    generator here either."""
    if func not in RANDOM:
        return False
    name = getattr(func, "__name__", "")
    if "dropout" not in name and "rrelu" not in name:
        return True
    at = 3 if "rrelu" in name else 2
    train = args[at] if len(args) > at else kwargs.get("training", kwargs.get("train"))
    if train is None:
        train = "alpha" not in name and "rrelu" not in name
    if "rrelu" in name:
        return bool(train)
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    return bool(train) and float(p) > 0


@register(*POINTWISE, blocks=True, grid=True)
def pointwise(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An element-wise function on the bands or blocks, one rule per cut axis (see the module
    doc for its arguments)."""
    if func in (torch.where, torch.Tensor.where) and len(args) + len(kwargs) == 1:
        raise refuse(
            func,
            args,
            kwargs,
            "where(condition) gives the indices of the true entries, and a band's are not "
            "the global ones",
            "call it on x.full_tensor(), or use where(condition, x, y)",
        )
    # flat arguments (nearly every call) skip pytree, which cost more than the op itself
    flat = not kwargs and not any(isinstance(a, list | tuple | dict) for a in args)
    every = args if flat else tree_flatten((args, kwargs))[0]
    leaves = [a for a in every if isinstance(a, torch.Tensor)]
    # the layout that sets the parts: a ShardedTensor of global length 1 broadcasts (as in serial)
    ref = home(leaves)
    out_ndim = max(a.dim() for a in leaves)
    shift = out_ndim - ref.dim()  # the cut dims, counted in the result, are the ref's + shift
    cs = cuts(ref)
    call = (func, args, kwargs)

    def part_of(a: Any) -> Any:
        if isinstance(a, ShardedTensor) and a.blocks * a.spec.total == 1 < cs[0].total:
            a = a.full_tensor()  # a length-1 dim broadcasts: its one row, whole on every rank
        if isinstance(a, ShardedTensor):
            return to_layout(a, ref, call).local
        if not isinstance(a, torch.Tensor):
            return a
        if isinstance(a, Replicated):
            a = copy_to(a.as_subclass(torch.Tensor), ref.transport)
        for c in cs:
            i = a.dim() - (ref.dim() - c.dim)
            if i < 0 or a.size(i) == 1:
                continue
            if a.size(i) != c.total:
                raise refuse(
                    *call,
                    f"a tensor of shape {tuple(a.shape)} has {a.size(i)} entries along the "
                    f"sharded dim {c.dim + shift}, which is neither the global length "
                    f"{c.total} nor 1",
                    "pass a tensor of the global shape (it is cut to each rank's rows) or one "
                    "that broadcasts along the sharded dim",
                )
            a = part(ref, c, a, i)
        return a

    if flat:
        local_args, local_kwargs = tuple(part_of(a) for a in args), {}
    else:
        local_args, local_kwargs = tree_map(part_of, (args, kwargs))
    with band_stream(ref.rank, ref.local.device, draws(func, args, kwargs)):
        out = func(*local_args, **local_kwargs)
    first = args[0] if args else None
    if isinstance(first, ShardedTensor) and out is local_args[0]:
        return first  # in place on the band
    dims = tuple(c.dim + shift for c in cs)
    if isinstance(out, torch.Tensor):
        return _wrap_out(out, out_ndim, dims, ref)
    return tree_map(lambda o: _wrap_out(o, out_ndim, dims, ref), out)


def to_layout(a: ShardedTensor, ref: ShardedTensor, call: tuple[Any, Any, Any]) -> ShardedTensor:
    """``a`` cut as ``ref`` (the same global length along each cut dim, counted from the
    end): a band cut along another dim moves there (the distributed transpose), and along each
    cut only the rows or columns that change owner travel. ``call`` names the op in a
    refusal."""
    if a._grid is not None or ref._grid is not None:
        if a._grid is None or ref._grid is None or a.dim() != ref.dim():
            raise refuse(*call, "ShardedTensors of different blocks meet", "cut alike")
        if a._grid == ref._grid:
            return a
        if not isinstance(a._grid, BlockSpec) or not isinstance(ref._grid, BlockSpec):
            raise refuse(*call, "tokens of blocks cut otherwise meet", "reshape to (..., H, W)")
        return to_blocks(a, ref._grid, call)
    want = a.dim() - (ref.dim() - ref.shard_dim)
    if want != a.shard_dim and want >= 0 and a.blocks == 1 == ref.blocks:
        a = along(a, want)  # cut along another dim: the distributed transpose
    if (
        a.dim() - a.shard_dim != ref.dim() - ref.shard_dim
        or a.spec.total != ref.spec.total
        or a.blocks != ref.blocks
    ):
        raise refuse(
            *call,
            "two ShardedTensors sharded along different dims (or of different global "
            "lengths along it) meet",
            "redistribute one of them (x.redistribute(dim=...))",
        )
    return a if a.spec == ref.spec else to_spec(a, ref.spec)


def to_blocks(x: ShardedTensor, g: BlockSpec, call: tuple[Any, Any, Any]) -> ShardedTensor:
    """``x`` on the blocks ``g`` (the same global field, cut along the same dims): along each
    axis whose cut differs (a slice kept each rank's own columns, the other operand did not)
    only the rows or columns that change owner move, in one repartition over that axis group,
    as a band meeting another band's cut does. ``call`` names the op in a refusal."""
    have = x.grid
    assert have is not None
    if have == g:
        return x
    if have.dims != g.dims or have.shape != g.shape or have.lead != g.lead:
        raise refuse(
            *call, f"blocks of {have!r} meet blocks of {g!r}", "give them one global shape"
        )
    local, dims = unmerged(x.local, have, x.manager)  # each lead run moves alike
    for axis, d, a, b in zip(AXES, dims, (have.lat, have.lon), (g.lat, g.lon), strict=True):
        if a != b:  # the same on every rank: every rank of the axis group takes part
            t = axis_transport(x.manager, axis, local.device)
            local = repartition(local, a.sizes, b.sizes, d, group=t)
    local = merged_back(local, g, dims)
    return ShardedTensor(local, g.lat, g.dims[0], x.manager, grid=g)


def _one_layout(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """:func:`pointwise` for its commonest call: every argument a ShardedTensor of one layout
    (partition, dim, blocks, number of dims) or a Python number, the keyword arguments plain
    values (:func:`~mpidp.sharded.dispatch.fast_path`). Each band is then the
    argument as it is (no broadcast, no move, no random draw), so the function runs on the
    bands and its result takes their layout; anything else is :data:`NOT_LOCAL` (the general
    path). Costs a loop over the arguments instead of the general path's walks."""
    ref: ShardedTensor | None = None
    for a in args:
        if type(a) is ShardedTensor:
            if ref is None:
                ref = a
            elif (
                (a._spec is not ref._spec and a._spec != ref._spec)
                or a._dim != ref._dim
                or a._blocks != ref._blocks
                or a._local.dim() != ref._local.dim()
                or (a._grid is not ref._grid and a._grid != ref._grid)
            ):
                return NOT_LOCAL
        elif type(a) not in _NUMBERS:
            return NOT_LOCAL
    if ref is None:
        return NOT_LOCAL
    local = [a._local if type(a) is ShardedTensor else a for a in args]
    out = func(*local, **kwargs)
    if out is local[0] and type(args[0]) is ShardedTensor:
        return args[0]  # in place on the band
    if isinstance(out, torch.Tensor) and out.shape == ref._local.shape:
        return ref.same_layout(out)
    nd, dims = ref._local.dim(), tuple(c.dim for c in cuts(ref))
    if isinstance(out, torch.Tensor):
        return _wrap_out(out, nd, dims, ref)
    return tree_map(lambda o: _wrap_out(o, nd, dims, ref), out)


_NUMBERS = (int, float, bool, complex)


def _wrap_out(o: Any, ndim: int, dims: tuple[int, ...], ref: ShardedTensor) -> Any:
    """An element-wise result of ``ndim`` dims: ``ref``'s cuts at ``dims``."""
    if isinstance(o, torch.Tensor) and o.dim() == ndim:
        have = [o.size(d) for d in dims]
        want = [ref.local.size(c.dim) for c in cuts(ref)]
        if have != want:
            raise ConfigError(
                f"rank {ref.manager.rank}: internal error: an element-wise result of shape "
                f"{tuple(o.shape)} does not have this rank's {want} entries along dims "
                f"{list(dims)}"
            )
        return placed(ref, o, dims)
    return o


_UNBATCHED_DROPOUT = {(F.dropout1d, 2), (F.dropout3d, 4)}  # (C, spatial...) inputs


@register(F.dropout1d, F.dropout2d, F.dropout3d, F.feature_alpha_dropout, blocks=True)
def _channel_dropout(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Channel dropout draws one mask entry per (sample, channel) for the whole field: every
    rank draws it (torch's own function, on ones of the mask's shape: the same draw as the
    serial call) and domain rank 0's is broadcast, so every band drops the same channels.
    Identity when it is off. Collective over the domain group in training."""
    x = args[0]
    p = float(args[1] if len(args) > 1 else kwargs.get("p", 0.5))
    training = args[2] if len(args) > 2 else kwargs.get("training", True)
    if not training or p == 0:
        return x
    if func is F.feature_alpha_dropout:
        raise refuse(
            func, args, kwargs, "alpha dropout's affine correction per channel", "use dropout2d"
        )
    # torch's mask keeps (sample, channel), or the channel alone for an unbatched input
    keep = 1 if (func, x.dim()) in _UNBATCHED_DROPOUT else 2
    if x.shard_dim < keep:
        raise refuse(
            func, args, kwargs, "bands along the sample or channel dim", "shard along a spatial dim"
        )
    t = x.transport
    ones = x.local.new_ones(tuple(x.shape[:keep]) + (1,) * (x.dim() - keep))
    mask = func(ones, p, True)  # every rank draws (its generator stays in step), 0's is used
    mask = t.broadcast(mask.contiguous(), 0)
    return local_like(x, x.local * mask)


@register(F.prelu, torch.prelu, torch.Tensor.prelu, blocks=True, grid=True)
def _prelu(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """PReLU's weight runs along dim 1 (the channels), not right-aligned: bands or blocks cut
    along other dims use it whole; a cut of the channels is refused."""
    x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
    if not isinstance(x, ShardedTensor) or isinstance(weight, ShardedTensor):
        raise refuse(func, args, kwargs, "a sharded PReLU weight", "shard the input only")
    cut = x.grid.dims if x.grid is not None else (x.shard_dim,)
    if 1 in cut and weight.numel() > 1:
        raise refuse(func, args, kwargs, "bands along the channel dim", "shard along H")
    if isinstance(weight, Replicated):
        weight = copy_to(weight.as_subclass(torch.Tensor), x.transport)
    return local_like(x, func(x.local, weight))


# after the handler's registration (a later register() of one of them drops its fast path)
fast_path(_one_layout, POINTWISE - RANDOM - {torch.where, torch.Tensor.where}, pointwise)
