"""Convolutions and transposed convolutions on a band.

A convolution's output row reads input rows the neighbours own. The layer learns the input
partition (one small all-gather), takes the output partition from the manager's policy
applied to the output length, asks :func:`mpidp.input_ranges` which input rows its output rows
need, fetches them with :func:`mpidp.halo_exchange` (the padding beyond the field filled by
the halo boundary that matches ``padding_mode``) and runs the torch convolution without padding
along the sharded dim. The other spatial dims are padded locally exactly as torch pads them.
On latitude x longitude blocks the longitude is a cut dim too: the same steps run per cut dim
(:meth:`~mpidp.layers.base.DomainParallel._axes`) and one block halo exchange fetches both.

A transposed convolution scatters input rows into output rows: the layer fetches the input rows
whose scatter reaches its output rows, runs the torch layer without padding along the sharded
dim and cuts its own output rows out of the result (rows nothing reaches hold the bias alone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mpidp.comm import Transport
from mpidp.errors import ConfigError
from mpidp.layers.base import (
    Axis,
    DomainParallel,
    band_forward,
    fetch_halo,
    learn_spec,
    with_rows,
)
from mpidp.layers.registry import register_layer
from mpidp.ops.bands import _BANDS, _NOTES
from mpidp.ops.geometry import HaloSpec, conv_output_size, input_ranges, padding_pair
from mpidp.ops.halo import halo_exchange
from mpidp.ops.halo_overlap import Fetched, Overlapped, fetch_strips, start_overlapped_axes
from mpidp.runtime.partition import ShardSpec, known_for

__all__ = [
    "DomainParallelConv1d",
    "DomainParallelConv2d",
    "DomainParallelConv3d",
    "DomainParallelConvTranspose1d",
    "DomainParallelConvTranspose2d",
    "DomainParallelConvTranspose3d",
]

# padding_mode of a torch conv -> the halo boundary that fills the rows beyond the field
_BOUNDARY = {
    "zeros": "zeros",
    "reflect": "reflect",
    "replicate": "replicate",
    "circular": "circular",
}
# ... and F.pad's name for the same padding of the dims that are not sharded
_FPAD = {
    "zeros": "constant",
    "reflect": "reflect",
    "replicate": "replicate",
    "circular": "circular",
}

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def conv_kernel(n: int, padding: tuple[int, ...]) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The torch convolution of an ``n``-d layer with ``padding``, as a kept call runs it
    (:class:`~mpidp.layers.base.Repeat`): the layer's weight, bias, stride, dilation and
    groups read at each call."""
    conv = _CONV[n]

    def kernel(layer: Any, ext: torch.Tensor) -> torch.Tensor:
        p = layer._parameters  # (nn.Module's attribute lookup: a Python call each)
        w, b = p.get("weight"), p.get("bias")
        if w is None:  # not a parameter: a parametrization's, weight norm's
            w = layer.weight
        if b is None and "bias" not in p:
            b = layer.bias
        return conv(ext, w, b, layer.stride, padding, layer.dilation, layer.groups)

    return kernel


def _spatial(layer: nn.Module, x: torch.Tensor, n: int, shard_dim: int) -> tuple[int, int]:
    """(tensor dim, spatial index) of the sharded dim for an ``n``-d layer."""
    if x.dim() not in (n + 1, n + 2):
        raise ConfigError(
            f"{type(layer).__name__} expects a {n + 1}-d or {n + 2}-d input, got shape "
            f"{tuple(x.shape)}"
        )
    if not -n <= shard_dim < 0:
        raise ConfigError(
            f"{type(layer).__name__}: shard_dim {shard_dim} is not one of its {n} spatial dims "
            f"(-{n} .. -1)"
        )
    return x.dim() + shard_dim, n + shard_dim


def _pads(padding: str | Sequence[int], kernel: Sequence[int], dilation: Sequence[int]):
    """Per spatial dim (low, high) padding, torch's rule for 'same' (extra row at the end)."""
    if isinstance(padding, str):
        return [padding_pair(padding, k, 1, d) for k, d in zip(kernel, dilation, strict=True)]
    return [(p, p) for p in padding]


class _Conv(DomainParallel):
    """The forward shared by Conv1d/2d/3d (``self`` is also the torch conv)."""

    dry_run = True  # listed by validate_sharding_constraints and mpidp plan

    @classmethod
    def geometry(cls, module: Any, k: int) -> tuple[int, int, tuple[int, int], int] | None:
        ks, dil = module.kernel_size[k], module.dilation[k]
        pad = module.padding
        pair = padding_pair(pad, ks, 1, dil) if isinstance(pad, str) else (pad[k], pad[k])
        return ks, module.stride[k], pair, dil

    @classmethod
    def boundary_of(cls, module: Any) -> str:
        """What fills the rows beyond the field: the padding mode."""
        mode = getattr(module, "padding_mode", "zeros")
        return mode if mode in ("zeros", "reflect", "replicate", "circular") else "zeros"

    _n: int

    def _geometry(
        self, spec: ShardSpec, k: int, pads: tuple[int, int], t: Transport
    ) -> tuple[ShardSpec, HaloSpec]:
        """The output partition and the halo of spatial dim ``k`` for an input cut by
        ``spec``: kept by their arguments and the manager's partition policy (outside a
        ShardedTensor call, whose notes :meth:`_out_spec` makes)."""
        conv: nn.modules.conv._ConvNd = self  # type: ignore[assignment]
        kernel, stride, dil = conv.kernel_size[k], conv.stride[k], conv.dilation[k]
        policy = self._manager().partition
        key: Any = (spec, k, pads, t.size, kernel, stride, dil, policy)
        kept: dict[Any, tuple[ShardSpec, HaloSpec]] = self.__dict__.setdefault("_geometries", {})
        try:
            found = None if _NOTES.get() is not None else kept.get(key)
        except TypeError:  # a policy that is not a plain value: derived afresh
            key, found = None, None
        if found is not None:
            return found
        n_out = conv_output_size(spec.total, kernel, stride, pads, dil)
        out_spec = self._out_spec(n_out, t)
        found = (out_spec, HaloSpec.for_layer(spec, out_spec, kernel, stride, pads, dil))
        if key is not None:
            if len(kept) > 64:
                kept.clear()
            kept[key] = found
        return found

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self._manager_if_cut()
        if m is None:
            return super().forward(x)  # type: ignore[misc]
        conv: nn.modules.conv._ConvNd = self  # type: ignore[assignment]
        known = known_for(x, x.dim() + self.shard_dim)
        key, y = self._repeated(
            m,
            x,
            known and known.sizes,
            conv.kernel_size,
            conv.stride,
            conv.padding,
            conv.dilation,
            conv.padding_mode,
        )
        if y is not None:
            return y
        _spatial(conv, x, self._n, self.shard_dim)
        first = x.dim() - self._n  # the tensor dim of the first spatial dim
        pads = _pads(conv.padding, conv.kernel_size, conv.dilation)
        boundary = _BOUNDARY[conv.padding_mode]
        axes = self._axes(x)  # the sharded dim, and on blocks the longitude too
        overlap = self._manager().overlap
        ext, guess, fetched = None, None, None
        if len(axes) == 1 and known_for(x, axes[0].dim) is None and not _BANDS.get():
            # bands, the partition unknown: the halo's own agreement learns it (no all-gather
            # of its own), with the widths of an output cut as its input is; when the output
            # is cut otherwise (every rank learns the same partition), the right halo follows.
            # With the overlap on, the strips alone: the same first exchange, whose agreement
            # refuses ranks whose overlap differs
            axis = axes[0]
            k = axis.dim - first
            ks, dil, (lo, hi) = conv.kernel_size[k], conv.dilation[k], pads[k]
            if conv.stride[k] == 1 and lo + hi == dil * (ks - 1):
                guess, t = ({lo}, {hi}), axis.transport
                if overlap:
                    fetched = fetch_strips(x, lo, hi, axis.dim, boundary, t)
                else:
                    ext = halo_exchange(x, lo, hi, axis.dim, boundary=boundary, group=t)
        cuts, outs = [], []
        for axis in axes:
            k = axis.dim - first
            spec = known_for(x, axis.dim)  # the partition the halo just learned, if it did
            if spec is None:
                spec = learn_spec(x, axis.dim, axis.transport)
            out_spec, halo = self._geometry(spec, k, pads[k], axis.transport)
            cuts.append((axis, spec, halo))
            kernel, dil = conv.kernel_size[k], conv.dilation[k]
            outs.append((axis, out_spec, dil * (kernel - 1) + 1))
            pads[k] = (0, 0)
        right = guess == (set(cuts[0][2].before), set(cuts[0][2].after))
        if overlap and all(_overlappable(c[1], o[1]) for c, o in zip(cuts, outs, strict=True)):
            got = fetched if right else None
            return self._overlapped(x, cuts, [o for _, o, _ in outs], pads, boundary, got)
        if fetched is not None and right:
            ext = torch.cat([fetched.low, x, fetched.high], fetched.dim)
        if ext is None or not right:
            ext = fetch_halo(self, x, cuts, boundary)
        rows = ext.size(outs[0][0].dim)
        for axis, _, need in outs:
            ext = with_rows(ext, axis.dim, need)  # a rank without output rows
        y = self._run(ext, pads)
        computed = y.size(outs[0][0].dim)
        for axis, out_spec, _ in outs:
            y = y.narrow(axis.dim, 0, out_spec.sizes[axis.transport.rank])
        if key is not None and known is not None and len(cuts) == 1:
            flat, mode, padding = self._kernel(pads)
            mine = outs[0][1].sizes[cuts[0][0].transport.rank]
            self._keep_repeat(
                key,
                x,
                cuts[0],
                boundary,
                need=outs[0][2] if rows < outs[0][2] else 0,
                notes=(("spec", outs[0][1]),),
                pad=None if flat is None else (flat, mode),
                kernel=conv_kernel(self._n, tuple(padding)),
                rows=None if computed == mine else mine,
            )
        return y

    def _kernel(self, pads: list[tuple[int, int]]) -> tuple[list[int] | None, str, list[int]]:
        """How :meth:`_run` pads before the torch convolution: (F.pad's widths, or None for
        none, its mode, the convolution's own padding per spatial dim)."""
        conv: nn.modules.conv._ConvNd = self  # type: ignore[assignment]
        mode = _FPAD[conv.padding_mode]
        if conv.padding_mode == "zeros" and all(lo == hi for lo, hi in pads):
            return None, mode, [lo for lo, _ in pads]
        flat = [p for lo_hi in reversed(pads) for p in lo_hi]
        return (flat if any(flat) else None), mode, [0] * self._n

    def _run(
        self, x: torch.Tensor, pads: list[tuple[int, int]], zeros: dict[int, int] | None = None
    ) -> torch.Tensor:
        """The torch convolution of ``x`` padded by ``pads`` (per spatial dim, as torch pads),
        and along each spatial dim ``k`` of ``zeros`` by ``zeros[k]`` zero rows at each end
        (the convolution's own padding: no copy of ``x``)."""
        conv: nn.modules.conv._ConvNd = self  # type: ignore[assignment]
        flat, mode, padding = self._kernel(pads)
        if flat is not None:
            x = F.pad(x, flat, mode=mode)
        for k, rows in (zeros or {}).items():
            padding[k] += rows
        return _CONV[self._n](
            x, conv.weight, conv.bias, conv.stride, tuple(padding), conv.dilation, conv.groups
        )

    def _overlapped(
        self,
        x: torch.Tensor,
        cuts: list[tuple[Axis, ShardSpec, HaloSpec]],
        out_specs: list[ShardSpec],
        pads: list[tuple[int, int]],
        boundary: str,
        fetched: Fetched | None = None,
    ) -> torch.Tensor:
        """The forward with the halo in flight while the interior is computed (or, on bands,
        with the strips ``fetched`` already: the same computation).

        Outputs whose window lies inside the band (rows and, on blocks, columns) come from
        one convolution of the band itself (zero rows beyond it: the outputs those reach are
        recomputed). Once the halo has arrived (:mod:`mpidp.ops.halo_overlap`), the first and
        last output rows come from windows of the extended band (on blocks extended along the
        longitude too, corners included), and on blocks the first and last columns of the
        interior rows from windows of the band extended along the longitude; each is written
        over the interior's result."""
        cut = [_Cut.of(self, x, c, o) for c, o in zip(cuts, out_specs, strict=True)]
        records: list[Any]
        if fetched is not None:
            band, records = x, [fetched]
        else:
            band, records = start_overlapped_axes(
                x, [(c.fetch[0], c.fetch[1], c.d, c.spec, boundary, c.t) for c in cut]
            )
        lat, lon = cut[0], cut[1] if len(cut) > 1 else None
        y = None
        if all(c.stop > c.first for c in cut):  # the interior: the same row offsets
            y = self._run(band, pads, {c.k: c.b + c.lift * c.s for c in cut})
            for c in cut:
                y = y.narrow(c.d, c.lift, c.m)
        rows = records[0].windows(band, lat.spans(records[0]))
        if lon is not None and rows:  # their columns beyond the block: the corners
            w = torch.cat(rows, lat.d) if len(rows) > 1 else rows[0]
            w = records[1].across(w, lon.window(records[1], 0, lon.m))
            rows = list(w.split([r.size(lat.d) for r in rows], lat.d))
        edges = [self._run(r, pads) for r in rows]  # the first and last output rows
        sides: list[torch.Tensor] = []  # the first and last columns of the interior rows
        if lon is not None:
            mid = lat.stop > lat.first
            cols = records[1].windows(band, lon.spans(records[1]) if mid else [])
            lo = lat.first * lat.s - lat.b  # the band rows the interior rows read
            n = (lat.stop - lat.first - 1) * lat.s + lat.span
            sides = [self._run(c.narrow(lat.d, lo, n), pads) for c in cols]
        if y is None:  # no interior along some dim: the edges laid end to end
            if sides:
                edges.insert(1 if lat.first > 0 else 0, torch.cat(sides, lon.d))  # type: ignore[union-attr]
            return edges[0] if len(edges) == 1 else torch.cat(edges, lat.d)
        if lon is not None:
            inner = y.narrow(lat.d, lat.first, lat.stop - lat.first)
            lon.write(inner, sides)
        lat.write(y, edges)
        return y


@dataclasses.dataclass
class _Cut:
    """The overlapped convolution's geometry along one cut dim ``d`` (spatial dim ``k``):
    output rows ``[first, stop)`` read no halo row; the edge rows before and after them read
    the extended band. ``b``, ``a``: this rank's halo widths (negative: rows the outputs do
    not read); ``fetch``: every rank's widths fetched."""

    d: int
    k: int
    s: int
    span: int
    n: int
    m: int
    b: int
    a: int
    spec: ShardSpec
    t: Transport
    fetch: tuple[tuple[int, ...], tuple[int, ...]]

    @classmethod
    def of(
        cls, conv: Any, x: torch.Tensor, cut: tuple[Axis, ShardSpec, HaloSpec], out: ShardSpec
    ) -> _Cut:
        axis, spec, halo = cut
        d, me = axis.dim, axis.transport.rank
        k = d - (x.dim() - conv._n)
        span = conv.dilation[k] * (conv.kernel_size[k] - 1) + 1
        # a trimming width fetches no row
        fetch = (tuple(max(w, 0) for w in halo.before), tuple(max(w, 0) for w in halo.after))
        b, a = halo.before[me], halo.after[me]
        m = out.sizes[me]
        return cls(d, k, conv.stride[k], span, x.size(d), m, b, a, spec, axis.transport, fetch)

    @property
    def first(self) -> int:
        """The first output row that reads no low halo row."""
        return min(self.m, max(0, -(-self.b // self.s)))

    @property
    def stop(self) -> int:
        """The output row after the last that reads no high halo row (>= first)."""
        return max(self.first, min(self.m, (self.b + self.n - self.span) // self.s + 1))

    @property
    def lift(self) -> int:
        """Output rows more above the interior's convolution of the band (zero rows padded:
        ``b + lift * s`` each end) gives, so that ``m`` rows follow them."""
        return -(-max(0, self.a - self.b, -self.b) // self.s)

    def window(self, record: Overlapped | Fetched, lo: int, hi: int) -> tuple[int, int]:
        """The rows of the extended band (row 0: the first fetched) output rows ``[lo, hi)``
        read: output row i reads the band's rows ``[i s - b, i s - b + span)``."""
        o = record.before - self.b
        return o + lo * self.s, o + (hi - 1) * self.s + self.span

    def spans(self, record: Overlapped | Fetched) -> list[tuple[int, int]]:
        """The windows of the edge output rows: before ``first``, from ``stop``."""
        out = [self.window(record, 0, self.first)] if self.first > 0 else []
        return out + ([self.window(record, self.stop, self.m)] if self.stop < self.m else [])

    def write(self, y: torch.Tensor, edges: list[torch.Tensor]) -> None:
        """The edge rows' results over the interior's (``edges`` in the order of :meth:`spans`)."""
        if self.first > 0:
            y.narrow(self.d, 0, self.first).copy_(edges[0])
        if self.stop < self.m:
            y.narrow(self.d, self.stop, self.m - self.stop).copy_(edges[-1])


def _overlappable(spec: ShardSpec, out_spec: ShardSpec) -> bool:
    """Whether the overlapped forward serves this cut: no empty band or output (the blocking
    one runs a layer on those). The same answer on every rank (global facts only)."""
    return min(spec.sizes) > 0 and min(out_spec.sizes) > 0


class DomainParallelConv1d(_Conv, nn.Conv1d):
    """:class:`torch.nn.Conv1d` sharded along its length (``shard_dim=-1``)."""

    _n = 1
    shard_dim = -1


class DomainParallelConv2d(_Conv, nn.Conv2d):
    """:class:`torch.nn.Conv2d` sharded along H (on blocks along H and W). Collective over
    the domain group."""

    _n = 2
    on_blocks = True


class DomainParallelConv3d(_Conv, nn.Conv3d):
    """:class:`torch.nn.Conv3d` sharded along H of (B, C, T, H, W) (on blocks along H and W).
    Collective."""

    _n = 3
    on_blocks = True


class _ConvTranspose(DomainParallel):
    """The forward shared by ConvTranspose1d/2d/3d (``self`` is also the torch layer)."""

    dry_run = True  # listed by validate_sharding_constraints and mpidp plan

    @classmethod
    def halo_of(
        cls, module: Any, spec_in: ShardSpec, spec_out: ShardSpec, k: int, n_in: int, n: int
    ) -> tuple[tuple[int, ...], tuple[int, ...], str] | None:
        ranges = input_ranges(
            spec_in,
            spec_out,
            module.kernel_size[k],
            module.stride[k],
            module.padding[k],
            module.dilation[k],
            transposed=True,
            output_padding=module.output_padding[k],
        )
        halo = HaloSpec.from_ranges(spec_in, ranges)
        return halo.before, halo.after, "none"

    _n: int

    @band_forward
    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        conv: nn.modules.conv._ConvTransposeNd = self  # type: ignore[assignment]
        if output_size is not None:
            raise ConfigError(
                f"rank {self._manager().rank}: {type(self).__name__}: output_size= is not "
                f"supported on bands; set "
                f"output_padding on the layer instead"
            )
        if self._alone():
            return super().forward(x)  # type: ignore[misc]
        _spatial(conv, x, self._n, self.shard_dim)
        first_dim = x.dim() - self._n  # the tensor dim of the first spatial dim
        padding = [int(p) for p in conv.padding]  # ints for transposed layers
        output_padding = list(conv.output_padding)
        cuts, outs = [], []
        for axis in self._axes(x):  # the sharded dim, and on blocks the longitude too
            k, r = axis.dim - first_dim, axis.transport.rank
            spec = learn_spec(x, axis.dim, axis.transport)
            kernel, stride, dil = conv.kernel_size[k], conv.stride[k], conv.dilation[k]
            pad, out_pad = padding[k], output_padding[k]
            geometry = dict(transposed=True, output_padding=out_pad)
            n_out = conv_output_size(spec.total, kernel, stride, pad, dil, **geometry)  # type: ignore[arg-type]
            out_spec = self._out_spec(n_out, axis.transport)
            ranges = input_ranges(spec, out_spec, kernel, stride, pad, dil, **geometry)  # type: ignore[arg-type]
            cuts.append((axis, spec, HaloSpec.from_ranges(spec, ranges)))
            # output row o of the serial layer is row o + pad - lo * stride of y
            outs.append((axis, out_spec.start(r) + pad - ranges[r][0] * stride, out_spec.sizes[r]))
            padding[k] = output_padding[k] = 0
        ext = fetch_halo(self, x, cuts, "none")
        for axis, _, _ in outs:
            ext = with_rows(ext, axis.dim, 1)  # no input may reach this rank's rows: a zero row
        y = _CONV_T[self._n](
            ext,
            conv.weight,
            None,
            conv.stride,
            tuple(padding),
            tuple(output_padding),
            conv.groups,
            conv.dilation,
        )
        for axis, first, count in outs:
            y = _rows(y, axis.dim, first, count)
        if conv.bias is not None:
            y = y + conv.bias.view(-1, *([1] * self._n))
        return y


def _rows(y: torch.Tensor, dim: int, first: int, count: int) -> torch.Tensor:
    """Rows ``[first, first + count)`` of ``y`` along ``dim``, zeros where ``y`` has none."""
    n = y.size(dim)
    lo = min(max(first, 0), n)
    hi = max(min(first + count, n), lo)
    before = max(0, min(count, -first))
    after = count - before - (hi - lo)
    part = y.narrow(dim, lo, hi - lo)
    if before == 0 and after == 0:
        return part

    def zeros(rows: int) -> torch.Tensor:
        shape = list(y.shape)
        shape[dim] = rows
        return y.new_zeros(shape)

    return torch.cat([zeros(before), part, zeros(after)], dim)


class DomainParallelConvTranspose1d(_ConvTranspose, nn.ConvTranspose1d):
    """:class:`torch.nn.ConvTranspose1d` sharded along its length (``shard_dim=-1``)."""

    _n = 1
    shard_dim = -1


class DomainParallelConvTranspose2d(_ConvTranspose, nn.ConvTranspose2d):
    """:class:`torch.nn.ConvTranspose2d` sharded along H (on blocks along H and W). Collective
    over the domain group."""

    _n = 2
    on_blocks = True


class DomainParallelConvTranspose3d(_ConvTranspose, nn.ConvTranspose3d):
    """:class:`torch.nn.ConvTranspose3d` sharded along H of (B, C, T, H, W) (on blocks along H
    and W). Collective."""

    _n = 3
    on_blocks = True


for _t, _l in (
    (nn.Conv1d, DomainParallelConv1d),
    (nn.Conv2d, DomainParallelConv2d),
    (nn.Conv3d, DomainParallelConv3d),
    (nn.ConvTranspose1d, DomainParallelConvTranspose1d),
    (nn.ConvTranspose2d, DomainParallelConvTranspose2d),
    (nn.ConvTranspose3d, DomainParallelConvTranspose3d),
):
    register_layer(_t, _l)
