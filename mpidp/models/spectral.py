"""Domain-parallel forms of the spectral models' modules (mpidp.models): the serial forward code
runs unchanged, with its FFT hooks answered by mpidp.ops.fft, position embeddings sliced to the band
and a patch head whose rows move to the manager's partition.

A spectral filter learns the partition of its input once per call (one all-gather of one
integer), passes it to both transforms and gives its output the same partition, so the skip
``filter(x) + x`` adds rows that match. Two all-to-alls per filter.

On latitude x longitude blocks the filters take this rank's block: the partition learned is its
blocks (one integer along each axis), the transforms make their pencil transpose along the
longitude row first (and last), and the spectral layout is the band one over the whole domain
group (every H frequency, the W modes cut over all ``P_lat * P_lon`` ranks), so the filter code
between the transforms is the band code: the modes truncated along H are all here, those along
W by global mode number, a rank holding no kept mode joins the exchanges with zeros. The
position embedding takes the block's rows and columns of its table, and the patch head moves
pixel rows along the latitude column and pixel columns along the longitude row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mpidp.layers.base import DomainParallel, band_forward, learn_spec
from mpidp.layers.registry import register_layer
from mpidp.models.fourier import AFNOFilter, SpectralConv2d
from mpidp.models.patch import PatchRecovery, PositionEmbedding
from mpidp.ops import fft as mfft
from mpidp.ops.collectives import repartition
from mpidp.runtime.grid import BlockSpec
from mpidp.runtime.partition import ShardSpec

__all__ = [
    "DomainParallelAFNOFilter",
    "DomainParallelPatchRecovery",
    "DomainParallelPositionEmbedding",
    "DomainParallelSpectralConv2d",
    "SpectralBands",
]


class SpectralBands(DomainParallel):
    """Mixin for a module written with the ``_rfft2`` / ``_irfft2`` / ``_modes`` hooks of
    :class:`mpidp.models.AFNOFilter` (``fft_dims``: the sharded H first, then W): the hooks
    go through mpidp.ops.fft on the domain group, on bands or blocks. Collective over the domain
    group."""

    fft_dims: tuple[int, int]
    #: the input's partition during a call: its rows (bands) or its blocks
    _rows: ShardSpec | BlockSpec | None = None
    dry_run = on_blocks = True

    @classmethod
    def modes_of(cls, module: Any, shape_in: Any, parts: int, partition: Any) -> tuple[int, ...]:
        """The W modes on each rank: the policy's cut of ``W // 2 + 1``, or a balanced cut
        with empty parts when there are fewer modes than ranks."""
        k_modes = shape_in[module.fft_dims[1]] // 2 + 1
        cut = ShardSpec.balanced(k_modes, parts, allow_empty=True)
        return tuple((cut if k_modes < parts else partition.spec(k_modes, parts)).sizes)

    @classmethod
    def transpose_bytes(cls, layer: Any, rank: int, itemsize: int) -> int:
        """rfft2's all-to-all (this rank's rows of the others' modes) and irfft2's (the
        others' rows of its modes), complex values, and their adjoints in the backward
        (irfft2's sends what rfft2's did, and the other way round): rfft2's and its adjoint
        carry the input's channels, irfft2's and its adjoint the output's."""
        h, rows, k = sum(layer.rows_in), layer.rows_in[rank], sum(layer.modes)
        mine = layer.modes[rank]
        into, out = _point_values(layer)
        return (rows * (k - mine) + (h - rows) * mine) * (into + out) * 2 * itemsize

    @classmethod
    def block_transpose_bytes(
        cls, lat: Any, lon: Any, i: int, j: int, itemsize: int, partition: Any
    ) -> int:
        """On blocks: the pencil transpose along the longitude row (the block's rows sub-cut
        over the row, each rank given its sub-cut's rows of every column; real values), then
        the band transposes over the whole domain group on those rows (the modes cut over
        every rank); each in rfft2 and back in irfft2, forward and backward."""
        p_lat, p_lon = len(lat.rows_in), len(lon.rows_in)
        d = len(lat.shape_in) + lat.dim_in
        w, cols = lat.shape_in[d + 1], lon.rows_in[j]
        # (bands: the row is one rank, which holds its rows whole, whatever the policy's
        # weights; a policy of per-rank weights cuts no group of another size)
        subs = [partition.derived(n, p_lon).sizes if p_lon > 1 else (n,) for n in lat.rows_in]
        sub = subs[i][j]
        into, out = _point_values(lat)  # rfft2's pencil carries the input, irfft2's the output
        pencil = ((lat.rows_in[i] - sub) * cols + sub * (w - cols)) * (into + out) * itemsize
        k_modes = w // 2 + 1
        rows = tuple(n for cut in subs for n in cut)  # the pencils' rows, in domain rank order
        modes = tuple(partition.derived(k_modes, p_lat * p_lon).sizes)
        band = dataclasses.replace(lat, rows_in=rows, modes=modes)
        return pencil + cls.transpose_bytes(band, i * p_lon + j, itemsize)

    def input_band_dim(self) -> int:
        first = self.fft_dims[0]
        return first if first < 0 else first - 4  # (B, h, w, C) tokens: rows are dim 1

    @band_forward
    def forward(self, x: torch.Tensor) -> Any:
        if self._alone():
            return super().forward(x)  # type: ignore[misc]
        # the transports of the cut axes (the latitude column, on blocks the longitude row too)
        # along the transformed dims, H then W
        lat, lon = (d % x.dim() for d in self.fft_dims)
        axes = zip((lat, lon), self._axes(x), strict=False)  # bands: the latitude alone
        specs = [learn_spec(x, d, a.transport) for d, a in axes]
        self._rows = specs[0] if len(specs) == 1 else BlockSpec(specs[0], specs[1], (lat, lon))
        try:
            return super().forward(x)  # type: ignore[misc]
        finally:
            self._rows = None

    def _rfft2(self, x: torch.Tensor) -> torch.Tensor:
        if self._rows is None:
            return super()._rfft2(x)  # type: ignore[misc]
        return mfft.rfft2(
            x,
            dim=self.fft_dims,
            norm="ortho",
            manager=self._manager(),
            spec=self._rows,
            shard_dim=self.fft_dims[0],
        )

    def _irfft2(self, X: torch.Tensor, s: tuple[int, int]) -> torch.Tensor:
        if self._rows is None:
            return super()._irfft2(X, s)  # type: ignore[misc]
        manager, rows = self._manager(), self._rows
        same = rows.shape == tuple(s) if isinstance(rows, BlockSpec) else rows.total == s[0]
        return mfft.irfft2(
            X,
            s=s,
            dim=self.fft_dims,
            norm="ortho",
            manager=manager,
            spec=mfft.mode_spec(s[1] // 2 + 1, manager=manager),
            out_spec=rows if same else None,
            shard_dim=self.fft_dims[0],
        )

    def _modes(self, X: torch.Tensor) -> slice:
        if self._rows is None:
            return super()._modes(X)  # type: ignore[misc]
        return mfft.modes(X)

    def _width(self, x: torch.Tensor) -> int:
        if isinstance(self._rows, BlockSpec):  # a block holds some of the columns
            return self._rows.lon.total
        return super()._width(x)  # type: ignore[misc]


class DomainParallelAFNOFilter(SpectralBands, AFNOFilter):
    """:class:`mpidp.models.AFNOFilter` on bands of its channels-last (B, h, w, C) tokens: the
    block MLP and the mode mask act on this rank's W modes, by global mode number."""

    channels_last_in = channels_last_out = True


class DomainParallelSpectralConv2d(SpectralBands, SpectralConv2d):
    """:class:`mpidp.models.SpectralConv2d` on bands: this rank's W modes meet the weights of
    the same global modes; a rank that holds no kept mode still joins both exchanges."""


class DomainParallelPositionEmbedding(DomainParallel, PositionEmbedding):
    """The band's rows (the block's rows and columns) of the learned embedding (channels-last
    (B, h, w, C): rows are dim 1, columns dim 2). The gradient of the other rows is zero here;
    the domain sum of gradients completes it."""

    dry_run = channels_last_in = channels_last_out = on_blocks = True

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)
        weight: torch.Tensor = self.weight
        for axis in self._axes(x[..., 0]):  # the grid dims: those before the channels
            cut, r = learn_spec(x, axis.dim, axis.transport), axis.transport.rank
            weight = weight.narrow(axis.dim, cut.start(r), cut.sizes[r])
        return x + weight


class DomainParallelPatchRecovery(DomainParallel, PatchRecovery):
    """The linear un-patching head on a band (a block) of tokens: each token row (column)
    becomes ``patch`` pixel rows (columns) here, then they move to the manager's partition of
    the output height (and width), along each cut axis (only the boundary rows travel)."""

    dry_run = channels_last_in = on_blocks = True

    @classmethod
    def transpose_bytes(cls, layer: Any, rank: int, itemsize: int) -> int:
        """The pixel rows this rank's tokens give that the policy's cut puts on other ranks
        (forward) and those it gets back (backward)."""
        patch = sum(layer.rows_out) // max(sum(layer.rows_in), 1)
        pixels = ShardSpec.from_sizes([patch * n for n in layer.rows_in])
        out = ShardSpec.from_sizes(layer.rows_out)
        lost = sum(
            hi - lo
            for r, lo, hi in out.overlaps(pixels.start(rank), pixels.stop(rank))
            if r != rank
        )
        gained = sum(
            hi - lo for r, lo, hi in pixels.overlaps(out.start(rank), out.stop(rank)) if r != rank
        )
        return (lost + gained) * layer.row_elements("out") * itemsize

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)
        y = super().forward(x)
        for axis in self._axes(x[..., 0]):  # token dim d of (B, h, w, C) is pixel dim d + 1
            t = axis.transport
            pixels = [self.patch * n for n in learn_spec(x, axis.dim, t)]
            y = repartition(y, pixels, self._out_spec(sum(pixels), t), axis.dim + 1, group=t)
        return y


for _t, _l in (
    (AFNOFilter, DomainParallelAFNOFilter),
    (SpectralConv2d, DomainParallelSpectralConv2d),
    (PositionEmbedding, DomainParallelPositionEmbedding),
    (PatchRecovery, DomainParallelPatchRecovery),
):
    register_layer(_t, _l)


def _point_values(layer: Any) -> tuple[int, int]:
    """The values of one grid point (batch x channels) of a spectral layer's input and of its
    output (a :class:`~mpidp.preflight.validate.LayerSharding`; W follows H in both
    layouts)."""
    d_in, d_out = len(layer.shape_in) + layer.dim_in, len(layer.shape_out) + layer.dim_out
    return (
        layer.row_elements("in") // layer.shape_in[d_in + 1],
        layer.row_elements("out") // layer.shape_out[d_out + 1],
    )
