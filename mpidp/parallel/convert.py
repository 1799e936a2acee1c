"""Turn an ordinary PyTorch model into its domain-parallel form, in place.

Every module that reads neighbouring rows or statistics over the field is replaced by its
domain-parallel wrapper, which subclasses it and shares its parameters and buffers (state_dict
keys unchanged). Pointwise and channel-wise modules are left as they are. A module mpidp does
not know is probed (:mod:`mpidp.parallel.probe`): left as it is when it is exact on any band,
refused when it mixes rows. Modules that would silently compute something else on a band (attention
over the full H, flattening, FFT blocks) are refused with their paths, unless the user
registers a converter for their type or vouches for them with ``safe=``.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from mpidp.errors import ConfigError
from mpidp.layers import base
from mpidp.layers.base import DomainParallel
from mpidp.layers.interpolate import MODES as INTERPOLATION_MODES
from mpidp.layers.periodic import PeriodicConv2d
from mpidp.layers.pool import ONE_D_POOLS
from mpidp.layers.registry import layer_for
from mpidp.parallel.probe import probe_band_locality
from mpidp.runtime.grid import blocks_refused
from mpidp.runtime.manager import DistributedManager, get_manager, is_initialized
from mpidp.sharded.modules import enter_module, leave_module

__all__ = ["SAFE_MODULES", "Verdict", "convert_to_domain_parallel", "explain_conversion"]

Converter = Callable[[nn.Module, DistributedManager | None], nn.Module]

#: Module types that act on each position (or each channel) alone: exact on a band as they are.
SAFE_MODULES: tuple[type[nn.Module], ...] = (
    nn.Identity,
    nn.Dropout,  # each entry alone (channel dropout draws one mask per channel: dispatch)
    nn.AlphaDropout,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Sigmoid,
    nn.Tanh,
    nn.Softplus,
    nn.Softsign,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.LogSigmoid,
    nn.Linear,  # over the last dim (channels-last, or W): never the sharded H
    nn.Bilinear,
    nn.Embedding,  # a table lookup at each index (time steps, land classes): no neighbour read
)

#: Of those, the ones that act on each point alone, along every dim: exact on a block as they
#: are (a Linear acts along the last dim, W of a field: cut on a grid of blocks)
_POINTWISE = tuple(t for t in SAFE_MODULES if t not in (nn.Linear, nn.Bilinear))

#: Module types refused outright (their children would look harmless).
_UNSAFE: tuple[type[nn.Module], ...] = (
    nn.Transformer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.Flatten,
    nn.Unflatten,
    nn.Fold,
    nn.Unfold,
)

#: Module types whose functional form dispatch computes exactly (one channel-dropout mask for
#: the whole field); probing them would see a random draw
_DISPATCHED: tuple[type[nn.Module], ...] = (
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.FeatureAlphaDropout,
)

#: 1-D layers (B, C, L): sharded along their length
_ONE_D: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.ConvTranspose1d,
    nn.ZeroPad1d,
    nn.ConstantPad1d,
    nn.ReflectionPad1d,
    nn.ReplicationPad1d,
    nn.CircularPad1d,
    *ONE_D_POOLS,
)


def _local_along(module: nn.Module, axis: int) -> bool:
    """A (transposed) convolution that maps each row to the same row along spatial ``axis``:
    kernel 1, stride 1, no padding (a 1x1 conv, or a conv along W only). Exact on a band."""
    if not isinstance(module, nn.modules.conv._ConvNd) or isinstance(module, PeriodicConv2d):
        return False
    if not 0 <= axis < len(module.kernel_size):
        return False
    pad = module.padding
    if isinstance(pad, str):
        return module.kernel_size[axis] == 1
    out_pad = getattr(module, "output_padding", (0,) * len(module.kernel_size))
    return (module.kernel_size[axis], module.stride[axis], pad[axis], out_pad[axis]) == (1, 1, 0, 0)


def _layer_norm_is_local(module: nn.Module, shard_dim: int) -> bool:
    return isinstance(module, nn.LayerNorm) and len(module.normalized_shape) < -shard_dim


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What conversion does with one module: ``action`` is ``"converted"`` (to ``into``),
    ``"left"`` (exact on a band as it is: known, probed local, or vouched for with ``safe=``)
    or ``"refused"``; ``why`` says how that was decided."""

    path: str
    kind: str
    action: str
    why: str
    into: str = ""

    def __str__(self) -> str:
        into = f" -> {self.into}" if self.into else ""
        return f"{self.path} ({self.kind}): {self.action}{into}; {self.why}"


def first_shapes(meta: nn.Module) -> tuple[dict[str, tuple], list[Any]]:
    """Hooks on every module of ``meta`` that record the input shape of its first call (what
    :func:`_seen_shapes` reads): the dict they fill and the hooks (remove them after)."""
    seen: dict[str, tuple] = {}
    hooks = []
    for path, module in meta.named_modules():

        def record(mod: nn.Module, args: tuple, path: str = path) -> None:
            if path not in seen and args and isinstance(args[0], torch.Tensor):
                seen[path] = tuple(args[0].shape)

        hooks.append(module.register_forward_pre_hook(record))
    return seen, hooks


#: a model and the first input shapes a caller's own meta forward of it recorded on the inputs
#: the conversion gets (the dry run's, mpidp.preflight.validate): :func:`_seen_shapes` reads
#: them for that model alone instead of copying it and running it once more
_SEEN: contextvars.ContextVar[tuple[nn.Module, dict[str, tuple]] | None] = contextvars.ContextVar(
    "mpidp_seen_shapes", default=None
)


@contextlib.contextmanager
def shapes_seen(model: nn.Module, seen: dict[str, tuple]) -> Iterator[None]:
    """Within it, a conversion of ``model`` takes ``seen`` (from :func:`first_shapes`, on a
    copy of it) as its shapes; a conversion of any other module runs its own forward."""
    token = _SEEN.set((model, seen))
    try:
        yield
    finally:
        _SEEN.reset(token)


def _seen_shapes(model: nn.Module, example_inputs: Sequence[Any] | None) -> dict[str, tuple]:
    """Input shape of every module's first call in one forward on meta tensors shaped like
    ``example_inputs`` (no memory, no data); empty when the model cannot run on meta."""
    if not example_inputs:
        return {}
    known = _SEEN.get()
    if known is not None and known[0] is model:
        return dict(known[1])
    meta = copy.deepcopy(model).to("meta")
    seen, hooks = first_shapes(meta)
    args = [
        torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t
        for t in example_inputs
    ]
    try:
        with base.torch_path(), torch.no_grad():
            meta(*args)
    except Exception:
        pass  # shapes seen before the failure are kept; the rest are guessed
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _plan(
    model: nn.Module,
    manager: DistributedManager | None,
    shard_dim: int,
    custom_converters: dict[type, Converter] | None,
    safe: Iterable[type | str],
    example_inputs: Sequence[Any] | None,
) -> tuple[list[tuple[nn.Module | None, str, nn.Module]], list[Verdict], list[tuple[Any, ...]]]:
    """Every module's verdict, the replacements (parent, attribute, new module; a parent of
    None replaces the model itself) and the modules that run on bands as they are (module,
    its sharded dim, whether its output partition is learned). Builds the wrappers but changes
    nothing."""
    custom = dict(custom_converters or {})
    safe = list(safe)
    safe_types = tuple(s for s in safe if isinstance(s, type))
    safe_paths = {s for s in safe if isinstance(s, str)}
    shapes = _seen_shapes(model, example_inputs)
    known = manager if manager is not None else (get_manager() if is_initialized() else None)
    # on blocks the dim after the sharded one (the longitude) is cut too: a module is local
    # only if it is local along both
    inner = shard_dim + 1 if known is not None and known._blocks else shard_dim
    plan: list[tuple[nn.Module | None, str, nn.Module]] = []
    verdicts: list[Verdict] = []
    bands: list[tuple[Any, ...]] = []

    def verdict(child: nn.Module, where: str, action: str, why: str, into: str = "") -> None:
        verdicts.append(Verdict(where, type(child).__name__, action, why, into))

    def visit(module: nn.Module, path: str, on_bands: bool) -> None:
        for name, child in module.named_children():
            where = f"{path}.{name}" if path else name
            replacement = _convert(child, where, on_bands)
            if replacement is not None and replacement is not child:
                plan.append((module, name, replacement))
            elif replacement is None:
                visit(child, where, on_bands or getattr(child, "_mpidp_band_forward", False))

    def op_by_op(child: nn.Module, where: str, on_bands: bool, why: str) -> nn.Module:
        """A module no band form is known for: inside a forward that runs on ShardedTensors
        it runs its own forward on them too (each torch call exact, or refused at the first
        call on every rank, naming the module path); inside a forward written for bands it
        would see plain bands, so it is refused."""
        if on_bands:
            verdict(child, where, "refused", why)
        else:
            verdict(child, where, "left", f"runs op by op on ShardedTensors ({why})")
        return child

    def _convert(child: nn.Module, where: str, on_bands: bool) -> nn.Module | None:
        """The replacement, the child itself (leave, do not recurse) or None (recurse)."""
        for kind, fn in custom.items():
            if isinstance(child, kind):
                new = fn(child, manager)
                verdict(child, where, "converted", "custom converter", type(new).__name__)
                if not isinstance(new, DomainParallel):
                    bands.append((new, ("at", shard_dim), True))
                return new
        if where in safe_paths or isinstance(child, safe_types):
            verdict(child, where, "left", "safe= (vouched for by the user)")
            bands.append((child, ("at", shard_dim), False))
            return child
        if getattr(child, "_mpidp_safe", False):
            verdict(child, where, "left", "marked _mpidp_safe")
            bands.append((child, ("before", 1), False))  # channel-wise (features last)
            return child
        if isinstance(child, DomainParallel):
            verdict(child, where, "left", "already domain-parallel")
            return child
        if isinstance(child, _DISPATCHED):
            return op_by_op(child, where, on_bands, "one mask per channel for the whole field")
        if isinstance(child, _UNSAFE):
            return op_by_op(child, where, on_bands, _why(child))
        if isinstance(child, SAFE_MODULES) or _layer_norm_is_local(child, inner):
            verdict(child, where, "left", "acts on each position alone")
            k = len(child.normalized_shape) if isinstance(child, nn.LayerNorm) else 1
            bands.append((child, ("before", k), False))
            return child
        layer = layer_for(type(child))
        if layer is not None:
            own = _own_computation(child, layer[0])
            if own is not None:  # the band layer computes the registered type's, not this
                return op_by_op(child, where, on_bands, own)
            return _wrap(child, layer[0], layer[1], where, on_bands)
        if next(child.children(), None) is not None:
            if getattr(child, "_mpidp_band_forward", False) and child is not model:
                bands.append((child, ("at", shard_dim), True))  # its forward is for bands
            return None  # a container or a user block: its children are converted
        probe_path = "" if where == "(the model itself)" else where
        found = probe_band_locality(child, shard_dim, shapes.get(probe_path))
        if found.local:
            verdict(child, where, "left", f"probed local: {found.detail}")
            bands.append((child, ("at", shard_dim), False))
        elif found.local is False:
            op_by_op(
                child,
                where,
                on_bands,
                f"probed: it mixes rows ({found.detail}); write its band form and pass "
                f"custom_converters={{{type(child).__name__}: fn(module, manager)}} "
                "(docs/layers.md: converters)",
            )
        else:
            op_by_op(
                child,
                where,
                on_bands,
                f"unknown, and the probe could not run it: {found.detail}; a converter, or "
                "safe=[type or path] if you know it is exact on a band",
            )
        return child

    def _wrap(
        child: nn.Module, kind: type, wrapper: type[Any], where: str, on_bands: bool
    ) -> nn.Module:
        axis_dim = -1 if issubclass(kind, _ONE_D) else shard_dim
        if isinstance(child, nn.modules.conv._ConvNd):
            n = len(child.kernel_size)
            cut = {n + axis_dim, n + inner} if axis_dim == shard_dim else {n + axis_dim}
            if all(_local_along(child, k) for k in cut):
                verdict(child, where, "left", "kernel 1 and stride 1 along the sharded dim")
                bands.append((child, ("at", axis_dim), False))
                return child
        if isinstance(child, nn.Upsample) and child.mode not in INTERPOLATION_MODES:
            why = f"Upsample mode {child.mode!r} has no band form"
            return op_by_op(child, where, on_bands, why)
        new = wrapper.from_module(child, manager, axis_dim)
        verdict(child, where, "converted", "its band form", type(new).__name__)
        return new

    on_bands = bool(getattr(model, "_mpidp_band_forward", False))
    top = _convert(model, "(the model itself)", on_bands)
    if top is None:
        visit(model, "", on_bands)
    elif top is not model:
        plan.append((None, "", top))
    return plan, verdicts, bands


def explain_conversion(
    model: nn.Module,
    manager: DistributedManager | None = None,
    shard_dim: int = -2,
    custom_converters: dict[type, Converter] | None = None,
    safe: Iterable[type | str] = (),
    example_inputs: Sequence[Any] | None = None,
) -> list[Verdict]:
    """What :func:`convert_to_domain_parallel` would do with every module of ``model``, one
    :class:`Verdict` each (converted, left as it is and why, or refused and why); nothing is
    changed. Local: no communication."""
    return _plan(model, manager, shard_dim, custom_converters, safe, example_inputs)[1]


def convert_to_domain_parallel(
    model: nn.Module,
    manager: DistributedManager | None = None,
    shard_dim: int = -2,
    custom_converters: dict[type, Converter] | None = None,
    safe: Iterable[type | str] = (),
    example_inputs: Sequence[Any] | None = None,
    input_dim: int | None = None,
) -> nn.Module:
    """Replace, in place, every module of ``model`` that needs rows or statistics from other
    ranks by its domain-parallel wrapper, and make the model run its own ``forward`` on
    ShardedTensors; return ``model``. A model that is itself one such layer (a bare
    ``nn.Conv2d``) cannot be replaced in place: its wrapper is returned, so always use the
    return value.

    The converted model takes this rank's bands and returns this rank's bands of the serial
    output (docs/layers.md, "What a converted model runs"): inside, each plain tensor
    argument with at least ``1 - input_dim`` dims is wrapped as a ShardedTensor cut along
    ``input_dim``, the user's unchanged ``forward`` runs on them (every torch call exact, or
    refused at the first call on every rank, naming the module path), and ShardedTensor
    results come back as plain bands on the manager's partition. Smaller tensors (a time
    embedding, a condition vector), ShardedTensors and Replicated values pass as they are;
    Replicated results (a global mean, a pooled vector) come back as they are, the same on
    every rank. A model whose ``forward`` is written for bands sets ``_mpidp_band_forward =
    True`` and keeps running on them.

    Parameters
    ----------
    manager:
        Whose domain group the layers use (None: the default manager, at each call).
    shard_dim:
        The sharded dim, counted from the end of 4-D/5-D activations (-2: H). Conv1d and
        ConvTranspose1d are sharded along their length.
    custom_converters:
        ``{type: fn(module, manager) -> module}``, checked first (``isinstance``); the module
        returned replaces the original and its children are not visited.
    safe:
        Types or module paths (``"encoder.attn"``) to leave as they are: the user vouches that
        they compute the same on a band (for what the probe cannot run).
    example_inputs:
        The model's inputs (global shapes; only their shapes and dtypes are used): the probe
        of an unknown module then runs on the shape it really receives.
    input_dim:
        The dim (from the end) the model's input bands are cut along; default: the one the
        model's first domain-parallel layer takes (-2, H of (B, C, H, W), for a convolution;
        -3, H of channels-last (B, H, W, C), for window attention and AFNO filters).

    A module mpidp does not know is probed (:func:`mpidp.parallel.probe.probe_band_locality`):
    left as it is when every band of its output equals its output on that band, refused otherwise.
    Raises ConfigError listing every refused module (path, type, why), before anything is
    changed. :func:`explain_conversion` lists every verdict. Local: no communication.
    """
    plan, verdicts, bands = _plan(
        model, manager, shard_dim, custom_converters, safe, example_inputs
    )
    if input_dim is None:
        first = next((new for new in _converted(plan) if isinstance(new, DomainParallel)), None)
        input_dim = first.input_band_dim() if first is not None else shard_dim
    refused = [v for v in verdicts if v.action == "refused"]
    if refused:
        m = manager if manager is not None else (get_manager() if is_initialized() else None)
        who = f"rank {m.rank}: " if m is not None else ""
        raise ConfigError(
            f"{who}convert_to_domain_parallel: {len(refused)} module(s) would compute something "
            f"else on a latitude band:\n  "
            + "\n  ".join(f"{v.path} ({v.kind}): {v.why}" for v in refused)
            + "\nfix: register a converter (custom_converters={Type: fn(module, manager)}); "
            "see docs/layers.md"
        )
    top = model
    for parent, name, replacement in plan:
        if parent is None:
            top = replacement
        else:
            setattr(parent, name, replacement)
    for module, dim, learn in bands:
        if module is not top:
            _adapt(module, "learn" if learn else "band", dim, manager)
    band_forward = getattr(model, "_mpidp_band_forward", False)
    if top is model and not band_forward and not any(module is model for module, _, _ in bands):
        _adapt(model, "model", input_dim, manager)
    _check_blocks(top, model, manager)
    return top


def _check_blocks(top: nn.Module, model: nn.Module, manager: DistributedManager | None) -> None:
    """On a grid of blocks, a module returned as it is (not wrapped, not converted) must act on
    each point alone: its caller hands it a block, whose W is cut too."""
    m = manager if manager is not None else (get_manager() if is_initialized() else None)
    if m is None or not m._blocks or top is not model or "_mpidp_band" in model.__dict__:
        return
    if isinstance(model, (DomainParallel, *_POINTWISE)):
        return
    if isinstance(model, nn.modules.conv._ConvNd):  # a 1x1 conv: each point alone
        n = len(model.kernel_size)
        if all(_local_along(model, k) for k in range(max(n - 2, 0), n)):
            return
    raise blocks_refused(m, f"{type(model).__name__}, left as it is by the conversion,")


def _converted(plan: list[tuple[nn.Module | None, str, nn.Module]]) -> list[nn.Module]:
    return [new for _, _, new in plan]


def _adapt(module: nn.Module, kind: str, dim: Any, manager: DistributedManager | None) -> None:
    """Hooks that give ``module`` the calling convention of ``kind`` (its class, parameters and
    state_dict keys unchanged): ``"model"`` runs the user's forward on ShardedTensors (plain
    bands in and out, ``dim`` the input bands' dim), ``"band"`` / ``"learn"`` gives a band
    module the bands of ShardedTensors cut as ``dim`` allows (``("at", d)``: along d;
    ``("before", k)``: along any dim but the last k; ``"learn"``: a user's band form, whose
    output partition is learned)."""
    for handle in module.__dict__.pop("_mpidp_hooks", ()):
        handle.remove()
    module.__dict__["_mpidp_band"] = (kind, dim, manager, [])
    module.__dict__["_mpidp_hooks"] = (
        module.register_forward_pre_hook(enter_module, with_kwargs=True, prepend=True),
        module.register_forward_hook(leave_module, with_kwargs=True, always_call=True),
    )


def _own_computation(module: nn.Module, kind: type[nn.Module]) -> str | None:
    """Why ``module``, an instance of a subclass of the registered type ``kind``, does not
    compute what ``kind`` computes (its band layer would silently drop the difference), or
    None: a class that overrides ``forward`` (a weight-standardised convolution, a scaled
    output), or parameters given by a parametrization (weight norm, spectral norm)."""
    if type(module).forward is not kind.forward:
        return f"{type(module).__name__} overrides {kind.__name__}.forward"
    if parametrize.is_parametrized(module):
        names = ", ".join(sorted(getattr(module, "parametrizations", {})))
        return f"its {names} given by a parametrization"
    return None


def _why(module: nn.Module) -> str:
    if isinstance(
        module,
        nn.Transformer
        | nn.TransformerEncoder
        | nn.TransformerDecoder
        | nn.TransformerEncoderLayer
        | nn.TransformerDecoderLayer,
    ):
        return "attention mixes every position of the field"
    if isinstance(module, nn.Flatten | nn.Unflatten):
        return "reshapes the spatial dims (a band is not a slice of the flattened field)"
    if isinstance(module, nn.Fold | nn.Unfold):
        return "moves rows between positions of the sharded dim"
    if isinstance(
        module, nn.modules.pooling._AdaptiveAvgPoolNd | nn.modules.pooling._AdaptiveMaxPoolNd
    ):
        return "adaptive pooling other than AdaptiveAvgPool2d to a global size"
    return "no domain-parallel form is known for this module type"
