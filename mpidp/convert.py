"""Turn an ordinary PyTorch model into its domain-parallel form, in place.

Every module that reads neighbouring rows or statistics over the field is replaced by its
domain-parallel wrapper, which subclasses it and shares its parameters and buffers (state_dict
keys unchanged). Pointwise and channel-wise modules are left as they are. Modules that would
silently compute something else on a band (attention over the full H, flattening, FFT blocks,
anything unknown) are refused with their paths, unless the user registers a converter for their
type or marks them safe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from mpidp import layers as L
from mpidp import models as M
from mpidp.errors import ConfigError
from mpidp.layers import spectral as S
from mpidp.layers.base import DomainParallel
from mpidp.manager import DistributedManager

__all__ = ["SAFE_MODULES", "convert_to_domain_parallel"]

Converter = Callable[[nn.Module, DistributedManager | None], nn.Module]

#: Module types that act on each position (or each channel) alone: exact on a band as they are.
SAFE_MODULES: tuple[type[nn.Module], ...] = (
    nn.Identity,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
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
)

#: Module types refused outright (their children would look harmless).
_UNSAFE: tuple[type[nn.Module], ...] = (
    nn.MultiheadAttention,
    nn.Transformer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
    nn.Flatten,
    nn.Unflatten,
    nn.PixelShuffle,
    nn.PixelUnshuffle,
    nn.Fold,
    nn.Unfold,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool3d,
)

# (torch type, wrapper), subclasses before their bases
_WRAPPERS: list[tuple[type[nn.Module], type[Any]]] = [
    (L.PeriodicConv2d, L.DomainParallelPeriodicConv2d),
    (nn.Conv1d, L.DomainParallelConv1d),
    (nn.Conv2d, L.DomainParallelConv2d),
    (nn.Conv3d, L.DomainParallelConv3d),
    (nn.ConvTranspose1d, L.DomainParallelConvTranspose1d),
    (nn.ConvTranspose2d, L.DomainParallelConvTranspose2d),
    (nn.ConvTranspose3d, L.DomainParallelConvTranspose3d),
    (nn.GroupNorm, L.DomainParallelGroupNorm),
    (nn.LayerNorm, L.DomainParallelLayerNorm),
    (nn.InstanceNorm2d, L.DomainParallelInstanceNorm2d),
    (nn.InstanceNorm3d, L.DomainParallelInstanceNorm3d),
    (nn.BatchNorm2d, L.DomainParallelBatchNorm2d),
    (nn.BatchNorm3d, L.DomainParallelBatchNorm3d),
    (nn.Upsample, L.DomainParallelInterpolate),
    (nn.MaxPool2d, L.DomainParallelMaxPool2d),
    (nn.AvgPool2d, L.DomainParallelAvgPool2d),
    (nn.AdaptiveAvgPool2d, L.DomainParallelAdaptiveAvgPool2d),
    (M.AFNOFilter, S.DomainParallelAFNOFilter),
    (M.SpectralConv2d, S.DomainParallelSpectralConv2d),
    (M.PositionEmbedding, S.DomainParallelPositionEmbedding),
    (M.PatchRecovery, S.DomainParallelPatchRecovery),
]


def _local_along(module: nn.Module, axis: int) -> bool:
    """A (transposed) convolution that maps each row to the same row along spatial ``axis``:
    kernel 1, stride 1, no padding (a 1x1 conv, or a conv along W only). Exact on a band."""
    if not isinstance(module, nn.modules.conv._ConvNd) or isinstance(module, L.PeriodicConv2d):
        return False
    pad = module.padding
    if isinstance(pad, str):
        return module.kernel_size[axis] == 1
    out_pad = getattr(module, "output_padding", (0,) * len(module.kernel_size))
    return (module.kernel_size[axis], module.stride[axis], pad[axis], out_pad[axis]) == (1, 1, 0, 0)


def _layer_norm_is_local(module: nn.Module, shard_dim: int) -> bool:
    return isinstance(module, nn.LayerNorm) and len(module.normalized_shape) < -shard_dim


def convert_to_domain_parallel(
    model: nn.Module,
    manager: DistributedManager | None = None,
    shard_dim: int = -2,
    custom_converters: dict[type, Converter] | None = None,
    safe: Iterable[type | str] = (),
) -> nn.Module:
    """Replace, in place, every module of ``model`` that needs rows or statistics from other
    ranks by its domain-parallel wrapper; return ``model``. A model that is itself one such
    layer (a bare ``nn.Conv2d``) cannot be replaced in place: its wrapper is returned, so
    always use the return value.

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
        they compute the same on a band.

    Raises ConfigError listing every module that cannot be converted (path, type, why), before
    anything is changed. Pure: no communication.
    """
    custom = dict(custom_converters or {})
    safe_types = tuple(s for s in safe if isinstance(s, type))
    safe_paths = {s for s in safe if isinstance(s, str)}
    plan: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, attribute, replacement)
    problems: list[str] = []

    def visit(module: nn.Module, path: str) -> None:
        for name, child in module.named_children():
            where = f"{path}.{name}" if path else name
            replacement = _convert(child, where)
            if replacement is not None and replacement is not child:
                plan.append((module, name, replacement))
            elif replacement is None:
                visit(child, where)

    def _convert(child: nn.Module, where: str) -> nn.Module | None:
        """The replacement, the child itself (leave, do not recurse) or None (recurse)."""
        for kind, fn in custom.items():
            if isinstance(child, kind):
                return fn(child, manager)
        if (
            where in safe_paths
            or isinstance(child, safe_types)
            or getattr(child, "_mpidp_safe", False)
        ):
            return child
        if isinstance(child, DomainParallel):
            return child
        if isinstance(child, _UNSAFE):
            problems.append(f"{where} ({type(child).__name__}): {_why(child)}")
            return child
        if isinstance(child, SAFE_MODULES) or _layer_norm_is_local(child, shard_dim):
            return child
        for kind, wrapper in _WRAPPERS:
            if isinstance(child, kind):
                return _wrap(child, kind, wrapper, where)
        if next(child.children(), None) is not None:
            return None  # a container or a user block: its children are converted
        problems.append(f"{where} ({type(child).__name__}): {_why(child)}")
        return child

    def _wrap(child: nn.Module, kind: type, wrapper: type[Any], where: str) -> nn.Module:
        n = len(getattr(child, "kernel_size", (0, 0)))
        axis_dim = -1 if kind in (nn.Conv1d, nn.ConvTranspose1d) else shard_dim
        if isinstance(child, nn.modules.conv._ConvNd) and _local_along(child, n + axis_dim):
            return child
        if isinstance(child, nn.Upsample) and child.mode not in ("nearest", "bilinear", "bicubic"):
            problems.append(f"{where} (Upsample mode {child.mode!r}): not supported on bands")
            return child
        return wrapper.from_module(child, manager, axis_dim)

    top = _convert(model, "(the model itself)")  # a bare layer: replaced as a whole
    if top is None:
        visit(model, "")
    if problems:
        raise ConfigError(
            f"convert_to_domain_parallel: {len(problems)} module(s) would compute something "
            f"else on a latitude band:\n  " + "\n  ".join(problems) + "\nfix: register a "
            "converter (custom_converters={Type: fn(module, manager)}) or, if the module is "
            "exact on a band, pass safe=[Type or 'path'] (or set module._mpidp_safe = True)"
        )
    for parent, name, replacement in plan:
        setattr(parent, name, replacement)
    return model if top is None else top


def _why(module: nn.Module) -> str:
    if isinstance(
        module,
        nn.MultiheadAttention
        | nn.Transformer
        | nn.TransformerEncoder
        | nn.TransformerDecoder
        | nn.TransformerEncoderLayer
        | nn.TransformerDecoderLayer,
    ):
        return "attention mixes every position of the field"
    if isinstance(module, nn.Flatten | nn.Unflatten):
        return "reshapes the spatial dims (a band is not a slice of the flattened field)"
    if isinstance(module, nn.PixelShuffle | nn.PixelUnshuffle | nn.Fold | nn.Unfold):
        return "moves rows between positions of the sharded dim"
    if isinstance(
        module, nn.modules.pooling._AdaptiveAvgPoolNd | nn.modules.pooling._AdaptiveMaxPoolNd
    ):
        return "adaptive pooling other than AdaptiveAvgPool2d to a global size"
    return "no domain-parallel form is known for this module type"
