"""Pooling on a band: MaxPool2d, AvgPool2d, AdaptiveAvgPool2d to a global output size.

Windows along the sharded dim work like convolution windows (:func:`mpidp.input_ranges`); a rank
fetches the rows inside the field that its windows read and pads the rows beyond the field
itself, with what torch's implicit padding means there: -inf for max (never chosen), zeros for
average, with torch's divisor (the window, or only its rows inside the field when
``count_include_pad=False``, or ``divisor_override``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mpidp.errors import ConfigError
from mpidp.geometry import conv_output_size, input_ranges
from mpidp.halo import halo_exchange
from mpidp.layers.base import DomainParallel, learn_spec, with_rows
from mpidp.partition import ShardSpec

__all__ = ["DomainParallelAdaptiveAvgPool2d", "DomainParallelAvgPool2d", "DomainParallelMaxPool2d"]


def _pair(v: object) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    assert isinstance(v, tuple | list) and len(v) == 2
    return int(v[0]), int(v[1])


def _fetch_rows(
    layer: DomainParallel, x: torch.Tensor, ranges: list[tuple[int, int]], spec: ShardSpec
) -> tuple[torch.Tensor, int, int]:
    """This rank's rows ``ranges[rank]`` of the field (clipped to it) and how many rows of its
    range lie beyond the low and high edges."""
    t = layer._transport(x)
    h = spec.total
    inside = [(min(max(lo, 0), h), max(min(hi, h), min(max(lo, 0), h))) for lo, hi in ranges]
    before = [spec.start(r) - lo for r, (lo, _) in enumerate(inside)]
    after = [hi - spec.stop(r) for r, (_, hi) in enumerate(inside)]
    ext = halo_exchange(x, before, after, dim=2, spec=spec, boundary="none", group=t)
    lo, hi = ranges[t.rank]
    return ext, max(0, -lo), max(0, hi - h) if hi > lo else 0


class _Pool(DomainParallel):
    def _geometry(
        self, x: torch.Tensor, dilation: int = 1
    ) -> tuple[torch.Tensor, int, int, tuple[int, int], tuple[int, int], int, int]:
        """The rows this rank's windows read (padding rows beyond the field not yet added),
        the padding rows needed at each end, kernel, stride, the padding along W, and this
        rank's output rows (the result of a rank without any is cut to none)."""
        pool = self  # torch pool attributes
        if getattr(pool, "ceil_mode", False):
            raise ConfigError(
                f"{type(self).__name__}: ceil_mode=True is not supported on bands yet; pad the "
                f"input so that the windows tile it, or use ceil_mode=False"
            )
        if x.dim() != 4:
            raise ConfigError(f"{type(self).__name__}: expects (B, C, H, W), got {tuple(x.shape)}")
        kh, kw = _pair(pool.kernel_size)  # type: ignore[attr-defined]
        sh, sw = _pair(pool.stride or pool.kernel_size)  # type: ignore[attr-defined]
        ph, pw = _pair(pool.padding)  # type: ignore[attr-defined]
        spec = learn_spec(x, 2, self._transport(x))
        n_out = conv_output_size(spec.total, kh, sh, ph, dilation)
        out_spec = self._out_spec(n_out)
        ranges = input_ranges(spec, out_spec, kh, sh, ph, dilation)
        ext, pad_lo, pad_hi = _fetch_rows(self, x, ranges, spec)
        rows = out_spec.sizes[self._transport(x).rank]
        if rows == 0:  # windows of zeros, dropped after
            ext, pad_lo, pad_hi = with_rows(ext, 2, dilation * (kh - 1) + 1), 0, 0
        return ext, pad_lo, pad_hi, (kh, kw), (sh, sw), pw, rows


class DomainParallelMaxPool2d(_Pool, nn.MaxPool2d):
    """:class:`torch.nn.MaxPool2d` on bands (any kernel, stride, padding, dilation; not
    ``ceil_mode`` or ``return_indices``). Collective over the domain group."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)
        if self.return_indices:
            raise ConfigError("DomainParallelMaxPool2d: return_indices is not supported on bands")
        dh, dw = _pair(self.dilation)
        ext, lo, hi, k, s, pw, rows = self._geometry(x, dh)
        if lo or hi:
            ext = F.pad(ext, (0, 0, lo, hi), value=-math.inf)
        return F.max_pool2d(ext, k, s, (0, pw), (dh, dw)).narrow(2, 0, rows)


class DomainParallelAvgPool2d(_Pool, nn.AvgPool2d):
    """:class:`torch.nn.AvgPool2d` on bands (any kernel, stride, padding, count_include_pad,
    divisor_override; not ``ceil_mode``). Collective over the domain group."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)
        ext, lo, hi, k, s, pw, rows = self._geometry(x)
        padded = F.pad(ext, (0, 0, lo, hi)) if lo or hi else ext
        sums = F.avg_pool2d(padded, k, s, (0, pw), False, True, 1)
        sums = sums.narrow(2, 0, rows)
        if self.divisor_override:
            return sums / self.divisor_override
        if self.count_include_pad:
            return sums / (k[0] * k[1])
        mask = torch.ones_like(ext[:, :1])
        mask = F.pad(mask, (0, 0, lo, hi)) if lo or hi else mask
        return sums / F.avg_pool2d(mask, k, s, (0, pw), False, True, 1).narrow(2, 0, rows)


class DomainParallelAdaptiveAvgPool2d(DomainParallel, nn.AdaptiveAvgPool2d):
    """:class:`torch.nn.AdaptiveAvgPool2d` to a global output size (rows partitioned by the
    policy, so at least one output row per rank). Collective over the domain group."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)
        if x.dim() != 4:
            raise ConfigError(f"{type(self).__name__}: expects (B, C, H, W), got {tuple(x.shape)}")
        spec = learn_spec(x, 2, self._transport(x))
        size = self.output_size if isinstance(self.output_size, tuple) else (self.output_size,) * 2
        oh = size[0] if size[0] is not None else spec.total
        ow = size[1] if size[1] is not None else x.size(3)
        out_spec = self._out_spec(oh)
        h = spec.total

        def window(o: int) -> tuple[int, int]:
            return (o * h) // oh, -(-((o + 1) * h) // oh)

        ranges = []
        for r in range(out_spec.parts):
            rows = range(out_spec.start(r), out_spec.stop(r))
            ranges.append(
                (window(rows[0])[0], window(rows[-1])[1]) if rows else (spec.start(r),) * 2
            )
        ext, _, _ = _fetch_rows(self, x, ranges, spec)
        me = self._transport(x).rank
        lo = ranges[me][0]
        means = [
            ext.narrow(2, a - lo, b - a).mean(2, keepdim=True)
            for a, b in (window(o) for o in range(out_spec.start(me), out_spec.stop(me)))
        ]
        if not means:  # no output rows here: one row of zeros, dropped after
            return F.adaptive_avg_pool2d(with_rows(ext, 2, 1), (1, ow)).narrow(2, 0, 0)
        band = torch.cat(means, 2)
        return F.adaptive_avg_pool2d(band, (band.size(2), ow))
