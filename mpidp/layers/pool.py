"""Pooling on a band: Max/AvgPool 1-3-D (any kernel, stride, padding, dilation, ``ceil_mode``)
and AdaptiveAvg/MaxPool 1-3-D.

Pooling is separable: a window's max (or sum) over H x W is the max (sum) over W of the max
(sum) over H, and torch's average divides by the product of the window's extents along each
dim. So the sharded dim is pooled by mpidp and the other dims by torch's own kernel (kernel 1
along the sharded dim):

* **along the sharded dim** a rank fetches the rows inside the field that its windows read
  (:func:`mpidp.input_ranges`), pads the rows beyond the field itself (-inf for max, zeros for
  sums) and pools with torch without padding; an average divides by its windows' extent along
  H computed from global row numbers, exactly as torch counts it (``count_include_pad``,
  ``ceil_mode`` windows running past the end, ``divisor_override``);
* **along the other dims** torch pools with the module's own arguments.

On latitude x longitude blocks the longitude is pooled by mpidp too, the same way, over the
longitude row's ranks (the adaptive pools too: their windows are rectangles, so one cut dim is
pooled after the other).

The output length along the sharded dim is torch's own (asked of torch on a meta tensor), so
``ceil_mode`` gives what torch gives. An adaptive pool whose output has fewer rows than the
domain has ranks (``AdaptiveAvgPool2d(1)`` of a squeeze-excitation block) returns the whole,
replicated result on every rank: each rank pools its own rows and one all-reduce (average) or
all-gather (max) combines them; the gradient of every rank's use is summed back to the rows.
On blocks the result is whole when it is shorter than the grid along either cut dim (a layout
cut along one dim and whole along the other would be neither blocks nor replicated).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mpidp.errors import ConfigError
from mpidp.layers.base import (
    DomainParallel,
    band_forward,
    fetch_halo,
    learn_spec,
    note_replicated,
    with_rows,
)
from mpidp.layers.registry import register_layer
from mpidp.ops.collectives import all_gather_v, all_reduce
from mpidp.ops.geometry import HaloSpec
from mpidp.ops.halo import halo_exchange
from mpidp.runtime.partition import ShardSpec

__all__ = [
    "DomainParallelAdaptiveAvgPool1d",
    "DomainParallelAdaptiveAvgPool2d",
    "DomainParallelAdaptiveAvgPool3d",
    "DomainParallelAdaptiveMaxPool1d",
    "DomainParallelAdaptiveMaxPool2d",
    "DomainParallelAdaptiveMaxPool3d",
    "DomainParallelAvgPool1d",
    "DomainParallelAvgPool2d",
    "DomainParallelAvgPool3d",
    "DomainParallelMaxPool1d",
    "DomainParallelMaxPool2d",
    "DomainParallelMaxPool3d",
]

_MAX: dict[int, Any] = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG: dict[int, Any] = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_ADAPTIVE_AVG: dict[int, Any] = {
    1: F.adaptive_avg_pool1d,
    2: F.adaptive_avg_pool2d,
    3: F.adaptive_avg_pool3d,
}
_ADAPTIVE_MAX: dict[int, Any] = {
    1: F.adaptive_max_pool1d,
    2: F.adaptive_max_pool2d,
    3: F.adaptive_max_pool3d,
}


def _tuple(v: Any, n: int) -> list[Any]:
    if isinstance(v, tuple | list):
        if len(v) != n:
            raise ConfigError(f"pooling argument {v!r} needs {n} entries")
        return list(v)
    return [v] * n


def _inside(spec: ShardSpec, ranges: list[tuple[int, int]]) -> HaloSpec:
    """The halo that fetches every rank's rows ``ranges[rank]`` clipped to the field."""
    h = spec.total
    inside = [(min(max(lo, 0), h), max(min(hi, h), min(max(lo, 0), h))) for lo, hi in ranges]
    before = [spec.start(r) - lo for r, (lo, _) in enumerate(inside)]
    after = [hi - spec.stop(r) for r, (_, hi) in enumerate(inside)]
    return HaloSpec(tuple(before), tuple(after))


def _fetch_rows(
    x: torch.Tensor, d: int, ranges: list[tuple[int, int]], spec: ShardSpec, t: Any
) -> torch.Tensor:
    """This rank's rows ``ranges[rank]`` of the field along ``d``, clipped to it, fetched over
    ``t``."""
    halo = _inside(spec, ranges)
    return halo_exchange(x, halo.before, halo.after, dim=d, spec=spec, boundary="none", group=t)


def _adaptive_window(h: int, oh: int) -> Any:
    """Torch's adaptive window ``o -> [start, stop)`` of ``oh`` outputs over ``h`` rows."""

    def window(o: int) -> tuple[int, int]:
        return (o * h) // oh, -(-((o + 1) * h) // oh)

    return window


def _window_ranges(
    spec: ShardSpec, out_spec: ShardSpec, k: int, s: int, p: int, dil: int
) -> list[tuple[int, int]]:
    """Every rank's global input rows ``[lo, hi)`` (beyond the field too) read by its output
    rows' windows; an empty range at its own start for a rank without output rows. Any
    output count (``ceil_mode`` adds windows that run past the end)."""
    ranges = []
    for r in range(out_spec.parts):
        a, b = out_spec.start(r), out_spec.stop(r)
        if b > a:
            ranges.append((a * s - p, (b - 1) * s - p + dil * (k - 1) + 1))
        else:
            ranges.append((spec.start(r), spec.start(r)))
    return ranges


def _pad_rows(x: torch.Tensor, d: int, lo: int, hi: int, value: float) -> torch.Tensor:
    if not (lo or hi):
        return x
    parts = []
    for n in (lo, hi):
        shape = list(x.shape)
        shape[d] = n
        parts.append(x.new_full(shape, value))
    return torch.cat([parts[0], x, parts[1]], d)


def _avg1d_sums(
    x: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int], ceil: bool, *_: Any
) -> torch.Tensor:
    """Window sums of a 1-D pool (avg_pool1d has no divisor_override: through 2-D)."""
    return F.avg_pool2d(x.unsqueeze(-1), (kernel[0], 1), (stride[0], 1), 0, ceil, True, 1)[..., 0]


def _other_extents(
    x: torch.Tensor,
    n: int,
    cut: list[int],
    kernel: list[int],
    stride: list[int],
    padding: list[int],
    pool: Any,
) -> torch.Tensor | float:
    """Torch's divisor along the spatial dims other than the ``cut`` ones (its window's extent
    there, ``count_include_pad`` and ``ceil_mode`` as torch counts them), shaped to broadcast:
    window sums of ones over the average of ones, on a field one row high along each cut dim."""
    if n == len(cut):
        return 1.0
    shape = [1, 1] + [1 if i in cut else x.size(x.dim() - n + i) for i in range(n)]
    ones = torch.ones(shape, dtype=torch.float64, device=x.device)
    kernel, stride = list(kernel), list(stride)
    for k in cut:
        kernel[k] = stride[k] = 1
    args = (kernel, stride, padding, pool.ceil_mode, pool.count_include_pad)
    real = _AVG[n](ones, *args, 1)
    mean = _AVG[n](ones, *args)
    return torch.round(real / mean).to(x.dtype)[0, 0]


def _checked_dim(layer: Any, x: torch.Tensor) -> int:
    """The sharded dim of ``x`` for an ``_n``-d pool, after the checks every pool shares: a
    batched or unbatched input of its rank, and no ``return_indices``."""
    n = layer._n
    if x.dim() not in (n + 1, n + 2):
        raise ConfigError(
            f"{type(layer).__name__} expects a {n + 1}-d or {n + 2}-d input, got {tuple(x.shape)}"
        )
    if layer._max and layer.return_indices:
        raise ConfigError(f"{type(layer).__name__}: return_indices is not supported on bands")
    return int(x.dim() + layer.shard_dim)


class _Pool(DomainParallel):
    """Max/AvgPool 1-3-D (``self`` is also the torch pool); ``_n`` spatial dims."""

    dry_run = True  # listed by validate_sharding_constraints and mpidp plan

    @classmethod
    def geometry(cls, module: Any, k: int) -> tuple[int, int, tuple[int, int], int] | None:
        def at(v: Any) -> int:
            return v if isinstance(v, int) else v[k]

        dil = at(getattr(module, "dilation", 1))
        p = at(module.padding)
        return at(module.kernel_size), at(module.stride or module.kernel_size), (p, p), dil

    @classmethod
    def halo_of(
        cls, module: Any, spec_in: ShardSpec, spec_out: ShardSpec, k: int, n_in: int, n: int
    ) -> tuple[tuple[int, ...], tuple[int, ...], str] | None:
        """Windows past the end (ceil_mode) included; rows beyond the field are the pool's own."""
        kernel, stride, pad, dil = cls.geometry(module, k)  # type: ignore[misc]
        ranges = _window_ranges(spec_in, spec_out, kernel, stride, pad[0], dil)
        h = spec_in.total
        inside = [(min(max(lo, 0), h), max(min(hi, h), min(max(lo, 0), h))) for lo, hi in ranges]
        halo = HaloSpec.from_ranges(spec_in, inside)
        return halo.before, halo.after, "none"

    _n: int
    _max: bool

    on_blocks = True  # per cut axis: the rows, and on blocks the columns too

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)  # type: ignore[misc]
        pool: Any = self
        n = self._n
        first = _checked_dim(self, x) - n - self.shard_dim  # the first spatial dim
        kernel = _tuple(pool.kernel_size, n)
        stride = _tuple(pool.stride or pool.kernel_size, n)
        padding = _tuple(pool.padding, n)
        dilation = _tuple(getattr(pool, "dilation", 1), n)
        cuts, plans = [], []
        for axis in self._axes(x):  # the sharded dim, and on blocks the longitude too
            k, t = axis.dim - first, axis.transport
            spec = learn_spec(x, axis.dim, t)
            kh, sh, ph, dh = kernel[k], stride[k], padding[k], dilation[k]
            out_spec = self._out_spec(self._torch_rows(spec.total, kh, sh, ph, dh), t)
            ranges = _window_ranges(spec, out_spec, kh, sh, ph, dh)
            cuts.append((axis, spec, _inside(spec, ranges)))
            plans.append((axis, k, spec, out_spec, ranges[t.rank], ph))
        ext = fetch_halo(self, x, cuts, "none")
        for axis, k, spec, out_spec, (lo, hi), _ in plans:
            if out_spec.sizes[axis.transport.rank] == 0:  # no windows: one of zeros, dropped
                ext = with_rows(ext, axis.dim, dilation[k] * (kernel[k] - 1) + 1)
            else:
                fill = -math.inf if self._max else 0.0
                ext = _pad_rows(ext, axis.dim, max(0, -lo), max(0, hi - spec.total), fill)
            padding[k] = 0
        # one torch call over the whole window (torch's own order of sums and its choice among
        # equal maxima): no padding along the cut dims (ext spans exactly this rank's
        # windows), the module's own arguments along the others
        if self._max:
            y = _MAX[n](ext, kernel, stride, padding, dilation, pool.ceil_mode)
        else:
            sums = _AVG[n] if n > 1 else _avg1d_sums
            y = sums(ext, kernel, stride, padding, pool.ceil_mode, pool.count_include_pad, 1)
        for axis, _, _, out_spec, _, _ in plans:
            y = y.narrow(axis.dim, 0, out_spec.sizes[axis.transport.rank])
        if self._max:
            return y
        override = getattr(pool, "divisor_override", None)
        if override:
            return y / override
        divisor = _other_extents(x, n, [p[1] for p in plans], kernel, stride, padding, pool)
        for axis, k, spec, out_spec, _, ph in plans:
            rank = axis.transport.rank
            along = self._extent(out_spec, rank, spec.total, kernel[k], stride[k], ph, y, axis.dim)
            divisor = along * divisor
        return y / divisor

    def _torch_rows(self, h: int, k: int, s: int, p: int, dil: int) -> int:
        """Torch's own output length along the sharded dim (ceil_mode's rule included)."""
        probe = torch.empty(1, 1, h, device="meta")
        if self._max:
            return F.max_pool1d(probe, k, s, p, dil, self.ceil_mode).size(-1)  # type: ignore[attr-defined]
        return F.avg_pool1d(probe, k, s, p, self.ceil_mode).size(-1)  # type: ignore[attr-defined]

    def _extent(
        self,
        out_spec: ShardSpec,
        rank: int,
        h: int,
        k: int,
        s: int,
        p: int,
        y: torch.Tensor,
        d: int,
    ) -> torch.Tensor:
        """Torch's divisor along the sharded dim for this rank's output rows: the window's rows
        inside the padded field (``count_include_pad``) or inside the field (torch's rule:
        the window is first cut at the end of the padded field)."""
        out = torch.arange(out_spec.start(rank), out_spec.stop(rank), dtype=torch.long)
        start = out * s - p
        end = torch.clamp(start + k, max=h + p)
        if self.count_include_pad:  # type: ignore[attr-defined]
            counts = end - start
        else:
            counts = torch.clamp(end, max=h) - torch.clamp(start, min=0)
        shape = [1] * y.dim()
        shape[d] = -1
        return counts.to(device=y.device, dtype=y.dtype).view(shape)


def _pool_wrapper(torch_type: type[nn.Module], n: int, is_max: bool) -> type[nn.Module]:
    name = f"DomainParallel{torch_type.__name__}"
    doc = (
        f":class:`torch.nn.{torch_type.__name__}` on bands (int or tuple arguments, "
        f"ceil_mode; not return_indices). Collective over the domain group."
    )
    attrs = {"__doc__": doc, "__module__": __name__, "_n": n, "_max": is_max}
    cls = type(name, (_Pool, torch_type), attrs)
    cls.__qualname__ = name
    return cls


class _Adaptive(DomainParallel):
    """AdaptiveAvg/MaxPool 1-3-D to a global output size (``self`` is also the torch pool)."""

    dry_run = True  # listed by validate_sharding_constraints and mpidp plan
    whole_when_short = True
    on_blocks = True  # per cut axis, as Max/AvgPool

    _n: int
    _max: bool

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)  # type: ignore[misc]
        pool: Any = self
        n = self._n
        first = _checked_dim(self, x) - n - self.shard_dim  # the first spatial dim
        size = _tuple(pool.output_size, n)
        others = [s if s is not None else x.size(first + i) for i, s in enumerate(size)]
        plans = []
        for axis in self._axes(x):  # the sharded dim, and on blocks the longitude too
            k = axis.dim - first
            spec = learn_spec(x, axis.dim, axis.transport)
            plans.append((axis, spec, size[k] if size[k] is not None else spec.total))
        # fewer outputs than ranks along a cut axis: the whole result on every rank
        whole = any(out < axis.transport.size for axis, _, out in plans)
        y = x
        for axis, spec, out in plans:  # separable: one cut dim after the other
            pooled = self._replicated if whole else self._banded
            y = pooled(y, axis.dim, spec, out, _adaptive_window(spec.total, out), axis.transport)
            others[axis.dim - first] = y.size(axis.dim)
        if whole:
            note_replicated()
        op = _ADAPTIVE_MAX[n] if self._max else _ADAPTIVE_AVG[n]
        empty = [axis.dim for axis, _, _ in plans if y.size(axis.dim) == 0]
        for d in empty:  # no output rows here: pool one zero row, keep none
            y = with_rows(y, d, 1)
            others[d - first] = 1
        y = op(y, others)
        for d in empty:
            y = y.narrow(d, 0, 0)
        return y

    def _reduce(self, rows: torch.Tensor, d: int) -> torch.Tensor:
        if self._max:
            return rows.amax(d, keepdim=True)
        return rows.mean(d, keepdim=True)

    def _banded(
        self, x: torch.Tensor, d: int, spec: ShardSpec, oh: int, window: Any, t: Any
    ) -> torch.Tensor:
        """Output rows cut by the policy over ``t``: each rank fetches the rows its windows
        read."""
        out_spec = self._out_spec(oh, t)
        ranges = []
        for r in range(out_spec.parts):
            rows = range(out_spec.start(r), out_spec.stop(r))
            ranges.append(
                (window(rows[0])[0], window(rows[-1])[1]) if rows else (spec.start(r),) * 2
            )
        ext = _fetch_rows(x, d, ranges, spec, t)
        me = t.rank
        lo = ranges[me][0]
        parts = [
            self._reduce(ext.narrow(d, a - lo, b - a), d)
            for a, b in (window(o) for o in range(out_spec.start(me), out_spec.stop(me)))
        ]
        if not parts:
            return ext.narrow(d, 0, 0)
        return torch.cat(parts, d)

    def _replicated(
        self, x: torch.Tensor, d: int, spec: ShardSpec, oh: int, window: Any, t: Any
    ) -> torch.Tensor:
        """Fewer output rows than ranks: every rank gets all of them. Average: each rank's sum
        over its rows of every window, one all-reduce, divided by the window's length. Max:
        each rank's max (-inf where it holds none of the window), gathered, the max of those;
        the gradient of the gathered values returns to the rank that held the maximum."""
        me = t.rank
        mine_lo, mine_hi = spec.start(me), spec.stop(me)
        parts = []
        for o in range(oh):
            a, b = window(o)
            lo, hi = max(a, mine_lo), min(b, mine_hi)
            shape = list(x.shape)
            shape[d] = 1
            if hi > lo:
                rows = x.narrow(d, lo - mine_lo, hi - lo)
                part = rows.amax(d, keepdim=True) if self._max else rows.sum(d, keepdim=True)
            else:  # joined to x, so every rank's backward reaches the collective
                filler = -math.inf if self._max else 0.0
                part = x.new_full(shape, filler) + x.narrow(d, 0, 0).sum()
            parts.append(part)
        local = torch.cat(parts, d)
        if self._max:
            every = all_gather_v(local.unsqueeze(0), [1] * t.size, 0, group=t)
            return every.amax(0)
        counts = torch.tensor([b - a for a, b in (window(o) for o in range(oh))])
        shape = [1] * x.dim()
        shape[d] = -1
        total = all_reduce(local, "sum", group=t)
        return total / counts.to(device=x.device, dtype=x.dtype).view(shape)


def _adaptive_wrapper(torch_type: type[nn.Module], n: int, is_max: bool) -> type[nn.Module]:
    name = f"DomainParallel{torch_type.__name__}"
    doc = (
        f":class:`torch.nn.{torch_type.__name__}` to a global output size on bands or "
        f"blocks; fewer output rows than ranks give the replicated result on every rank. "
        f"Collective over the domain group."
    )
    attrs = {"__doc__": doc, "__module__": __name__, "_n": n, "_max": is_max}
    cls = type(name, (_Adaptive, torch_type), attrs)
    cls.__qualname__ = name
    return cls


#: torch pool type -> its domain-parallel wrapper
POOL_WRAPPERS: dict[type[nn.Module], type[nn.Module]] = {}
for _n in (1, 2, 3):
    for _kind, _is_max in (("Max", True), ("Avg", False)):
        _plain = getattr(nn, f"{_kind}Pool{_n}d")
        _adaptive = getattr(nn, f"Adaptive{_kind}Pool{_n}d")
        POOL_WRAPPERS[_plain] = _pool_wrapper(_plain, _n, _is_max)
        POOL_WRAPPERS[_adaptive] = _adaptive_wrapper(_adaptive, _n, _is_max)
DomainParallelMaxPool1d: Any = POOL_WRAPPERS[nn.MaxPool1d]
DomainParallelMaxPool2d: Any = POOL_WRAPPERS[nn.MaxPool2d]
DomainParallelMaxPool3d: Any = POOL_WRAPPERS[nn.MaxPool3d]
DomainParallelAvgPool1d: Any = POOL_WRAPPERS[nn.AvgPool1d]
DomainParallelAvgPool2d: Any = POOL_WRAPPERS[nn.AvgPool2d]
DomainParallelAvgPool3d: Any = POOL_WRAPPERS[nn.AvgPool3d]
DomainParallelAdaptiveMaxPool1d: Any = POOL_WRAPPERS[nn.AdaptiveMaxPool1d]
DomainParallelAdaptiveMaxPool2d: Any = POOL_WRAPPERS[nn.AdaptiveMaxPool2d]
DomainParallelAdaptiveMaxPool3d: Any = POOL_WRAPPERS[nn.AdaptiveMaxPool3d]
DomainParallelAdaptiveAvgPool1d: Any = POOL_WRAPPERS[nn.AdaptiveAvgPool1d]
DomainParallelAdaptiveAvgPool2d: Any = POOL_WRAPPERS[nn.AdaptiveAvgPool2d]
DomainParallelAdaptiveAvgPool3d: Any = POOL_WRAPPERS[nn.AdaptiveAvgPool3d]

#: the 1-D pools: sharded along their length
ONE_D_POOLS = (nn.MaxPool1d, nn.AvgPool1d, nn.AdaptiveMaxPool1d, nn.AdaptiveAvgPool1d)

for _t, _l in POOL_WRAPPERS.items():
    register_layer(_t, _l)
