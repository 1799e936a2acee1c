"""A halo exchange hidden behind compute, in the forward and in the backward.

A layer that reads its neighbours' rows computes most of its output from its own band: only the
rows near the cut read the halo. :func:`start_overlapped` posts the fetch of the halo strips
and returns the band through an identity node; the layer computes its interior from that band
while the rows are in flight; :meth:`Overlapped.windows` waits for them and returns the rows the
layer's edge outputs read (global rows of the extended band ``[start - before, stop + after)``,
taken from the strips and the band, one new tensor per window).

The backward runs the same pattern the other way. The windows' node (created after the
interior's, so autograd's engine, which runs the ready node made last first, reaches it before
the interior's backward) sends the strips' gradients to the ranks that own those rows (halo
accumulate, :func:`~mpidp.ops.halo_band.start_accumulate`) and keeps the gradient of the band's
own rows it read; the band's identity node, which autograd runs only after every use of the
band (the interior's backward included), adds those and the peers' rows to the band's gradient
(:func:`~mpidp.ops.halo_band.finish_accumulate`). The two halves share one record, as the two
halves of :class:`~mpidp.ops.halo_band.PendingHalo` do. Every message and its tag are those of
:func:`mpidp.halo_strips`, so the result is the blocking exchange's, sum for sum.

On latitude x longitude blocks (:func:`start_overlapped_axes`) one node posts the fetch along
each cut dim; the windows along the latitude then take their columns beyond the block in a
second phase, after the rows arrived (:meth:`Overlapped.across`: the longitude's exchange of
the windows, as the blocking block halo's second phase, :mod:`mpidp.ops.block_halo`, fetches
the corners); the windows along the longitude are the band's own rows. The polar fold is not
served (the blocking exchange is: no converted convolution pads with it).

A layer whose input's partition is not known yet (a plain tensor) can learn it in the halo's
own agreement (:func:`fetch_strips`, the strips fetched in one go: nothing hidden that call)
and cut the same windows from them (:class:`Fetched`): the first exchange every rank makes is
then the same whether ``manager.overlap`` is on or off, and the agreement (whose facts say
whether a call fetches strips) refuses ranks that differ.

The backward is once differentiable (double backward raises; the blocking exchange's is not
limited). Seconds spent waiting for messages are added to
:data:`mpidp.comm.timing.HALO_WAIT` (the forward's and the backward's waits: the communication
the interior did not hide), which :func:`mpidp.profile` records per step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from mpidp.comm.timing import HALO_WAIT
from mpidp.errors import CommError
from mpidp.ops.functions import _call
from mpidp.ops.halo_args import Widths
from mpidp.ops.halo_band import (
    Accumulating,
    _finish_fetch,
    _Op,
    _resolve,
    _start_fetch,
    _Started,
    finish_accumulate,
    halo_strips,
    start_accumulate,
)
from mpidp.runtime.partition import ShardSpec

__all__ = ["Fetched", "Overlapped", "fetch_strips", "start_overlapped", "start_overlapped_axes"]


def _timed_wait(wait: Any, *args: Any) -> Any:
    t0 = time.perf_counter()
    try:
        return wait(*args)
    finally:
        HALO_WAIT.seconds += time.perf_counter() - t0
        HALO_WAIT.waits += 1


@dataclasses.dataclass
class Overlapped:
    """One overlapped exchange of a band of ``rows`` rows: its op, what is in flight, and the
    band rows' gradients that the windows' backward hands to the band's."""

    op: _Op
    rows: int
    before: int
    after: int
    started: _Started | None = None
    number: int = 0  # the fetch's number (the accumulate's messages carry one more)
    accumulating: Accumulating | None = None
    edges: list[tuple[int, torch.Tensor]] = dataclasses.field(default_factory=list)

    def windows(self, band: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """Wait for the halo, then the rows ``[lo, hi)`` of the extended band (row 0: the
        first halo row) for each span of ``spans``. ``band``: what :func:`start_overlapped`
        returned. Differentiable; call once."""
        if self.started is None:
            raise CommError("Overlapped.windows() was already called; it returns the rows once")
        if not spans:  # this rank's edge rows read no halo: the messages are completed alone
            started, self.started = self.started, None
            _timed_wait(_finish_fetch, self.op, band, started)
            return []
        return list(_call(_Arrived, band, self, tuple(spans)))

    def across(self, x: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
        """Columns ``[lo, hi)`` (this record's dim; column 0: the first halo column) of ``x``
        extended by this record's exchange, made now: ``x`` holds this rank's columns and any
        rows (the windows of another dim's record: their corners come from here). The op was
        agreed when this record was started; every rank of its group passes a tensor of the
        same shape. Differentiable (the backward waits for the peers' gradients)."""
        record = Overlapped(self.op, x.size(self.op.dim), self.before, self.after)
        band = _call(_Posted, x, (record,))
        return record.windows(band, [span])[0]


def start_overlapped(
    x: torch.Tensor,
    before: Widths,
    after: Widths,
    dim: int,
    spec: ShardSpec | Sequence[int] | None,
    boundary: Any,
    group: Any,
) -> tuple[torch.Tensor, Overlapped]:
    """Post the fetch of ``x``'s halo strips (the arguments of :func:`mpidp.halo_strips`,
    widths >= 0) and return ``(band, record)``: compute from ``band`` (``x`` itself, through
    the node that completes the backward's exchange), then :meth:`Overlapped.windows`.
    Collective over the group; every rank must call ``windows`` once."""
    band, (record,) = start_overlapped_axes(x, [(before, after, dim, spec, boundary, group)])
    return band, record


@dataclasses.dataclass
class Fetched:
    """Halo strips fetched in one go (:func:`fetch_strips`): the windows that
    :meth:`Overlapped.windows` gives, cut from them (their backward: the strips' own)."""

    low: torch.Tensor
    high: torch.Tensor
    dim: int

    @property
    def before(self) -> int:
        return self.low.size(self.dim)

    def windows(self, band: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """Rows ``[lo, hi)`` of the extended band for each span; ``band``: the strips' band."""
        return _windows(self.low, band, self.high, self.dim, spans)


def fetch_strips(
    x: torch.Tensor, before: int, after: int, dim: int, boundary: Any, group: Any
) -> Fetched:
    """:func:`mpidp.halo_strips` of ``x`` (the partition learned by its own agreement), its
    forward timed as a wait (nothing hides it): a :class:`Fetched`. Collective over the
    group."""

    def fetch() -> tuple[torch.Tensor, torch.Tensor]:
        return halo_strips(x, before, after, dim, boundary=boundary, group=group)

    low, high = _timed_wait(fetch)
    return Fetched(low, high, dim % x.dim())


def start_overlapped_axes(
    x: torch.Tensor, axes: Sequence[tuple[Widths, Widths, int, Any, Any, Any]]
) -> tuple[torch.Tensor, list[Overlapped]]:
    """:func:`start_overlapped` along each cut dim of a block at once: ``axes`` holds the
    arguments ``(before, after, dim, spec, boundary, group)`` of each (every fetch is agreed,
    then all are posted). ``band`` carries one node for all of them: its backward, which runs
    after every use of the band, completes each dim's accumulate. Collective over each group;
    every rank calls ``windows`` once on each record."""
    records = []
    for before, after, dim, spec, boundary, group in axes:
        op = _resolve(x, before, after, dim, spec, None, boundary, group, -1, True)
        low, high = op.layout.rows  # this rank's widths: the strips' rows
        records.append(Overlapped(op, x.size(op.dim), low, high))
    return _call(_Posted, x, tuple(records)), records


class _Posted(torch.autograd.Function):
    """Posts the fetch of each record; identity on the band. Backward: the band's gradient,
    plus the rows the windows read from it, plus the peers' halo gradients (waited for here,
    last, dim after dim)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, records: tuple[Overlapped, ...]) -> torch.Tensor:
        for record in records:
            record.started = _start_fetch(record.op, x)
            record.number = record.started[3]
        ctx.records = records
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        out = g.clone(memory_format=torch.contiguous_format)
        for record in ctx.records:
            if record.accumulating is None:  # no window used: the strips' gradients are 0
                widths = (record.before, record.after)
                zero = [g.new_zeros(record.op.rows(g.shape, r)) for r in widths]
                record.accumulating = start_accumulate(record.op, zero, record.number)
        for record in ctx.records:
            d = record.op.dim
            for row, ge in record.edges:
                out.narrow(d, row, ge.size(d)).add_(ge)
            _timed_wait(finish_accumulate, record.op, record.accumulating, out)
            record.accumulating, record.edges = None, []
        return out, None


class _Arrived(torch.autograd.Function):
    """Waits for the strips; the windows of the extended band. Backward: starts sending the
    strips' gradients to their owners and keeps the band rows' for :class:`_Posted`."""

    @staticmethod
    def forward(
        ctx: Any, band: torch.Tensor, record: Overlapped, spans: tuple[tuple[int, int], ...]
    ) -> Any:
        started, record.started = record.started, None
        assert started is not None
        low, high = _timed_wait(_finish_fetch, record.op, band, started)
        ctx.record, ctx.spans = record, spans
        ctx.shapes = (low.shape, high.shape)
        return tuple(_windows(low, band, high, record.op.dim, spans))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *gs: torch.Tensor) -> Any:
        record: Overlapped = ctx.record
        d, b, n = record.op.dim, record.before, record.rows
        g_low = gs[0].new_zeros(ctx.shapes[0])
        g_high = gs[0].new_zeros(ctx.shapes[1])
        edges = []
        for (lo, hi), g in zip(ctx.spans, gs, strict=True):
            for dst, at, s, e in _cut(lo, hi, ((g_low, 0), (None, b), (g_high, b + n)), d):
                piece = g.narrow(d, s - lo, e - s)
                if dst is None:  # rows of the band: added to its gradient by _Posted
                    edges.append((s - b, piece))
                else:
                    dst.narrow(d, s - at, e - s).add_(piece)
        record.edges = edges
        record.accumulating = start_accumulate(record.op, [g_low, g_high], record.number)
        return None, None, None


def _windows(
    low: torch.Tensor,
    band: torch.Tensor,
    high: torch.Tensor,
    d: int,
    spans: Sequence[tuple[int, int]],
) -> list[torch.Tensor]:
    """Rows ``[lo, hi)`` of the extended band (``low``, ``band``, ``high`` end to end along
    ``d``) for each span, one new tensor each."""
    b, n = low.size(d), band.size(d)
    return [
        torch.cat(
            [
                src.narrow(d, s - at, e - s)
                for src, at, s, e in _cut(lo, hi, ((low, 0), (band, b), (high, b + n)), d)
            ],
            d,
        )
        for lo, hi in spans
    ]


def _cut(
    lo: int, hi: int, regions: Sequence[tuple[Any, int]], d: int
) -> list[tuple[Any, int, int, int]]:
    """``(source, its first row, first, stop)`` for each of the regions (low strip, band, high
    strip, laid end to end from row 0 of the extended band) that rows ``[lo, hi)`` meet."""
    out = []
    ends = [at for _, at in regions[1:]] + [None]
    for (src, at), end in zip(regions, ends, strict=True):
        stop = hi if end is None else min(hi, end)
        start = max(lo, at)
        if start < stop:
            out.append((src, at, start, stop))
    return out
