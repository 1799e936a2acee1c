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

from mpidp.collectives import repartition
from mpidp.errors import ConfigError
from mpidp.layers.base import DomainParallel, learn_spec
from mpidp.layers.registry import register_layer

__all__ = ["DomainParallelPixelShuffle", "DomainParallelPixelUnshuffle"]


class DomainParallelPixelShuffle(DomainParallel, nn.PixelShuffle):
    """:class:`torch.nn.PixelShuffle` on bands of H (dim -2). Collective over the domain
    group."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)
        r = self.upscale_factor
        t = self._transport(x)
        spec = learn_spec(x, x.dim() - 2, t)
        y = F.pixel_shuffle(x, r)
        shuffled = [r * n for n in spec]
        return repartition(y, shuffled, self._out_spec(r * spec.total), -2, group=t)


class DomainParallelPixelUnshuffle(DomainParallel, nn.PixelUnshuffle):
    """:class:`torch.nn.PixelUnshuffle` on bands of H (dim -2). Collective over the domain
    group."""

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
        return F.pixel_unshuffle(grouped, r)

register_layer(nn.PixelShuffle, DomainParallelPixelShuffle)
register_layer(nn.PixelUnshuffle, DomainParallelPixelUnshuffle)
