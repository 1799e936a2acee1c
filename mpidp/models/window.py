"""Windowed attention (Swin, Pangu) on latitude bands and latitude x longitude blocks, exact.

Along a cut dim a window partition is a layer with kernel = stride = window, offset by the zero
rows padded before the field and by the shift (the roll of shifted blocks wraps around, padded
rows included). Each rank fetches the rows of every window that holds one of its rows (one
``all_to_all_v`` over the ranks cutting that dim: only rows another rank owns travel, none at
all when the shards are whole windows and the block is not shifted), computes those windows
whole, in their global positions, so the shifted-window mask and the earth-specific bias
(indexed by the global window number) come out as in serial, and keeps its own rows. A window
cut by a shard boundary is computed by every rank holding a part of it. The dims not cut (the
longitude on bands, the pressure levels) are padded and rolled as in serial. The backward is
the reverse exchange (gradients of fetched rows are added on their owners).

On blocks the same step runs once per cut axis (:meth:`~mpidp.layers.base.DomainParallel._axes`):
first along the latitude column, then, on the rows that gives, along the longitude row, whose
ranks hold the same extended rows, so a window straddling both cuts arrives whole, its corner
from the diagonal block through the second step. Every window and block combination is exact
(windows wider than a block fetch from several ranks, a shifted window wraps around the
longitude and latitude as the serial roll does); what each costs: blocks that are whole
windows along a dim (and, shifted, whole windows after the shift) move nothing along it; else
each rank receives the rows of its straddling windows along H, then the columns of those along
W for every row it computes, and computes up to four copies of a window at a corner.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from mpidp.layers.base import Axis, DomainParallel, band_forward, learn_spec
from mpidp.layers.registry import register_layer
from mpidp.models.swin import WindowAttention, _window_cut
from mpidp.ops.collectives import fetch_global_rows
from mpidp.runtime.partition import ShardSpec

__all__ = ["DomainParallelWindowAttention", "window_rows"]

#: a run of the extended band: (first global row, count), or (None, count) for zero rows
Run = tuple[int | None, int]


@functools.lru_cache(maxsize=512)
def window_rows(
    sizes: tuple[int, ...], window: int, shift: int, rank: int
) -> tuple[int, list[list[tuple[int, int]]], list[Run], int]:
    """What rank ``rank`` computes for windows of ``window`` rows along a field cut into
    ``sizes``, padded as :class:`~mpidp.models.WindowAttention` pads and rolled by ``-shift``:
    ``(first, wanted, runs, keep)``. ``first`` is the global number of its first window (-1:
    the last window, wrapped around); ``wanted`` every rank's data rows (for
    :func:`~mpidp.ops.collectives.fetch_global_rows`); ``runs`` its extended band, window after
    window, as runs of data rows and zero rows; ``keep`` where its own rows start in it."""
    spec = ShardSpec(sizes)
    lo, hi = _window_cut(spec.total, window)
    ring = spec.total + lo + hi

    def plan(q: int) -> tuple[int, list[Run]]:
        a, b = spec.start(q), spec.stop(q)
        if a == b:
            return 0, []
        first = (a + lo - shift) // window
        last = -(-(b + lo - shift) // window)
        runs: list[Run] = []
        for r in range(first * window, last * window):
            d = (r + shift) % ring - lo
            row = d if 0 <= d < spec.total else None
            prev = runs[-1] if runs else None
            if prev is not None and (
                (row is None and prev[0] is None)
                or (row is not None and prev[0] is not None and prev[0] + prev[1] == row)
            ):
                runs[-1] = (prev[0], prev[1] + 1)
            else:
                runs.append((row, 1))
        return first, runs

    wanted = [[(d, d + n) for d, n in plan(q)[1] if d is not None] for q in range(spec.parts)]
    first, runs = plan(rank)
    keep = spec.start(rank) + lo - shift - first * window if runs else 0
    return first, wanted, runs, keep


class DomainParallelWindowAttention(DomainParallel, WindowAttention):
    """:class:`mpidp.models.WindowAttention` on bands of its channels-last tokens (H, the dim
    before W, is cut) or on latitude x longitude blocks of them (H and W cut): exact for every
    partition, thin and empty shards included, shifted or not, padded or not. Collective over
    the domain group (per cut axis one all-gather of one integer to learn the partition, unless
    the input's spec is known, and one all-to-all)."""

    dry_run = channels_last_in = channels_last_out = on_blocks = True

    @classmethod
    def window_of(cls, module: Any, d: int) -> tuple[int, ...]:
        return (module.window[d - 1], module.shift[d - 1])

    @classmethod
    def transpose_bytes(cls, layer: Any, rank: int, itemsize: int) -> int:
        """The rows of the windows that straddle band boundaries: fetched in the forward,
        given back in the backward."""
        spec = ShardSpec.from_sizes(layer.rows_in)
        wanted = window_rows(spec.sizes, *layer.window, rank)[1]
        a, b = spec.start(rank), spec.stop(rank)
        fetched = sum(
            hi - lo for s, e in wanted[rank] for r, lo, hi in spec.overlaps(s, e) if r != rank
        )
        given = sum(
            max(0, min(e, b) - max(s, a))
            for q in range(spec.parts)
            if q != rank
            for s, e in wanted[q]
        )
        return (fetched + given) * layer.row_elements("in") * itemsize

    @classmethod
    def _rows_after(cls, lat: Any, i: int) -> float:
        """On blocks the fetch along the longitude runs on the rows of every window the
        block's rows touch (the latitude fetch's rows, the padding's zero rows included)."""
        runs = window_rows(tuple(lat.rows_in), *lat.window, i)[2]
        return sum(n for _, n in runs) / max(sum(lat.rows_in), 1)

    @classmethod
    def saved_shares(cls, layer: Any) -> list[float] | None:
        """It computes whole windows, so it holds the rows of every window its band touches,
        of the field padded to whole windows."""
        return _window_shares(tuple(layer.rows_in), *layer.window)

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)
        dims = tuple(range(1, x.dim() - 1))
        # the cut axes (H, on blocks W too) of the grid dims, those before the channels; an
        # axis of one rank (a 1 x P grid's latitude) is whole here, as the others (Z)
        axes = [a for a in self._axes(x[..., 0]) if a.transport.size > 1]
        specs = [learn_spec(x, a.dim, a.transport) for a in axes]
        others = [d for d in dims if d not in {a.dim for a in axes}]
        cuts = {d: _window_cut(x.size(d), self.window[d - 1]) for d in others}
        pad = [v for d in reversed(dims) for v in cuts.get(d, (0, 0))]
        y = nn.functional.pad(x, [0, 0, *pad])
        shifts = [self.shift[d - 1] for d in others]
        if any(shifts):
            y = torch.roll(y, [-s for s in shifts], others)
        grid = {d: y.size(d) for d in others}
        start = dict.fromkeys(others, 0)
        keep = []
        for axis, spec in zip(axes, specs, strict=True):  # the latitude first: then the
            # longitude row's ranks hold the same extended rows, and the corners come along
            d, w, s = axis.dim, self.window[axis.dim - 1], self.shift[axis.dim - 1]
            first, y, k = _whole_windows(y, axis, spec, w, s)
            lo, hi = _window_cut(spec.total, w)
            grid[d], start[d] = spec.total + lo + hi, first
            keep.append((d, k, spec.sizes[axis.transport.rank]))
        out = self._windows(y, tuple(start[d] for d in dims), tuple(grid[d] for d in dims))
        for d, k, n in keep:
            out = out.narrow(d, k, n)
        if any(shifts):
            out = torch.roll(out, shifts, others)
        for d in others:
            out = out.narrow(d, cuts[d][0], x.size(d))
        return out


def _whole_windows(
    y: torch.Tensor, axis: Axis, spec: ShardSpec, window: int, shift: int
) -> tuple[int, torch.Tensor, int]:
    """``y``, cut by ``spec`` along ``axis``, extended to the whole windows (padded and rolled
    as :class:`~mpidp.models.WindowAttention` does) that hold this rank's rows: ``(first, ext,
    keep)`` with the global number of its first window and where its own rows start. Collective
    over the axis's ranks (one all-to-all; none when no window straddles a cut)."""
    d, t = axis.dim, axis.transport
    first, wanted, runs, keep = window_rows(spec.sizes, window, shift, t.rank)
    got = fetch_global_rows(y, spec, d, wanted, t)
    pieces, at = [], 0
    for row, n in runs:
        if row is None:
            shape = list(got.shape)
            shape[d] = n
            pieces.append(got.new_zeros(shape))
        else:
            pieces.append(got.narrow(d, at, n))
            at += n
    return first, torch.cat(pieces, d) if len(pieces) > 1 else got, keep


register_layer(WindowAttention, DomainParallelWindowAttention)


@functools.lru_cache(maxsize=64)
def _window_shares(rows: tuple[int, ...], window: int, shift: int) -> list[float]:
    lo, hi = _window_cut(sum(rows), window)
    padded = sum(rows) + lo + hi
    return [
        sum(n for _, n in window_rows(rows, window, shift, r)[2]) / padded for r in range(len(rows))
    ]
