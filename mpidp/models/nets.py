"""Small serial example networks (plain torch): what the tests, the examples and ``mpidp plan``
convert to domain parallel. Sizes along the grid are fixed at construction, as in weather models
on a fixed grid, so no layer needs the (local) input shape to know the global one.

This module holds the periodic U-Net family; the spectral networks (:mod:`mpidp.models.fourier`),
the windowed-attention ones (:mod:`mpidp.models.swin`) and their shared patch backbone
(:mod:`mpidp.models.patch`) are re-exported here, so every example network is one import away.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mpidp.errors import ConfigError
from mpidp.layers.periodic import PeriodicConv2d
from mpidp.models.fourier import AFNOBlock, AFNOFilter, AFNONet, FNO2d, SpectralConv2d
from mpidp.models.patch import PatchRecovery, PositionEmbedding
from mpidp.models.swin import SwinBlock, SwinNet, WindowAttention
from mpidp.ops.geometry import conv_output_size

__all__ = [
    "AFNOBlock",
    "AFNOFilter",
    "AFNONet",
    "FNO2d",
    "PatchEmbedRecover",
    "PatchRecovery",
    "PeriodicResBlock",
    "PeriodicUpsample",
    "PositionEmbedding",
    "SpectralConv2d",
    "SwinBlock",
    "SwinNet",
    "WeatherUNet",
    "WindowAttention",
]


def _conv(c_in: int, c_out: int, stride: int = 1, pole: str = "polar") -> PeriodicConv2d:
    """A 3x3 convolution on the globe: longitude wraps, latitude continues across the poles."""
    return PeriodicConv2d(c_in, c_out, 3, stride, pole=pole)


def _block(c_in: int, c_out: int, groups: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(_conv(c_in, c_out, stride), nn.GroupNorm(groups, c_out), nn.SiLU())


def _down(n: int) -> int:
    return conv_output_size(n, 3, 2, 1)


class PeriodicUpsample(nn.Module):
    """Bilinear upsampling of (B, C, H, W) from ``grid`` to ``size``, periodic in W: the first
    and last columns interpolate between each other, as longitudes 0 and 360 do (torch's
    Upsample holds the edge columns instead: a seam at the date line). Along H it is torch's
    (the first and last rows, the poles, held).

    The input is wrapped by ``wrap_in`` columns each side and upsampled to as many more output
    columns, ``wrap_out``, spanning the same longitudes (``wrap_in / wrap_out`` is the grid
    ratio), so every output column samples the input where the unwrapped upsample would."""

    def __init__(self, grid: tuple[int, int], size: tuple[int, int]) -> None:
        super().__init__()
        w_in, w_out = grid[1], size[1]
        g = math.gcd(w_in, w_out)
        self.wrap_in, self.wrap_out = w_in // g, w_out // g
        self.up = nn.Upsample(
            size=(size[0], w_out + 2 * self.wrap_out), mode="bilinear", align_corners=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.pad(x, (self.wrap_in, self.wrap_in, 0, 0), mode="circular")
        y = self.up(x)
        return y[..., self.wrap_out : y.size(-1) - self.wrap_out]


class WeatherUNet(nn.Module):
    """A two-level U-Net for a global (H, W) latitude-longitude grid whose first and last rows
    are the poles (721 x 1440, 91 x 180): stride-2 convolutions down, bilinear upsampling and
    convolutions up, GroupNorm and SiLU, skip connections; any H (odd ones too), W a multiple
    of 4. Every 3x3 convolution wraps longitude and continues across the poles
    (:class:`PeriodicConv2d`, ``pole="polar"``) and the upsampling wraps longitude
    (:class:`PeriodicUpsample`), so no column is an edge: the model commutes with a rotation
    of the globe by 4 columns.

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
        if w0 % 4:
            raise ConfigError(
                f"WeatherUNet: W={w0} longitudes; use a multiple of 4 (the convolutions across "
                f"the poles roll half the circle, at full and at half resolution)"
            )
        h1, w1 = _down(h0), _down(w0)
        h2, w2 = _down(h1), _down(w1)
        self.grid = grid
        self.inc = _block(in_channels, width, groups)
        self.down1 = _block(width, 2 * width, groups, stride=2)
        self.down2 = _block(2 * width, 4 * width, groups, stride=2)
        self.mid = None
        if mlp:
            self.mid = nn.Sequential(
                nn.Conv2d(4 * width, mlp, 1), nn.SiLU(), nn.Conv2d(mlp, 4 * width, 1)
            )
            self._tp_col, self._tp_row = ("mid.0",), ("mid.2",)
        self.up2 = nn.Sequential(PeriodicUpsample((h2, w2), (h1, w1)), _conv(4 * width, 2 * width))
        self.dec2 = _block(4 * width, 2 * width, groups)
        self.up1 = nn.Sequential(
            PeriodicUpsample((h1, w1), (h0, w0)), nn.Conv2d(2 * width, width, 1)
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
        self.conv1 = _conv(channels, channels, pole=pole)
        self.film = nn.Parameter(torch.zeros(2, channels))
        self.norm2 = nn.GroupNorm(groups, channels)
        self.conv2 = _conv(channels, channels, pole=pole)
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
