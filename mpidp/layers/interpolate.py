"""Interpolation (nn.Upsample, F.interpolate) on a band, with torch's own weights.

``nearest``, ``bilinear`` and ``bicubic`` are separable: along each spatial dim an output row is
a weighted sum of at most 4 input rows. The weights are taken from torch itself, by
interpolating one-hot rows (an identity) with the user's arguments, so coordinates, clamping at
the edges, ``align_corners`` and ``size=`` / ``scale_factor=`` semantics are torch's exactly.
Along the sharded dim a rank fetches the input rows its output rows read (never beyond the
field: clamping is folded into the weights) and applies its rows of the weights; the other
dims are interpolated the same way, locally. On latitude x longitude blocks the longitude is a
cut dim too and is interpolated as the rows are, over the longitude row's ranks (one dim after
the other: no corners are needed).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mpidp.errors import ConfigError
from mpidp.layers.base import Axis, DomainParallel, band_forward, learn_spec, with_rows
from mpidp.layers.registry import register_layer
from mpidp.ops.geometry import HaloSpec
from mpidp.ops.halo import halo_exchange
from mpidp.runtime.grid import blocks_refused
from mpidp.runtime.partition import ShardSpec

__all__ = ["MODES", "DomainParallelInterpolate", "interpolate"]

MODES = ("nearest", "nearest-exact", "linear", "bilinear", "bicubic", "trilinear")
_MODES = MODES
# the 2-D mode whose weights along one dim are the mode's own (linear is linear in every rank)
_ONE_DIM = {
    "nearest": "nearest",
    "nearest-exact": "nearest-exact",
    "linear": "bilinear",
    "bilinear": "bilinear",
    "trilinear": "bilinear",
    "bicubic": "bicubic",
}
_NEAREST = ("nearest", "nearest-exact")


@functools.lru_cache(maxsize=256)
def _taps(
    n_in: int,
    size: int | None,
    scale: float | None,
    mode: str,
    align_corners: bool | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, weight), each (n_out, 4): the input rows and weights of every output row along
    one dim, read off torch's interpolation of an identity (so they are torch's own)."""
    eye = torch.eye(n_in, dtype=dtype).view(1, n_in, n_in, 1)  # channel c = one-hot row c
    kw: dict[str, object] = {"mode": mode}
    if mode not in _NEAREST:
        kw["align_corners"] = align_corners
    if size is not None:
        out = F.interpolate(eye, size=(size, 1), **kw)  # type: ignore[arg-type]
    else:
        out = F.interpolate(eye, scale_factor=(scale, 1.0), **kw)  # type: ignore[arg-type]
    matrix = out[0, :, :, 0].t()  # (n_out, n_in)
    weight, index = (
        torch.zeros(matrix.size(0), 4, dtype=dtype),
        torch.zeros(matrix.size(0), 4, dtype=torch.long),
    )
    for o in range(matrix.size(0)):
        cols = matrix[o].nonzero().flatten()
        index[o, : cols.numel()] = cols
        index[o, cols.numel() :] = cols[0] if cols.numel() else 0
        weight[o, : cols.numel()] = matrix[o, cols]
    return index, weight


def _apply(x: torch.Tensor, dim: int, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows ``sum_k weight[:, k] * x[index[:, k]]`` along ``dim``."""
    shape = [1] * x.dim()
    shape[dim] = -1
    out = None
    for k in range(index.size(1)):
        w = weight[:, k]
        if not w.is_meta and not bool(w.any()):  # meta (mpidp explain): shapes only
            continue
        w = w.to(x.dtype).view(shape)
        rows = x.index_select(dim, index[:, k])  # a fresh tensor: scaled, or added, in place
        out = rows.mul_(w) if out is None else out.addcmul_(rows, w)
    if out is None:  # no output rows on this rank
        return x.index_select(dim, index[:, 0] if index.size(1) else index.new_zeros(0))
    return out


def _reads(
    index: torch.Tensor, weight: torch.Tensor, out_spec: ShardSpec, rank: int, anchor: int
) -> tuple[int, int]:
    """Input rows ``[lo, hi)`` that ``rank``'s output rows read (empty at ``anchor`` if none)."""
    rows = out_spec.slice(rank)
    used = index[rows][weight[rows] != 0]
    if used.numel() == 0:
        return anchor, anchor
    return int(used.min()), int(used.max()) + 1


def read_halo(
    index: torch.Tensor, weight: torch.Tensor, spec: ShardSpec, out_spec: ShardSpec
) -> tuple[list[tuple[int, int]], HaloSpec]:
    """Every rank's input range along the sharded dim and the halo widths that fetch it, from
    the same taps on every rank (no negotiation); the dry run prices layers with it too."""
    ranges = [_reads(index, weight, out_spec, r, spec.start(r)) for r in range(spec.parts)]
    return ranges, HaloSpec.from_ranges(spec, ranges)


def _native_along(
    y: torch.Tensor,
    dim: int,
    size: int | None,
    scale: float | None,
    mode: str,
    align_corners: bool | None,
) -> torch.Tensor:
    """torch's interpolation along ``dim`` of (B, C, *spatial) alone: the other spatial dims
    keep their sizes, which every mode maps onto themselves exactly (source = destination)."""
    spatial = list(range(2, y.dim()))
    empty = [d for d in spatial if d != dim and y.size(d) == 0]
    if empty:  # an empty band: one zero row, dropped after
        out = _native_along(with_rows(y, empty[0], 1), dim, size, scale, mode, align_corners)
        return out.narrow(empty[0], 0, 0)
    kw: dict[str, object] = {"mode": mode}
    if mode not in _NEAREST:
        kw["align_corners"] = align_corners
    if size is not None:
        sizes = [size if d == dim else y.size(d) for d in spatial]
        return F.interpolate(y, size=tuple(sizes), **kw)  # type: ignore[arg-type]
    factors = [float(scale) if d == dim else 1.0 for d in spatial]  # type: ignore[arg-type]
    return F.interpolate(y, scale_factor=tuple(factors), **kw)  # type: ignore[arg-type]


def _per_dim(value: object, n: int, what: str) -> list:
    if value is None:
        return [None] * n
    if isinstance(value, Sequence):
        if len(value) != n:
            raise ConfigError(f"interpolate: {what}={value!r} needs {n} entries")
        return list(value)
    return [value] * n


def interpolate(
    x: torch.Tensor,
    size: int | Sequence[int] | None = None,
    scale_factor: float | Sequence[float] | None = None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    *,
    shard_dim: int = -2,
    layer: DomainParallel | None = None,
) -> torch.Tensor:
    """:func:`torch.nn.functional.interpolate` of a band (input sharded along ``shard_dim``)
    or of a block (on a grid of blocks, the dim after it cut too); ``size`` is the global
    output size. Collective over the domain group."""
    if mode not in _MODES:
        raise ConfigError(f"interpolate: mode {mode!r} on bands; supported: {', '.join(_MODES)}")
    n = x.dim() - 2
    if n < 1 or n > 3:
        raise ConfigError(f"interpolate: expects (B, C, *spatial) bands, got {tuple(x.shape)}")
    if (size is None) == (scale_factor is None):
        raise ConfigError("interpolate: pass exactly one of size and scale_factor")
    if mode in _NEAREST and align_corners:
        raise ConfigError("interpolate: align_corners only with the linear modes and bicubic")
    owner = layer if layer is not None else _Owner.at(shard_dim)
    cut = {axis.dim: axis for axis in _cut_axes(owner, x, n)}
    specs = {d: learn_spec(x, d, axis.transport) for d, axis in cut.items()}
    sizes = _per_dim(size, n, "size")
    scales = _per_dim(scale_factor, n, "scale_factor")
    y = x
    for k, dim in enumerate(range(2, x.dim())):
        if dim not in cut:  # not cut: torch's own kernel, the cut dims left as they are
            y = _native_along(y, dim, sizes[k], scales[k], mode, align_corners)
            continue
        t, spec = cut[dim].transport, specs[dim]
        one = _ONE_DIM[mode]
        index, weight = _taps(spec.total, sizes[k], scales[k], one, align_corners, x.dtype)
        out_spec: ShardSpec = owner._out_spec(index.size(0), t)
        # every rank's input rows, from the same taps everywhere: no negotiation
        ranges, halo = read_halo(index, weight, spec, out_spec)
        lo = ranges[t.rank][0]
        rows = out_spec.slice(t.rank)
        index, weight = index[rows], weight[rows]
        ext = halo_exchange(
            y, halo.before, halo.after, dim=dim, spec=spec, boundary="none", group=t
        )
        y = _apply(ext, dim, (index - lo).clamp(min=0).to(x.device), weight.to(x.device))
    return y


class _Owner(DomainParallel):
    """The layer :func:`interpolate` asks for its manager and cut dims when called without
    one (the function itself, on bands or blocks)."""

    on_blocks = True

    @classmethod
    def at(cls, shard_dim: int) -> _Owner:
        owner = cls()
        owner._dp_setup(None, shard_dim)
        return owner


def _cut_axes(owner: DomainParallel, x: torch.Tensor, n: int) -> list[Axis]:
    """The dims of ``x`` cut over the domain's ranks: the length of a (B, C, L) input (bands
    only), else the sharded dim and, on blocks, the longitude after it."""
    if n > 1:
        return owner._axes(x)
    m = owner._manager()
    if m._blocks:
        raise blocks_refused(m, "interpolate of a (B, C, L) input (1-D)")
    return [Axis(x.dim() - 1, owner._transport(x))]


class DomainParallelInterpolate(DomainParallel, nn.Upsample):
    """:class:`torch.nn.Upsample` on bands or blocks (nearest, bilinear, bicubic; ``size`` is
    the global output size). Collective over the domain group."""

    dry_run = True  # listed by validate_sharding_constraints and mpidp plan
    on_blocks = True  # per cut axis: the rows, and on blocks the columns too

    @classmethod
    def halo_of(
        cls, module: Any, spec_in: ShardSpec, spec_out: ShardSpec, k: int, n_in: int, n: int
    ) -> tuple[tuple[int, ...], tuple[int, ...], str] | None:
        if module.mode not in MODES:
            return None
        size = _per_dim(module.size, n, "size")[k]
        scale = _per_dim(module.scale_factor, n, "scale_factor")[k]
        mode = _ONE_DIM[module.mode]
        index, weight = _taps(n_in, size, scale, mode, module.align_corners, torch.float64)
        _, halo = read_halo(index, weight, spec_in, spec_out)
        return halo.before, halo.after, "none"

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)
        return interpolate(
            x,
            self.size,
            self.scale_factor,
            self.mode,
            self.align_corners,
            shard_dim=self.shard_dim,
            layer=self,
        )


register_layer(nn.Upsample, DomainParallelInterpolate)
