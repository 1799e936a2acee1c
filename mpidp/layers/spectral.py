"""Domain-parallel forms of the spectral models' modules (mpidp.models): the serial forward code
runs unchanged, with its FFT hooks answered by mpidp.fft, position embeddings sliced to the band
and a patch head whose rows move to the manager's partition.

A spectral filter learns the partition of its input once per call (one all-gather of one
integer), passes it to both transforms and gives its output the same partition, so the skip
``filter(x) + x`` adds rows that match. Two all-to-alls per filter.
"""

from __future__ import annotations

from typing import Any

import torch

from mpidp import fft as mfft
from mpidp.collectives import repartition
from mpidp.layers.base import DomainParallel, band_forward, learn_spec
from mpidp.layers.registry import register_layer
from mpidp.models import AFNOFilter, PatchRecovery, PositionEmbedding, SpectralConv2d
from mpidp.partition import ShardSpec

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
    go through mpidp.fft on the domain group. Collective over the domain group."""

    fft_dims: tuple[int, int]
    _rows: ShardSpec | None = None

    def input_band_dim(self) -> int:
        first = self.fft_dims[0]
        return first if first < 0 else first - 4  # (B, h, w, C) tokens: rows are dim 1

    @band_forward
    def forward(self, x: torch.Tensor) -> Any:
        if self._alone():
            return super().forward(x)  # type: ignore[misc]
        self._rows = learn_spec(x, self.fft_dims[0] % x.dim(), self._transport(x))
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
        manager = self._manager()
        return mfft.irfft2(
            X,
            s=s,
            dim=self.fft_dims,
            norm="ortho",
            manager=manager,
            spec=mfft.mode_spec(s[1] // 2 + 1, manager=manager),
            out_spec=self._rows if s[0] == self._rows.total else None,
            shard_dim=self.fft_dims[0],
        )

    def _modes(self, X: torch.Tensor) -> slice:
        if self._rows is None:
            return super()._modes(X)  # type: ignore[misc]
        return mfft.modes(X)


class DomainParallelAFNOFilter(SpectralBands, AFNOFilter):
    """:class:`mpidp.models.AFNOFilter` on bands of its channels-last (B, h, w, C) tokens: the
    block MLP and the mode mask act on this rank's W modes, by global mode number."""


class DomainParallelSpectralConv2d(SpectralBands, SpectralConv2d):
    """:class:`mpidp.models.SpectralConv2d` on bands: this rank's W modes meet the weights of
    the same global modes; a rank that holds no kept mode still joins both exchanges."""


class DomainParallelPositionEmbedding(DomainParallel, PositionEmbedding):
    """The band's rows of the learned embedding (channels-last (B, h, w, C): rows are dim 1).
    The gradient of the other rows is zero here; the domain sum of gradients completes it."""

    def input_band_dim(self) -> int:
        return -3

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)
        t = self._transport(x)
        rows = learn_spec(x, 1, t)
        return x + self.weight[:, rows.start(t.rank) : rows.stop(t.rank)]


class DomainParallelPatchRecovery(DomainParallel, PatchRecovery):
    """The linear un-patching head on a band of token rows: each token row becomes ``patch``
    pixel rows here, then the rows move to the manager's partition of the output height (only
    the boundary rows travel)."""

    def input_band_dim(self) -> int:
        return -3

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)
        t = self._transport(x)
        tokens = learn_spec(x, 1, t)
        y = super().forward(x)
        pixels = [self.patch * n for n in tokens]
        return repartition(y, pixels, self._out_spec(sum(pixels)), -2, group=t)


for _t, _l in (
    (AFNOFilter, DomainParallelAFNOFilter),
    (SpectralConv2d, DomainParallelSpectralConv2d),
    (PositionEmbedding, DomainParallelPositionEmbedding),
    (PatchRecovery, DomainParallelPatchRecovery),
):
    register_layer(_t, _l)
