"""The batch rule: a function that does not read across a cut dim runs on each rank's part,
with no communication.

For every function it knows, :data:`READS` says which dims of its input the function reads
across (mixes entries of) or indexes by another argument (a weight's channels), from the
call's own arguments: a convolution reads its channels and spatial dims, so a band of windows
folded into the batch (dim 0) is a batch; a softmax reads its ``dim``; a layer norm its
normalised dims. When none of the input's cut dims (:func:`mpidp.sharded.cuts.cuts`: a band's
sharded dim, a latitude x longitude block's two) is among them, the function is applied to the
local part and the result keeps the input's layout (partition, blocks, grid), whatever layout
that is: one rule per cut axis, bands and blocks alike, consulted before the registry; the
functions that do read across a cut dim go on to their handlers (halos, reductions,
transposes) or are refused.

Other tensor arguments: weights (a plain tensor holds this rank's gradient share;
``sync_gradients`` sums them; a Replicated one enters through ``copy_to``); for the functions
whose other inputs are batched like the input (attention's key, value and mask), a
ShardedTensor of the same layout gives its part, and a plain tensor that broadcasts along a
cut dim (length 1, or right-aligned short of it) is used whole along it, one of the global
length cut to this rank's entries. Anything else leaves the call to its handler.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_unflatten

from mpidp.errors import MpidpError
from mpidp.ops.collectives import copy_to
from mpidp.runtime.rng import band_stream
from mpidp.sharded.cuts import Cut, cuts, part, placed, same_cuts
from mpidp.sharded.kept import Table
from mpidp.sharded.tensor import Replicated, ShardedTensor
from mpidp.sharded.walk import holds

__all__ = ["READS", "NOT_LOCAL", "batch_local", "reads"]

#: (dims read, dims the result drops) of the input, or None when the call does not say
Said = tuple[Collection[int], Collection[int]]
Rule = Callable[[tuple[Any, ...], dict[str, Any], int], Said | None]

#: (a Table: a change drops the kept rules, :mod:`mpidp.sharded.kept`)
READS: dict[Any, tuple[Rule, tuple[int, ...]]] = Table()
NOT_LOCAL = object()


def reads(*funcs: Any, batched: tuple[int, ...] = ()) -> Callable[[Rule], Rule]:
    """Decorator: ``rule(args, kwargs, ndim)`` gives the dims ``funcs`` read across (and the
    dims their result drops). ``batched``: positions of other arguments batched like the
    input (broadcast against it)."""

    def deco(rule: Rule) -> Rule:
        for f in funcs:
            READS[f] = (rule, batched)
        return rule

    return deco


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _dims(d: Any, nd: int) -> list[int]:
    return [int(i) % nd for i in (d if isinstance(d, list | tuple) else [d])]


def _last(n: int, nd: int) -> set[int]:
    return set(range(max(nd - n, 0), nd))


# -- the rules ------------------------------------------------------------------------------------


def _spatial_channels(n: int, transposed: bool) -> Rule:
    """Convolutions: the channels (a weight's) and the spatial dims the kernel spans (a dim
    with kernel 1, stride 1 and no padding maps each row to itself); batched input only."""
    names: tuple[str, ...] = ("weight", "bias", "stride", "padding")
    names += ("output_padding", "groups", "dilation") if transposed else ("dilation", "groups")

    def rule(a: tuple[Any, ...], k: dict[str, Any], nd: int) -> Any:
        if nd != n + 2:
            return None
        bound = dict(zip(names, a[1:], strict=False)) | k
        weight = bound.get("weight")
        if not isinstance(weight, torch.Tensor) or isinstance(bound.get("padding", 0), str):
            return set(range(1, nd)), ()

        def per_dim(v: Any, default: int) -> tuple[int, ...]:
            v = default if v is None else v
            return tuple(v) if isinstance(v, list | tuple) else (int(v),) * n

        stride, pad = per_dim(bound.get("stride"), 1), per_dim(bound.get("padding"), 0)
        out_pad = per_dim(bound.get("output_padding"), 0)
        kernel = tuple(weight.shape[2:])
        spanned = {
            nd - n + i
            for i in range(n)
            if (kernel[i], stride[i], pad[i], out_pad[i]) != (1, 1, 0, 0)
        }
        return {1} | spanned, ()

    return rule


def _spatial_only(n: int) -> Rule:
    """Pooling: the ``n`` spatial dims only (each channel pooled alone)."""
    return lambda a, k, nd: (_last(n, nd), ())


for _n, (_c, _t) in enumerate(
    [
        (F.conv1d, F.conv_transpose1d),
        (F.conv2d, F.conv_transpose2d),
        (F.conv3d, F.conv_transpose3d),
    ],
    start=1,
):
    reads(_c)(_spatial_channels(_n, False))
    reads(_t)(_spatial_channels(_n, True))
    for _f in (
        getattr(F, f"max_pool{_n}d"),
        getattr(F, f"avg_pool{_n}d"),
        getattr(F, f"lp_pool{_n}d", None),
        getattr(F, f"adaptive_max_pool{_n}d"),
        getattr(F, f"adaptive_avg_pool{_n}d"),
        getattr(F, f"max_pool{_n}d_with_indices"),
    ):
        if _f is not None:
            reads(_f)(_spatial_only(_n))


@reads(F.linear)
def _linear(a: tuple[Any, ...], k: dict[str, Any], nd: int) -> Any:
    return {nd - 1}, ()


@reads(F.layer_norm, *([F.rms_norm] if hasattr(F, "rms_norm") else []))
def _layer_norm(a: tuple[Any, ...], k: dict[str, Any], nd: int) -> Any:
    shape = _arg(a, k, 1, "normalized_shape", None)
    n = 1 if isinstance(shape, int) else len(shape)
    return _last(n, nd), ()


@reads(F.group_norm)
def _group_norm(a: tuple[Any, ...], k: dict[str, Any], nd: int) -> Any:
    return set(range(1, nd)), ()


@reads(F.instance_norm)
def _instance_norm(a: tuple[Any, ...], k: dict[str, Any], nd: int) -> Any:
    stats = _arg(a, k, 1, "running_mean", None) is not None
    using = _arg(a, k, 5, "use_input_stats", True)
    # running statistics updated from the batch read across it
    return None if stats and using else (set(range(1, nd)), ())


@reads(F.batch_norm)
def _batch_norm(a: tuple[Any, ...], k: dict[str, Any], nd: int) -> Any:
    training = _arg(a, k, 5, "training", False)
    return None if training else ({1}, ())  # eval: a per-channel affine map


@reads(F.normalize)
def _normalize(a: tuple[Any, ...], k: dict[str, Any], nd: int) -> Any:
    return set(_dims(_arg(a, k, 2, "dim", 1), nd)), ()


def _along(i: int, default: Any = None) -> Rule:
    """Functions of one dim (argument ``i``, named ``dim``) that keep the shape."""

    def rule(a: tuple[Any, ...], k: dict[str, Any], nd: int) -> Any:
        d = _arg(a, k, i, "dim", default)
        return None if d is None else (set(_dims(d, nd)), ())

    return rule


def _spaces(name: str) -> list[Any]:
    return [f for s in (torch, torch.Tensor, F) if (f := getattr(s, name, None)) is not None]


for _name in ("softmax", "log_softmax", "softmin", "cumsum", "cumprod", "logcumsumexp"):
    reads(*_spaces(_name))(_along(1))
for _name in ("sort", "argsort"):
    reads(*_spaces(_name))(_along(1, -1))
reads(*_spaces("topk"), *_spaces("kthvalue"))(_along(2, -1))


@reads(*_spaces("argmax"), *_spaces("argmin"))
def _argmax(a: tuple[Any, ...], k: dict[str, Any], nd: int) -> Any:
    d = _arg(a, k, 1, "dim", None)
    if d is None:
        return None
    keep = _arg(a, k, 2, "keepdim", False)
    dims = set(_dims(d, nd))
    return dims, (() if keep else dims)


@reads(*_spaces("flip"))
def _flip(a: tuple[Any, ...], k: dict[str, Any], nd: int) -> Any:
    dims = a[1:] if len(a) > 2 else _arg(a, k, 1, "dims", None)  # x.flip(0, 1) too
    return None if dims is None else (set(_dims(dims, nd)), ())


@reads(*_spaces("roll"))
def _roll(a: tuple[Any, ...], k: dict[str, Any], nd: int) -> Any:
    dims = _arg(a, k, 2, "dims", None)
    return None if dims is None else (set(_dims(dims, nd)), ())  # None: the flattened tensor


@reads(F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear)
def _interpolate(a: tuple[Any, ...], k: dict[str, Any], nd: int) -> Any:
    return set(range(2, nd)), ()


@reads(F.pad, torch._C._nn.pad)
def _pad(a: tuple[Any, ...], k: dict[str, Any], nd: int) -> Any:
    pad = _arg(a, k, 1, "pad", ())  # a dim padded by (0, 0) is not read (any mode)
    return {nd - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}, ()


@reads(F.pixel_shuffle, F.pixel_unshuffle)
def _shuffle(a: tuple[Any, ...], k: dict[str, Any], nd: int) -> Any:
    return _last(3, nd), ()


@reads(F.unfold)
def _unfold(a: tuple[Any, ...], k: dict[str, Any], nd: int) -> Any:
    return (set(range(1, nd)), ()) if nd == 4 else None


def _fft(default: Any, pos: int = 2) -> Rule:
    def rule(a: tuple[Any, ...], k: dict[str, Any], nd: int) -> Any:
        d = _arg(a, k, pos, "dim", default)
        if d is None:  # every dim, or the last len(s)
            s = _arg(a, k, 1, "s", None)
            return (set(range(nd)) if s is None else _last(len(s), nd)), ()
        return set(_dims(d, nd)), ()

    return rule


for _name in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft"):
    reads(getattr(torch.fft, _name))(_fft(-1))
for _name in ("fft2", "ifft2", "rfft2", "irfft2", "hfft2", "ihfft2"):
    reads(getattr(torch.fft, _name))(_fft((-2, -1)))
for _name in ("fftn", "ifftn", "rfftn", "irfftn", "hfftn", "ihfftn"):
    reads(getattr(torch.fft, _name))(_fft(None))


@reads(F.scaled_dot_product_attention, batched=(1, 2, 3))
def _sdpa(a: tuple[Any, ...], k: dict[str, Any], nd: int) -> Any:
    return _last(2, nd), ()


_SDPA_NAMES = {1: "key", 2: "value", 3: "attn_mask"}


# -- the local run --------------------------------------------------------------------------------


def batch_local(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func`` on each rank's part when the batch rule applies to the call (it reads across
    none of the input's cut dims: a band's one, a block's two), else :data:`NOT_LOCAL`."""
    found = READS.get(func)
    if found is None:
        return NOT_LOCAL
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, ShardedTensor):
        return NOT_LOCAL
    rule, batched = found
    said = rule(args, kwargs, x.dim())
    cs = cuts(x)
    if said is None or any(c.dim in said[0] for c in cs):
        return NOT_LOCAL
    drops = said[1]
    sizes = [x.local.size(c.dim) for c in cs]
    local_args = _local_args(x, cs, args, kwargs, batched, 0 in sizes)
    if local_args is None:
        return NOT_LOCAL
    draws = func is F.scaled_dot_product_attention and bool(_arg(args, kwargs, 4, "dropout_p", 0))
    with band_stream(
        x.rank, x.local.device, draws
    ):  # the generators stay in step (mpidp.runtime.rng)
        out = func(*local_args[0], **local_args[1])
    dims = tuple(c.dim - sum(1 for r in drops if r < c.dim) for c in cs)

    def wrap(o: Any) -> Any:
        if not isinstance(o, torch.Tensor):
            return o
        if 0 in sizes:  # ran on one zero entry along each empty cut (torch refuses some
            for d, n in zip(dims, sizes, strict=True):  # empty inputs): keep none
                o = o.narrow(d, 0, n) if n == 0 and o.dim() > d else o
        if o.dim() <= max(dims) or [o.size(d) for d in dims] != sizes:
            raise MpidpError(
                f"rank {x.rank}: internal error: {getattr(func, '__name__', func)} on the "
                f"local part {tuple(x.local.shape)} gave {tuple(o.shape)}, not {sizes} "
                f"entries along dims {list(dims)}; report it with the call"
            )
        return placed(x, o, dims)

    if isinstance(out, torch.Tensor):
        return wrap(out)
    leaves, tree = tree_flatten(out)
    return tree_unflatten([wrap(o) for o in leaves], tree)


def _local_args(
    x: ShardedTensor,
    cs: tuple[Cut, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    batched: tuple[int, ...],
    grow: bool,
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The call's arguments with each rank's part in place of the input (and of batched
    arguments), or None when an argument does not fit the rule. ``grow``: a part is empty
    along a cut; each gets one zero entry there (the caller drops its result's)."""
    names = {_SDPA_NAMES[i] for i in batched if i in _SDPA_NAMES}
    tails = [x.dim() - c.dim for c in cs]  # the cut dims, counted from the end

    def grown(local: torch.Tensor) -> torch.Tensor:
        if not grow:
            return local
        for tail in tails:
            at = local.dim() - tail
            if at >= 0 and local.size(at) == 0:
                row = local.new_zeros((*local.shape[:at], 1, *local.shape[at + 1 :]))
                local = torch.cat([local, row], at)
        return local

    def one(a: Any, is_batched: bool) -> Any:
        if a is x:
            return grown(x.local)
        if isinstance(a, ShardedTensor):
            return grown(a.local) if is_batched and same_cuts(a, x) else NOT_LOCAL
        if not isinstance(a, torch.Tensor):
            return a
        if not is_batched:  # a weight
            return copy_to(a.as_subclass(torch.Tensor), x.transport) if _is_rep(a) else a
        reaching = [(c, a.dim() - t) for c, t in zip(cs, tails, strict=True) if a.dim() >= t]
        reaching = [(c, i) for c, i in reaching if a.size(i) != 1]  # others broadcast
        if _is_rep(a):
            return NOT_LOCAL if reaching else copy_to(a.as_subclass(torch.Tensor), x.transport)
        for c, i in reaching:
            if a.size(i) != c.total:
                return NOT_LOCAL
            a = part(x, c, a, i)
        return grown(a) if reaching else a

    new_args = tuple(
        one(a, i in batched) if isinstance(a, torch.Tensor) else _deep(a, x)
        for i, a in enumerate(args)
    )
    new_kwargs = {
        k: one(v, k in names) if isinstance(v, torch.Tensor) else _deep(v, x)
        for k, v in kwargs.items()
    }
    if any(v is NOT_LOCAL for v in (*new_args, *new_kwargs.values())):
        return None
    return new_args, new_kwargs


def _is_rep(a: torch.Tensor) -> bool:
    return isinstance(a, Replicated)


def _deep(a: Any, x: ShardedTensor) -> Any:
    """A container argument holding a tensor does not fit the rule (one plain walk: the
    container is nearly always a tuple of numbers, a pad or a size)."""
    if isinstance(a, list | tuple | dict) and holds(a, torch.Tensor):
        return NOT_LOCAL
    return a
