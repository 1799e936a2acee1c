"""Modules on ShardedTensors: a converted layer is the kernel dispatch runs for its type, a
converted model runs its own ``forward`` on ShardedTensors.

Three entries, one rule each:

* :func:`run_layer`: a :class:`~mpidp.layers.base.DomainParallel` layer called with
  ShardedTensors runs on their bands with their partitions known (no all-gather to learn
  them) and its result is a ShardedTensor again. A layer that does not apply to the layout
  (it asks for the partition along a dim the band is not cut along: Conv2d fed windows folded
  into the batch) runs its torch form instead, whose functional calls dispatch op by op.
* :func:`enter_module` / :func:`leave_module`, the hooks conversion gives a model: it takes
  plain bands, wraps them as ShardedTensors, runs the user's unchanged ``forward`` and returns
  plain bands; and a module that computes on a band as it is (``safe=``, probed local) or a
  user's band form (``custom_converters``) gets the bands.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils._pytree import tree_unflatten as _unflatten

from mpidp.comm import Transport
from mpidp.errors import ConfigError, MpidpError
from mpidp.layers import base
from mpidp.layers.base import _SERVING, DomainParallel, LayoutMismatch, band_call, known_spec
from mpidp.ops.bands import _BANDS, _NOTES, _TORCH_PATH
from mpidp.ops.collectives import copy_to
from mpidp.runtime import rng
from mpidp.runtime.grid import BlockSpec, axis_transport, blocks_refused
from mpidp.runtime.manager import DistributedManager, bound
from mpidp.runtime.partition import _KNOWN, ShardSpec, known_for
from mpidp.sharded import where
from mpidp.sharded.block_layout import check_block
from mpidp.sharded.dispatch import _DEPTH, WATCHERS, UnsupportedOp, observed
from mpidp.sharded.kept import wrapped
from mpidp.sharded.layer_calls import spectrum_refused
from mpidp.sharded.partial import summed
from mpidp.sharded.tensor import Replicated, ShardedTensor, _RankZeroGrad, replicated

__all__ = ["enter_module", "leave_module", "run_layer", "torch_forward"]


def torch_forward(module: nn.Module) -> Callable[..., Any]:
    """The forward of the torch module a layer wraps (its first base that is not a layer)."""
    for kind in type(module).__mro__:
        if issubclass(kind, DomainParallel) or kind is object:
            continue
        forward = kind.__dict__.get("forward")
        if forward is not None:
            return getattr(forward, "__wrapped__", forward)
    raise MpidpError(f"{type(module).__name__} has no torch forward")


_NOTHING = contextlib.nullcontext()


def _unwrap(args: Any, ref: ShardedTensor) -> Any:
    """Bands for ShardedTensors; a Replicated value enters the band computation through
    ``copy_to`` over ``ref``'s transport (its gradient: every rank's share summed, whole
    again)."""
    if not args:
        return args
    if type(args) is tuple and all(type(a) is ShardedTensor for a in args):  # bands alone
        return tuple(a._local for a in args)

    def one(a: Any) -> Any:
        if isinstance(a, ShardedTensor):
            return a.local
        if isinstance(a, Replicated):
            plain = summed(a).as_subclass(torch.Tensor)
            return copy_to(plain, ref.transport) if plain.requires_grad else plain
        return a

    return tree_map(one, args)


@contextlib.contextmanager
def _known(sharded: list[ShardedTensor]) -> Iterator[list[Any]]:
    with contextlib.ExitStack() as stack:
        for a in sharded:
            stack.enter_context(known_spec(a.local, a.shard_dim, a.spec))
            if a.grid is not None:  # a block: its longitude's cut is known too
                stack.enter_context(known_spec(a.local, a.grid.dims[1], a.grid.lon))
        yield stack.enter_context(band_call(tuple((a.local, a.shard_dim) for a in sharded)))


@contextlib.contextmanager
def _whole_parameters(layer: nn.Module, t: Any) -> Iterator[None]:
    """Under the ``"whole"`` convention (:func:`mpidp.sharded.dispatch.whole_gradients`), the
    layer's parameters enter through ``copy_to`` for the call: their gradients are summed
    over the domain group in the backward. Nothing under mpidp's own convention, or inside a
    handler (whose caller's tensors are already summed)."""
    params = dict(layer.named_parameters()) if t.whole and not _DEPTH else {}
    # (inside a dispatched call of the "whole" convention, _DEPTH holds it: already summed)
    params = {k: p for k, p in params.items() if p.requires_grad and torch.is_grad_enabled()}
    if not params:
        yield
        return
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(layer, {k: copy_to(p, t) for k, p in params.items()}):
        yield


def _sharded(args: Any, kwargs: Any) -> list[ShardedTensor]:
    if not kwargs and all([type(a) is ShardedTensor for a in args]):  # bands alone: no walk
        return list(args)
    leaves, _ = tree_flatten((args, kwargs))
    return [a for a in leaves if isinstance(a, ShardedTensor)]


def run_layer(layer: Any, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``layer`` (a DomainParallel module) on ShardedTensor arguments, on their manager: a
    layer bound to None (and no other call in progress) takes it, a layer bound to another
    manager is refused unless that manager has the same ranks, grid and gradient convention
    (:func:`_serving`). Collective over the domain group, as the layer is.

    A call on one band of the layout the layer's plan was made for (:class:`_Plan`), by a
    layer on the band's manager, runs the layer on the band at once and wraps its output by
    the plan when the layer noted the same and returned the same shape (nearly every call of
    a converted model: one dict look-up and one tuple comparison instead of the walks)."""
    x: Any = args[0] if len(args) == 1 and not kwargs else None
    plan = _PLANS.get(weakref.ref(layer)) if type(x) is ShardedTensor and not WATCHERS else None
    if plan is not None and plan.layout == _layout(x):
        m = x._manager
        own = layer.own_manager()
        if own is None or own is m:
            token = _SERVING.set(m)  # (base.serve(m), without its object: per call)
            try:
                out, notes = _call(layer, forward, args, kwargs, [x], None)
                if notes is None:  # the torch form ran
                    return out
                if type(out) is torch.Tensor and out.shape == plan.shape and notes == plan.notes:
                    return wrapped(out, plan.whole, plan.spec, plan.dim, m)
                return _wrap_out(layer, out, notes, x, args, kwargs)
            finally:
                _SERVING.reset(token)
    ref = x if type(x) is ShardedTensor else _sharded(args, kwargs)[0]
    with base.serve(_serving(layer, ref)):
        return observed(layer, args, kwargs, lambda: _run_layer(layer, forward, args, kwargs))


def _serving(layer: Any, ref: ShardedTensor) -> DistributedManager:
    """The manager ``layer`` runs on for a call on ``ref``: the layer's own (bound, or the
    call in progress) when it agrees with ``ref``'s, ``ref``'s when the layer has none; a
    ConfigError naming both groups otherwise (the same on every rank of the group: never a
    collective over another group than the tensor's)."""
    own = layer.own_manager()
    m = ref._manager
    if own is None or own is m:
        return m
    a, b = bound(own), bound(m)  # the simulated rank's, both, in a dry run
    if a is b or (a.domain_ranks, a.grid, a.gradients) == (b.domain_ranks, b.grid, b.gradients):
        return a
    raise ConfigError(
        f"rank {b.rank}: {type(layer).__name__} runs on the domain group "
        f"{list(a.domain_ranks)} (grid {a.grid}, gradients {a.gradients!r}: its manager, or "
        f"the converted model's it is called in) but is called with a "
        f"ShardedTensor of the domain group {list(b.domain_ranks)} (grid {b.grid}, gradients "
        f"{b.gradients!r}); its collectives would run over another group than the tensor's. "
        f"Fix: shard the input over the layer's manager (mpidp.shard(x, manager=...)), or "
        f"convert the layer with the tensor's manager (its group or mesh)"
    )


class _Plan(NamedTuple):
    """What a converted layer's call on one band found, kept for the next call of the same
    layout (:func:`_layout`): the notes the layer made about its output, and the output's
    band shape and cut. A call that finds another layout, other notes or another output shape
    takes the general path, which checks the output (and raises) as ever. Made only under
    mpidp's own gradient convention (a manager's is fixed when it is made), so a planned
    call enters no parameter through ``copy_to``."""

    layout: tuple[Any, ...]
    notes: list[Any]
    shape: torch.Size
    spec: ShardSpec
    dim: int
    #: the output's global shape
    whole: torch.Size


#: per converted layer, the plan of its last single-band call; keyed by a weak reference
#: (equal to any other reference to the same layer), dropped with the layer
_PLANS: dict[weakref.ref[Any], _Plan] = {}


def _keep_plan(layer: Any, plan: _Plan) -> None:
    _PLANS[weakref.ref(layer, _drop_plan)] = plan


def _drop_plan(ref: weakref.ref[Any], plans: dict[Any, _Plan] = _PLANS) -> None:
    plans.pop(ref, None)  # (the dict bound here: a layer may die at the interpreter's exit)


def _layout(x: ShardedTensor) -> tuple[Any, ...] | None:
    """The facts a layer's call on the band of ``x`` depends on: the band's shape, dtype and
    device, its cut (partition sizes and dim), its manager; None for a layout without plans
    (blocks, merged blocks, a spectrum)."""
    if x._grid is not None or x._blocks != 1 or x._spectral:
        return None
    local = x._local
    # (a ShardSpec is its sizes: compared without the dataclass's Python __eq__)
    return (local.shape, local.dtype, local.device, x._spec.sizes, x._dim, x._manager)


def _call(
    layer: Any,
    forward: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    sharded: list,
    t: Transport | None,
) -> tuple[Any, list[Any] | None]:
    """``forward`` on the bands, with their partitions known: (its output, the notes the
    layer made), or (the torch form's output, None) when the layer does not apply to the
    layout (:class:`LayoutMismatch`). ``t``: the bands' transport under the ``"whole"``
    gradient convention (the parameters enter through ``copy_to``), else None."""
    whole = _whole_parameters(layer, t) if t is not None else _NOTHING
    a = sharded[0]
    try:
        if len(args) == 1 and args[0] is a and not kwargs and a._grid is None:  # one band
            local = a._local  # (nearly every call: no walk; known_spec and band_call's
            notes: list[Any] = []  # context variables set here, without their generators)
            known = _KNOWN.set(((local, a._dim, a._spec), *_KNOWN.get()))
            t_notes, t_bands = _NOTES.set(notes), _BANDS.set(((local, a._dim),))
            try:
                if whole is _NOTHING:
                    out = forward(layer, local)
                else:
                    with whole:
                        out = forward(layer, local)
            finally:
                _BANDS.reset(t_bands)
                _NOTES.reset(t_notes)
                _KNOWN.reset(known)
        else:
            with _known(sharded) as notes, whole:
                out = forward(layer, *_unwrap(args, a), **_unwrap(kwargs, a))
    except LayoutMismatch:
        return torch_forward(layer)(layer, *args, **kwargs), None
    except MpidpError as err:  # a layer's own error (too few rows): named where it happened
        located = where.relocated(err)
        if located is None:
            raise
        raise located from err
    return out, notes


def _run_layer(layer: Any, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    sharded = _sharded(args, kwargs)
    ref = sharded[0]
    if any(a.spectral for a in sharded):
        raise spectrum_refused(type(layer), args, kwargs)
    t = ref.transport
    if any(a.blocks > 1 or _merged_block(a) for a in sharded):  # merged before a cut: op by op
        return torch_forward(layer)(layer, *args, **kwargs)
    out, notes = _call(layer, forward, args, kwargs, sharded, t if t.whole else None)
    if notes is None:
        return out
    y = _wrap_out(layer, out, notes, ref, args, kwargs)
    layout = _layout(ref) if len(args) == 1 and not kwargs and args[0] is ref else None
    if layout is not None and type(y) is ShardedTensor and not t.whole:
        # the same layout next time: the checks above are the plan's (outputs of another
        # shape, or other notes, come back here)
        _keep_plan(layer, _Plan(layout, list(notes), y._local.shape, y._spec, y._dim, y._shape))
    return y


def _merged_block(a: ShardedTensor) -> bool:
    return isinstance(a._grid, BlockSpec) and a._grid.merged


def _wrap_out(
    layer: Any, out: Any, notes: list[Any], ref: ShardedTensor, args: tuple, kwargs: dict
) -> Any:
    """The layer's outputs as ShardedTensors (checked against the partition they claim) or
    Replicated values, by the notes it made."""
    if notes and notes[-1][0] == "replicated":
        t = ref.transport
        # the layer's backward sums every rank's share of its output's gradient; a Replicated
        # value holds the whole gradient on every rank: rank 0 gives it, the others zeros
        return tree_map(
            lambda o: replicated(_RankZeroGrad.apply(o, t.rank), t) if _plain(o) else o, out
        )
    if ref.grid is not None:
        return _blocks_out(layer, out, notes, ref)
    # a layer that cut its output by the policy (``_out_spec``) cut it along its own sharded
    # dim (a patch recovery: tokens in, pixels out); one that did not keeps the input's cut
    spec = notes[-1][1] if notes else ref.spec
    outs, tree = tree_flatten(out)
    dims = getattr(layer, "output_dims", None)
    if dims is not None:
        want = dims(args, kwargs, len(outs))
    else:
        want = [o.dim() + layer.shard_dim if notes and _plain(o) else ref.shard_dim for o in outs]
    wrapped = [
        _band(o, d, spec, ref, type(layer).__name__) if _plain(o) and d is not None else o
        for o, d in zip(outs, want, strict=True)
    ]
    return _unflatten(wrapped, tree)


def _blocks_out(layer: Any, out: Any, notes: list[Any], ref: ShardedTensor) -> Any:
    """A layer's outputs on blocks: cut along its sharded dim and the next by the output specs
    it noted per axis (``_out_spec``, latitude then longitude), or the input's blocks."""
    g = ref.grid
    assert g is not None
    m = ref.manager
    if getattr(layer, "output_dims", None) is not None:
        raise blocks_refused(m, f"the converted layer {type(layer).__name__} (output dims)")
    specs = [n[1] for n in notes if n[0] == "spec"]
    i_lat, i_lon = m.grid_coords

    def one(o: Any) -> Any:
        if not _plain(o) or o.dim() != ref.dim():
            return o
        d = o.dim() + layer.shard_dim if specs else g.dims[0]
        bs = BlockSpec(specs[-2], specs[-1], (d, d + 1)) if specs else g
        if (o.size(d), o.size(d + 1)) != (bs.lat.sizes[i_lat], bs.lon.sizes[i_lon]):
            raise MpidpError(
                f"rank {m.rank}: internal error: {type(layer).__name__} returned "
                f"{tuple(o.shape)} for a block of {bs!r}; report it with the model"
            )
        return ShardedTensor(o, bs.lat, d, m, grid=bs)

    return tree_map(one, out)


def _plain(o: Any) -> bool:
    return isinstance(o, torch.Tensor) and not isinstance(o, (ShardedTensor, Replicated))


def _band(o: torch.Tensor, d: int, spec: ShardSpec, ref: ShardedTensor, who: str) -> Any:
    m = ref._manager
    if spec.parts == 1 and o.dim() > d and o.size(d) != spec.total:
        spec = ShardSpec((o.size(d),))
    if o.dim() <= d or o.size(d) != spec.sizes[m.domain_rank]:
        raise MpidpError(
            f"rank {m.rank}: internal error: {who} returned {tuple(o.shape)} for a band of "
            f"{list(spec.sizes)} rows along dim {d}; report it with the model"
        )
    return ShardedTensor(o, spec, d, m)


def _band_outputs(out: Any, ref: ShardedTensor, learn: bool, who: str) -> Any:
    """A band module's tensor outputs of the input's rank as bands along its sharded dim: with
    ``learn`` their partition is learned (one all-gather of the lengths), else the input's."""
    if type(out) is torch.Tensor and out.dim() == ref._local.dim() and not learn:  # one band
        return _band(out, ref._dim, ref._spec, ref, who)
    outs, tree = tree_flatten(out)
    local = tuple(ref.local.shape)
    at = []
    for i, o in enumerate(outs):
        if not _plain(o):
            continue
        # the same rank, or the input's dims with more after (an embedding): cut alike
        if o.dim() == ref.dim() or (o.dim() > ref.dim() and tuple(o.shape[: ref.dim()]) == local):
            at.append(i)
        elif o.dim() > ref.shard_dim:
            raise UnsupportedOp(
                f"rank {ref.manager.rank}: {who} on a band of {tuple(ref.shape)} returned "
                f"{tuple(o.shape)}: mpidp cannot tell which of its dims is the band's; give "
                f"it a converter (custom_converters) or mark it with safe= only if its output "
                f"keeps the input's dims"
            )
    if learn and ref.spec.parts > 1:
        rows = ref.transport.all_gather_ints([outs[i].size(ref.shard_dim) for i in at])
        specs = [ShardSpec(tuple(r[j] for r in rows)) for j in range(len(at))]
    else:
        specs = [ref.spec] * len(at)
    for i, spec in zip(at, specs, strict=True):
        outs[i] = _band(outs[i], ref.shard_dim, spec, ref, who)
    return _unflatten(outs, tree)


def _wrap_bands(args: Any, kwargs: Any, shard_dim: int, m: DistributedManager) -> Any:
    """Every plain tensor argument whose sharded dim is not its first (``x.dim() >= 1 -
    shard_dim``) as the ShardedTensor of this rank's band (the partitions declared with
    :func:`~mpidp.runtime.partition.known_spec`, else learned in one all-gather); other
    arguments as they are."""
    # (list comprehensions, not generators, and no _plain(): per call of the model)
    plain = not kwargs and all([type(a) is torch.Tensor for a in args])  # (the commonest call)
    leaves, tree = (list(args), None) if plain else tree_flatten((args, kwargs))
    low = max(1 - shard_dim, 1)
    at = [i for i, a in enumerate(leaves) if (plain or _plain(a)) and a.dim() >= low]
    if at:
        dims = [leaves[i].dim() + shard_dim for i in at]
        known = [known_for(leaves[i], d) for i, d in zip(at, dims, strict=True)]
        if all([spec is not None for spec in known]):  # declared (partition.known_spec)
            specs = known
        elif m.domain_world_size > 1:
            t = m.transport(None, leaves[at[0]].device)
            rows = t.all_gather_ints([leaves[i].size(d) for i, d in zip(at, dims, strict=True)])
            specs = [_spec(tuple([r[j] for r in rows])) for j in range(len(at))]
        else:
            specs = [_spec((leaves[i].size(d),)) for i, d in zip(at, dims, strict=True)]
        for i, d, spec in zip(at, dims, specs, strict=True):
            leaves[i] = ShardedTensor(leaves[i], spec, d, m)
    return (tuple(leaves), kwargs) if tree is None else _unflatten(leaves, tree)


#: the ShardSpec of each extents' tuple (frozen: one object serves every call), so that the
#: next call's bands carry the very spec the plans hold (compared by identity, no __eq__)
_spec = functools.lru_cache(maxsize=1024)(ShardSpec)


def _wrap_blocks(args: Any, kwargs: Any, shard_dim: int, m: DistributedManager) -> Any:
    """:func:`_wrap_bands` on a grid of blocks: every plain tensor argument with the dims
    ``shard_dim`` (the latitude) and the one after it (the longitude) as the ShardedTensor of
    this rank's block (the cuts declared with :func:`~mpidp.runtime.partition.known_spec` along
    both dims, else learned in one all-gather along each axis group)."""
    if shard_dim > -2:
        raise blocks_refused(m, f"a converted model cut along dim {shard_dim} (its last)")
    leaves, tree = tree_flatten((args, kwargs))
    at = [i for i, a in enumerate(leaves) if _plain(a) and a.dim() >= max(-shard_dim, 2)]
    dims = [(leaves[i].dim() + shard_dim, leaves[i].dim() + shard_dim + 1) for i in at]
    pairs = zip(at, dims, strict=True)
    known = [(known_for(leaves[i], d0), known_for(leaves[i], d1)) for i, (d0, d1) in pairs]
    if at and not all(a is not None and b is not None for a, b in known):
        device = leaves[at[0]].device
        for k, axis in enumerate(("lat", "lon")):
            t = axis_transport(m, axis, device)
            rows = t.all_gather_ints([leaves[i].size(d[k]) for i, d in zip(at, dims, strict=True)])
            learned = [ShardSpec(tuple(r[j] for r in rows)) for j in range(len(at))]
            known = [
                (s, kn[1]) if k == 0 else (kn[0], s) for s, kn in zip(learned, known, strict=True)
            ]
    for i, d, (lat, lon) in zip(at, dims, known, strict=True):
        assert lat is not None and lon is not None  # declared, or learned above
        bs = BlockSpec(lat, lon, d)
        check_block(bs, m, "the converted model's input", leaves[i])
        leaves[i] = ShardedTensor(leaves[i], lat, d[0], m, grid=bs)
    return _unflatten(leaves, tree)


def _to_band(o: Any, inputs: list[Any]) -> Any:
    """A result's band: on an input's cut when it has one (a model that keeps its input's
    partition returns it so), else on the manager's partition of its length."""
    if not isinstance(o, ShardedTensor):
        return o
    m = o._manager  # (the wrapper's fields: each of its properties is a Python call)
    g = o._grid
    if g is not None:  # a block: on an input's blocks or the policy's, else refused
        want = tuple(m.partition.derived(n, p) for n, p in zip(g.shape, m.grid, strict=True))
        if g in inputs or (g.lat, g.lon) == want:
            return o.local
        raise ConfigError(
            f"rank {m.rank}: the converted model returned blocks {g!r}, neither an input's nor "
            f"the partition policy's {[list(s.sizes) for s in want]}: blocks are not moved; "
            f"return the result on the policy's blocks (or call .full_tensor())"
        )
    if o._spec in inputs:
        return o._local
    spec = m.partition.derived(o.spec.total, m.domain_world_size)
    return (o.redistribute(spec=spec) if spec != o.spec else o).local


def _fits(d: int, rule: tuple[str, int]) -> bool:
    """Whether a band cut along ``d`` (from the end) is one the module computes on as it is:
    ``("at", k)``: only along k; ``("before", k)``: along any dim but the last k."""
    return d == rule[1] if rule[0] == "at" else d < -rule[1]


def _check_rng(m: DistributedManager, args: Any, kwargs: Any) -> None:
    """In training, the domain ranks' generators must be in step (mpidp.runtime.rng): one small
    all-gather per call. Collective over the domain group."""
    leaves, _ = tree_flatten((args, kwargs))
    device = next((a.device for a in leaves if isinstance(a, torch.Tensor)), None)
    t = m.transport(None, device if device is not None else "cpu")
    prints = [row[0] for row in t.all_gather_ints([rng.fingerprint(device)])]
    rng.check_in_step(prints, m.rank, "a converted model's forward")


def enter_module(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Forward pre-hook of a converted module (``module._mpidp_band``: kind, sharded dim,
    manager, the calls in progress).

    ``"model"``: the model :func:`mpidp.convert_to_domain_parallel` returns. Plain bands become
    ShardedTensors and the user's unchanged ``forward`` runs on them; :func:`leave_module`
    returns band results as this rank's plain band on the manager's partition and Replicated
    results (a global mean, a pooled vector) as they are, the same on every rank.
    ShardedTensor, Replicated and smaller tensors (a time embedding, a condition vector) pass
    as they are. Collective over the domain group.

    ``"band"`` / ``"learn"``: a module that computes on bands as it is (``safe=``, probed
    local: each output row from its own input row) or a user's band form
    (``custom_converters``) gets the bands of ShardedTensors cut along its dim; cut along
    another dim, its forward runs on them through dispatch."""
    kind, dim, manager, calls = module.__dict__["_mpidp_band"]
    if kind == "model":
        if _TORCH_PATH.get():  # (base.in_torch_path())
            calls.append(None)
            return None
        given = _sharded(args, kwargs) if manager is None else []
        m = base.serving(given[0]._manager if given else manager)
        if m.domain_world_size > 1 and module.training and rng.draws(module):
            _check_rng(m, args, kwargs)
        if m._blocks:
            args, kwargs = _wrap_blocks(args, kwargs, dim, m)
        else:
            args, kwargs = _wrap_bands(args, kwargs, dim, m)
        specs = [a._grid or a._spec for a in _sharded(args, kwargs)]
        if not specs and m.domain_world_size > 1:  # the forward would run on bands as if whole
            raise ConfigError(
                f"rank {m.rank}: the converted {type(module).__name__} got no argument it can "
                f"cut into bands: a plain tensor needs at least {max(1 - dim, 1)} dims to be "
                f"cut along dim {dim} (smaller ones pass as they are, e.g. (N, C) node "
                f"features); fix: pass ShardedTensors (mpidp.shard(x, dim)), or bands with a "
                f"batch dim ((1, N, C) with input_dim=-2)"
            )
        # on the stack for a refusal's message, and its layers bound to None on m, whatever
        # the default (base.serve(m), without its object: per call)
        calls.append(("model", where.enter(module), specs, _SERVING.set(m)))
        return args, kwargs
    x = args[0] if len(args) == 1 and not kwargs else None
    if type(x) is ShardedTensor and x._grid is None and x._blocks == 1:  # one band (per call:
        local = x._local  # no walk)
        if _fits(x._dim - local.dim(), dim) and local.size(x._dim):
            calls.append(("band", x, False))
            return (local,), kwargs
    sharded = _sharded(args, kwargs)
    if any(a._grid is not None for a in sharded):  # blocks: the module's own forward, dispatched
        calls.append(None)
        return None
    # (the wrapper's own fields: each of its properties is a Python call)
    if not sharded or not all(
        _fits(a._dim - a._local.dim(), dim) and a._blocks == 1 for a in sharded
    ):
        calls.append(None)
        return None
    ref = sharded[0]
    empty = ref._local.size(ref._dim) == 0
    calls.append(("band", ref, empty))
    args, kwargs = _unwrap(args, ref), _unwrap(kwargs, ref)
    if empty:  # torch refuses some zero-row inputs (a 1x1 conv): one zero row, dropped after
        args, kwargs = tree_map(lambda a: _one_row(a, ref), (args, kwargs))
    return args, kwargs


def _one_row(a: Any, ref: ShardedTensor) -> Any:
    """An empty band's tensor of the band's rank with one zero row along the band's dim: a
    module computing row by row then runs (its graph reaching its parameters: zero gradients,
    the same backward on every rank) and the row is dropped from its outputs."""
    if _plain(a) and a.dim() == ref.dim() and a.size(ref.shard_dim) == 0:
        return base.with_rows(a, ref.shard_dim, 1)
    return a


def leave_module(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
    """Forward hook of a converted module: see :func:`enter_module` (runs after an exception
    too, to close the call)."""
    kind, _, _, calls = module.__dict__["_mpidp_band"]
    call = calls.pop() if calls else None
    if call is None:
        return None
    if call[0] == "model":
        _SERVING.reset(call[3])
        where.leave(call[1])
        if type(out) is ShardedTensor:  # (the commonest result: no walk)
            return _to_band(out, call[2])
        return tree_map(lambda o: _to_band(o, call[2]), out)
    ref, empty = call[1], call[2]
    if kind == "band" and type(out) is torch.Tensor:
        local, d = ref._local, ref._dim
        if out.shape == local.shape or (
            not ref._spectral and out.dim() == local.dim() and out.size(d) == local.size(d)
        ):  # the band's shape, or its rows with other channels (a 1x1 convolution): its cut,
            # as _band_outputs finds, without the walk
            return ref.same_layout(out)
    if empty:  # the zero row enter_module added: dropped from every output of the band's rank
        d = ref.shard_dim
        out = tree_map(
            lambda o: o.narrow(d, 0, 0) if _plain(o) and o.dim() >= ref.dim() else o, out
        )
    return _band_outputs(out, ref, kind == "learn", type(module).__name__)


def install() -> None:
    """Route DomainParallel layers called with ShardedTensors through :func:`run_layer`."""
    if not base.SHARDED_CALL:
        base.SHARDED_CALL.append(run_layer)
        base.SHARDED_TYPES.append(ShardedTensor)
