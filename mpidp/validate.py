"""A dry run of a model's sharding by shape arithmetic, before any data moves.

The model runs once on a meta tensor of the global shape (no memory, no communication: every
domain-parallel layer takes its torch path), with hooks that record each spatial layer's input
and output extent along the sharded dim. From those, per layer: the rows every rank owns in and
out, the halo rows each rank fetches, and the problems that would stop (or silently distort) a
run at this domain size.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mpidp.convert import convert_to_domain_parallel
from mpidp.errors import ConfigError
from mpidp.geometry import HaloSpec, input_ranges, padding_pair
from mpidp.layers import base
from mpidp.layers.interpolate import _ONE_DIM, MODES, _per_dim, _taps, read_halo
from mpidp.layers.pad import PAD_TYPES, _mode
from mpidp.layers.periodic import PeriodicConv2d
from mpidp.layers.pool import _window_ranges
from mpidp.manager import DistributedManager, get_manager
from mpidp.models import AFNOFilter, PatchRecovery, PositionEmbedding, SpectralConv2d
from mpidp.partition import PartitionPolicy, ShardSpec

__all__ = ["LayerSharding", "ShardingReport", "validate_sharding_constraints"]

_SPATIAL: tuple[type[nn.Module], ...] = (
    nn.modules.conv._ConvNd,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.modules.batchnorm._BatchNorm,
    nn.Upsample,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
    *PAD_TYPES,
    nn.PixelShuffle,
    nn.PixelUnshuffle,
    AFNOFilter,
    SpectralConv2d,
    PositionEmbedding,
    PatchRecovery,
)

#: channels-last modules: the sharded H is dim 1 of their (B, h, w, C) input
_CHANNELS_LAST_IN = (AFNOFilter, PositionEmbedding, PatchRecovery)


@dataclasses.dataclass(frozen=True)
class LayerSharding:
    """One spatial layer: its path and type, rows in and out per rank, halo widths per rank."""

    path: str
    kind: str
    rows_in: tuple[int, ...]
    rows_out: tuple[int, ...]
    halo_before: tuple[int, ...]
    halo_after: tuple[int, ...]
    #: what fills rows beyond the field (a :class:`~mpidp.Boundary` kind; "none": never read)
    boundary: str = "none"
    #: the layer's global input and output shapes in the dry run
    shape_in: tuple[int, ...] = ()
    shape_out: tuple[int, ...] = ()
    #: the sharded dim of the input and of the output (counted from the end)
    dim_in: int = -2
    dim_out: int = -2
    #: a spectral layer (rfft2 and irfft2 through mpidp.fft): its W modes per rank
    modes: tuple[int, ...] = ()

    @property
    def halo_rows(self) -> int:
        """Rows fetched from other ranks or the boundary, summed over ranks."""
        return sum(
            max(0, b) + max(0, a) for b, a in zip(self.halo_before, self.halo_after, strict=True)
        )


@dataclasses.dataclass(frozen=True)
class ShardingReport:
    """What :func:`validate_sharding_constraints` found; ``ok`` when there are no problems."""

    parts: int
    layers: tuple[LayerSharding, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        lines = [f"{'layer':<28}{'kind':<22}{'rows in':<22}{'rows out':<22}halo (before/after)"]
        for layer in self.layers:
            halo = ",".join(
                f"{b}/{a}" for b, a in zip(layer.halo_before, layer.halo_after, strict=True)
            )
            lines.append(
                f"{layer.path:<28}{layer.kind:<22}{_rows(layer.rows_in):<22}"
                f"{_rows(layer.rows_out):<22}{halo}"
            )
        lines += [f"problem: {p}" for p in self.problems] or ["no problems"]
        return "\n".join(lines)


def _rows(sizes: Sequence[int]) -> str:
    return ",".join(map(str, sizes))


def _geometry(module: nn.Module, k: int) -> tuple[int, int, tuple[int, int], int] | None:
    """(kernel, stride, padding pair, dilation) along spatial axis ``k``, for window layers."""
    if isinstance(module, PeriodicConv2d):
        p = module.periodic_padding[0]
        return module.kernel_size[0], module.stride[0], (p, p), module.dilation[0]
    if isinstance(module, nn.modules.conv._ConvNd) and not module.transposed:
        ks, dil = module.kernel_size[k], module.dilation[k]
        pad = module.padding
        pair = padding_pair(pad, ks, 1, dil) if isinstance(pad, str) else (pad[k], pad[k])
        return ks, module.stride[k], pair, dil
    if isinstance(module, nn.modules.pooling._MaxPoolNd | nn.modules.pooling._AvgPoolNd):

        def at(v: object) -> int:
            return v if isinstance(v, int) else v[k]  # type: ignore[index]

        dil = at(getattr(module, "dilation", 1))
        p = at(module.padding)
        return at(module.kernel_size), at(module.stride or module.kernel_size), (p, p), dil
    if isinstance(module, PAD_TYPES):
        pads: tuple[int, ...] = tuple(module.padding)  # type: ignore[arg-type]
        at_k = 2 * (len(pads) // 2 - 1 - k)  # F.pad order: last dim first
        return 1, 1, (pads[at_k], pads[at_k + 1]), 1
    return None


_MODES = {"zeros": "zeros", "reflect": "reflect", "replicate": "replicate", "circular": "circular"}


def _window_halo(
    module: nn.Module, spec_in: ShardSpec, spec_out: ShardSpec, k: int, n_in: int, n_spatial: int
) -> tuple[tuple[int, ...], tuple[int, ...], str] | None:
    """(before, after, boundary) of the rows a layer fetches along spatial axis ``k``, for the
    layers whose domain-parallel forward fetches rows; None for the others."""
    if isinstance(module, nn.modules.conv._ConvNd) and module.transposed:
        pad = module.padding[k]
        assert isinstance(pad, int)
        ranges = input_ranges(
            spec_in,
            spec_out,
            module.kernel_size[k],
            module.stride[k],
            pad,
            module.dilation[k],
            transposed=True,
            output_padding=module.output_padding[k],
        )
        halo = HaloSpec.from_ranges(spec_in, ranges)
        return halo.before, halo.after, "none"
    if isinstance(module, nn.Upsample) and module.mode in MODES:
        n = n_spatial
        size = _per_dim(module.size, n, "size")[k]
        scale = _per_dim(module.scale_factor, n, "scale_factor")[k]
        mode = _ONE_DIM[module.mode]
        index, weight = _taps(n_in, size, scale, mode, module.align_corners, torch.float64)
        _, halo = read_halo(index, weight, spec_in, spec_out)
        return halo.before, halo.after, "none"
    geo = _geometry(module, k)
    if geo is None:
        return None
    if isinstance(module, nn.modules.pooling._MaxPoolNd | nn.modules.pooling._AvgPoolNd):
        # windows past the end (ceil_mode) included; rows beyond the field are the pool's own
        ranges = _window_ranges(spec_in, spec_out, geo[0], geo[1], geo[2][0], geo[3])
        h = spec_in.total
        inside = [(min(max(lo, 0), h), max(min(hi, h), min(max(lo, 0), h))) for lo, hi in ranges]
        halo = HaloSpec.from_ranges(spec_in, inside)
        return halo.before, halo.after, "none"
    halo = HaloSpec.for_layer(spec_in, spec_out, geo[0], geo[1], geo[2], geo[3])
    if isinstance(module, PeriodicConv2d):
        kind = module.pole
    elif isinstance(module, PAD_TYPES):
        kind = _mode(module)[1]
    else:
        kind = _MODES.get(getattr(module, "padding_mode", "zeros"), "zeros")
    return halo.before, halo.after, kind


def _meta_inputs(
    global_shape: Sequence[int] | None,
    example_inputs: Sequence[Any] | None,
    dtype: torch.dtype,
) -> list[Any]:
    """Meta tensors shaped like the inputs: ``example_inputs`` (tensors or shapes; anything
    else passed as it is) or one input of ``global_shape``."""
    if example_inputs is None:
        if global_shape is None:
            raise ConfigError("validate_sharding_constraints: pass global_shape or example_inputs")
        example_inputs = [tuple(global_shape)]
    out: list[Any] = []
    for item in example_inputs:
        if isinstance(item, torch.Tensor):
            out.append(torch.empty(item.shape, dtype=item.dtype, device="meta"))
        elif isinstance(item, Sequence) and all(isinstance(v, int) for v in item):
            out.append(torch.empty(tuple(item), dtype=dtype, device="meta"))
        else:
            out.append(item)
    return out


def validate_sharding_constraints(
    model: nn.Module,
    global_shape: Sequence[int] | None = None,
    manager: DistributedManager | None = None,
    *,
    parts: int | None = None,
    partition: PartitionPolicy | None = None,
    shard_dim: int = -2,
    example_inputs: Sequence[Any] | None = None,
) -> ShardingReport:
    """Check, by shape arithmetic, how ``model`` (serial or converted) shards an input of
    ``global_shape`` over ``parts`` domain ranks (default: the manager's domain size) cut by
    ``partition`` (default: the manager's policy). ``example_inputs`` instead: every input of a
    model whose ``forward`` takes several (tensors or shapes, global; 4-D and 5-D), also what
    the probe of unknown modules runs on. Local: no communication, no data."""
    if parts is None or partition is None:
        m = manager or get_manager()
        parts = parts if parts is not None else m.domain_world_size
        partition = partition if partition is not None else m.partition
    seen: list[tuple[str, nn.Module, torch.Size, torch.Size]] = []
    meta = copy.deepcopy(model).to("meta")
    first = next(iter(meta.parameters()), None)
    inputs = _meta_inputs(
        global_shape, example_inputs, first.dtype if first is not None else torch.float32
    )
    hooks = []
    for path, module in meta.named_modules():
        if isinstance(module, _SPATIAL):

            def record(mod: nn.Module, args: tuple, out: torch.Tensor, path: str = path) -> None:
                seen.append((path, mod, args[0].shape, out.shape))

            hooks.append(module.register_forward_hook(record))
    problems: list[str] = []
    try:  # what conversion would refuse (pure: nothing moves)
        convert_to_domain_parallel(copy.deepcopy(model), shard_dim=shard_dim, example_inputs=inputs)
    except ConfigError as err:
        problems.append(str(err))
    with base.torch_path():
        try:
            meta(*inputs)
        except Exception as err:  # the serial model itself rejects the shapes
            shapes = ", ".join(str(tuple(t.shape)) for t in inputs if isinstance(t, torch.Tensor))
            problems.append(f"the model does not run on {shapes}: {err}")
        finally:
            for hook in hooks:
                hook.remove()
    layers = []
    for path, module, shape_in, shape_out in seen:
        dim_in = shard_dim - 1 if isinstance(module, _CHANNELS_LAST_IN) else shard_dim
        dim_out = shard_dim if isinstance(module, PatchRecovery) else dim_in
        d = len(shape_in) + dim_in
        h_in, h_out = shape_in[d], shape_out[len(shape_out) + dim_out]
        kind = type(module).__name__
        adaptive = (nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd)
        try:
            spec_in = partition.spec(h_in, parts)
            if isinstance(module, adaptive) and h_out < parts:
                # fewer output rows than ranks: the whole result, replicated on every rank
                layers.append(
                    LayerSharding(
                        path,
                        kind,
                        spec_in.sizes,
                        (h_out,) * parts,
                        (0,) * parts,
                        (0,) * parts,
                        "replicated",
                        tuple(shape_in),
                        tuple(shape_out),
                        dim_in,
                        dim_out,
                    )
                )
                continue
            spec_out = partition.spec(h_out, parts)
        except Exception as err:
            problems.append(f"{path} ({kind}): {err}")
            continue
        k = d - 2
        geo = _geometry(module, k) if k >= 0 else None
        if geo is not None:
            mode = getattr(module, "padding_mode", getattr(module, "pole", "zeros"))
            if mode in ("reflect", "polar") and max(geo[2]) >= h_in:
                problems.append(f"{path} ({kind}): reflect padding {max(geo[2])} >= {h_in} rows")
            if getattr(module, "pole", "").startswith("polar") and shape_in[-1] % 2:
                problems.append(
                    f"{path} ({kind}): polar padding needs an even W, got {shape_in[-1]}"
                )
        n_spatial = len(shape_in) - 2
        halo = _window_halo(module, spec_in, spec_out, k, h_in, n_spatial) if k >= 0 else None
        before, after, boundary = halo or ((0,) * parts, (0,) * parts, "none")
        modes: tuple[int, ...] = ()
        if isinstance(module, AFNOFilter | SpectralConv2d):
            k_modes = shape_in[module.fft_dims[1]] // 2 + 1
            cut = ShardSpec.balanced(k_modes, parts, allow_empty=True)
            modes = (cut if k_modes < parts else partition.spec(k_modes, parts)).sizes
        layers.append(
            LayerSharding(
                path,
                kind,
                spec_in.sizes,
                spec_out.sizes,
                tuple(before),
                tuple(after),
                boundary,
                tuple(shape_in),
                tuple(shape_out),
                dim_in,
                dim_out,
                modes,
            )
        )
    return ShardingReport(parts, tuple(layers), tuple(problems))
