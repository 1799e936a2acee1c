"""PixelShuffle and PixelUnshuffle on bands.

``PixelShuffle(r)`` turns input row ``h`` into output rows ``h r .. h r + r - 1``: local. A rank
shuffles its own rows, then the rows move from that cut (``r`` times the input's) to the
manager's policy of the output height (:func:`mpidp.repartition`: only rows that change owner
travel; none when the two cuts agree). ``PixelUnshuffle(r)`` needs whole groups of ``r`` input
rows: the input moves first to ``r`` times the policy's cut of the output height, then each
rank unshuffles its own rows. Under :class:`mpidp.Aligned` policies whose cuts line up, no
rows move at all. On latitude x longitude blocks the columns move the same way, over the
longitude row's ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mpidp.errors import ConfigError
from mpidp.layers.base import DomainParallel, band_forward, learn_spec
from mpidp.layers.registry import register_layer
from mpidp.ops.collectives import repartition

__all__ = ["DomainParallelPixelShuffle", "DomainParallelPixelUnshuffle", "shuffle", "unshuffle"]


def shuffle(x: torch.Tensor, r: int) -> torch.Tensor:
    """``F.pixel_shuffle(x, r)``; an empty band (no rows here) as the reshape torch's op is,
    whose backward keeps the shape (torch's own returns the gradient of an empty output
    unchanged, of the wrong shape)."""
    if x.numel():
        return F.pixel_shuffle(x, r)
    *lead, c, h, w = x.shape
    y = x.reshape(*lead, c // (r * r), r, r, h, w).movedim((-4, -3), (-3, -1))
    return y.reshape(*lead, c // (r * r), h * r, w * r)


def unshuffle(x: torch.Tensor, r: int) -> torch.Tensor:
    """``F.pixel_unshuffle(x, r)``, an empty band as a reshape (see :func:`shuffle`)."""
    if x.numel():
        return F.pixel_unshuffle(x, r)
    *lead, c, h, w = x.shape
    y = x.reshape(*lead, c, h // r, r, w // r, r).movedim((-3, -1), (-4, -3))
    return y.reshape(*lead, c * r * r, h // r, w // r)


class DomainParallelPixelShuffle(DomainParallel, nn.PixelShuffle):
    """:class:`torch.nn.PixelShuffle` on bands of H (dim -2), or blocks of H and W. Collective
    over the domain group."""

    dry_run = True  # listed by validate_sharding_constraints and mpidp plan
    on_blocks = True  # per cut axis: the rows, and on blocks the columns too

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)
        r = self.upscale_factor
        axes = self._axes(x)
        specs = [learn_spec(x, axis.dim, axis.transport) for axis in axes]
        y = shuffle(x, r)
        for axis, spec in zip(axes, specs, strict=True):
            out_spec = self._out_spec(r * spec.total, axis.transport)
            y = repartition(y, [r * n for n in spec], out_spec, axis.dim, group=axis.transport)
        return y


class DomainParallelPixelUnshuffle(DomainParallel, nn.PixelUnshuffle):
    """:class:`torch.nn.PixelUnshuffle` on bands of H (dim -2), or blocks of H and W.
    Collective over the domain group."""

    dry_run = True  # listed by validate_sharding_constraints and mpidp plan
    on_blocks = True

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)
        r = self.downscale_factor
        axes = self._axes(x)
        specs = [learn_spec(x, axis.dim, axis.transport) for axis in axes]
        odd = [
            (axis.dim - x.dim(), spec.total)
            for axis, spec in zip(axes, specs, strict=True)
            if spec.total % r
        ]
        if odd:
            raise ConfigError(
                f"rank {self._manager().rank}: PixelUnshuffle({r}) of (dim, length) {odd}: "
                f"the cut dims must be multiples of {r} (as torch requires)"
            )
        y = x
        for axis, spec in zip(axes, specs, strict=True):
            out_spec = self._out_spec(spec.total // r, axis.transport)
            y = repartition(y, spec, [r * n for n in out_spec], axis.dim, group=axis.transport)
        return unshuffle(y, r)


register_layer(nn.PixelShuffle, DomainParallelPixelShuffle)
register_layer(nn.PixelUnshuffle, DomainParallelPixelUnshuffle)
