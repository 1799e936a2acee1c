"""PixelShuffle and PixelUnshuffle on bands.

``PixelShuffle(r)`` turns input row ``h`` into output rows ``h r .. h r + r - 1``: local. A rank
shuffles its own rows, then the rows move from that cut (``r`` times the input's) to the
manager's policy of the output height (:func:`mpidp.repartition`: only rows that change owner
travel; none when the two cuts agree). ``PixelUnshuffle(r)`` needs whole groups of ``r`` input
rows: the input moves first to ``r`` times the policy's cut of the output height, then each
rank unshuffles its own rows. Under :class:`mpidp.Aligned` policies whose cuts line up, no
rows move at all.
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
    """:class:`torch.nn.PixelShuffle` on bands of H (dim -2). Collective over the domain
    group."""

    dry_run = True  # listed by validate_sharding_constraints and mpidp plan

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)
        r = self.upscale_factor
        t = self._transport(x)
        spec = learn_spec(x, x.dim() - 2, t)
        y = shuffle(x, r)
        shuffled = [r * n for n in spec]
        return repartition(y, shuffled, self._out_spec(r * spec.total), -2, group=t)


class DomainParallelPixelUnshuffle(DomainParallel, nn.PixelUnshuffle):
    """:class:`torch.nn.PixelUnshuffle` on bands of H (dim -2). Collective over the domain
    group."""

    dry_run = True  # listed by validate_sharding_constraints and mpidp plan

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)
        r = self.downscale_factor
        t = self._transport(x)
        spec = learn_spec(x, x.dim() - 2, t)
        if spec.total % r:
            raise ConfigError(
                f"rank {t.rank}: PixelUnshuffle({r}) of {spec.total} rows: the height must be a "
                f"multiple of {r} (as torch requires)"
            )
        out_spec = self._out_spec(spec.total // r)
        grouped = repartition(x, spec, [r * n for n in out_spec], -2, group=t)
        return unshuffle(grouped, r)


register_layer(nn.PixelShuffle, DomainParallelPixelShuffle)
register_layer(nn.PixelUnshuffle, DomainParallelPixelUnshuffle)
