"""Small serial example models (plain torch): what the tests, the examples and ``mpidp plan``
convert to domain parallel. Sizes along the grid are fixed at construction, as in weather models
on a fixed grid, so no layer needs the (local) input shape to know the global one.
"""

from __future__ import annotations

import torch
from torch import nn

from mpidp.geometry import conv_output_size
from mpidp.layers.periodic import PeriodicConv2d

__all__ = ["PatchEmbedRecover", "PeriodicResBlock", "WeatherUNet"]


def _block(c_in: int, c_out: int, groups: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(groups, c_out), nn.SiLU()
    )


def _down(n: int) -> int:
    return conv_output_size(n, 3, 2, 1)


class WeatherUNet(nn.Module):
    """A two-level U-Net for a (H, W) grid: stride-2 convolutions down, a transposed convolution
    and a bilinear upsample up, GroupNorm and SiLU, skip connections; any H (odd ones too).

    ``mlp`` > 0 adds a residual pointwise MLP (1x1 convs, ``mlp`` hidden channels) at the
    bottleneck, declared for tensor parallelism (``_tp_col``/``_tp_row``)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        grid: tuple[int, int],
        width: int = 8,
        groups: int = 2,
        mlp: int = 0,
    ) -> None:
        super().__init__()
        h0, w0 = grid
        h1, w1 = _down(h0), _down(w0)
        h2, w2 = _down(h1), _down(w1)
        self.grid = grid
        self.inc = _block(in_channels, width, groups)
        self.down1 = nn.Sequential(
            nn.Conv2d(width, 2 * width, 3, 2, 1), nn.GroupNorm(groups, 2 * width), nn.SiLU()
        )
        self.down2 = nn.Sequential(
            nn.Conv2d(2 * width, 4 * width, 3, 2, 1), nn.GroupNorm(groups, 4 * width), nn.SiLU()
        )
        self.mid = None
        if mlp:
            self.mid = nn.Sequential(
                nn.Conv2d(4 * width, mlp, 1), nn.SiLU(), nn.Conv2d(mlp, 4 * width, 1)
            )
            self._tp_col, self._tp_row = ("mid.0",), ("mid.2",)
        # output_padding makes the transposed conv land exactly on the skip's size
        pad = (h1 - (2 * (h2 - 1) + 1), w1 - (2 * (w2 - 1) + 1))
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 3, 2, 1, output_padding=pad)
        self.dec2 = _block(4 * width, 2 * width, groups)
        self.up1 = nn.Sequential(
            nn.Upsample(size=(h0, w0), mode="bilinear", align_corners=False),
            nn.Conv2d(2 * width, width, 1),
        )
        self.dec1 = _block(2 * width, width, groups)
        self.head = nn.Conv2d(width, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = self.inc(x)
        x1 = self.down1(x0)
        x2 = self.down2(x1)
        if self.mid is not None:
            x2 = x2 + self.mid(x2)
        d2 = self.dec2(torch.cat([self.up2(x2), x1], 1))
        d1 = self.dec1(torch.cat([self.up1(d2), x0], 1))
        return self.head(d1)


class PeriodicResBlock(nn.Module):
    """A diffusion-style residual block on the sphere: GroupNorm, SiLU, periodic convolutions
    (across the pole), a learned per-channel scale and shift (FiLM) and the residual."""

    def __init__(self, channels: int, groups: int = 2, pole: str = "polar") -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, channels)
        self.conv1 = PeriodicConv2d(channels, channels, 3, pole=pole)
        self.film = nn.Parameter(torch.zeros(2, channels))
        self.norm2 = nn.GroupNorm(groups, channels)
        self.conv2 = PeriodicConv2d(channels, channels, 3, pole=pole)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(self.act(self.norm1(x)))
        scale, shift = self.film[0].view(1, -1, 1, 1), self.film[1].view(1, -1, 1, 1)
        h = self.norm2(h) * (1 + scale) + shift
        return x + self.conv2(self.act(h))


class PatchEmbedRecover(nn.Module):
    """A ViT-style patch embedding (stride-``patch`` convolution) and its transposed-convolution
    recovery to the input grid."""

    def __init__(self, channels: int, dim: int, grid: tuple[int, int], patch: int = 4) -> None:
        super().__init__()
        h, w = grid
        hp, wp = conv_output_size(h, patch, patch), conv_output_size(w, patch, patch)
        self.embed = nn.Conv2d(channels, dim, patch, patch)
        self.norm = nn.GroupNorm(1, dim)
        self.act = nn.GELU()
        pad = (h - patch * hp, w - patch * wp)
        self.recover = nn.ConvTranspose2d(dim, channels, patch, patch, output_padding=pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.recover(self.act(self.norm(self.embed(x))))
