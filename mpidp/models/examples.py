"""The example networks at the sizes ``mpidp plan`` and ``mpidp explain`` price them, by name."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from mpidp.graph.graphcast import GraphCastNet
from mpidp.models.nets import (
    AFNONet,
    FNO2d,
    PatchEmbedRecover,
    PeriodicResBlock,
    SwinNet,
    WeatherUNet,
)

__all__ = ["EXAMPLES"]


def _unet(channels: int, grid: tuple[int, int]) -> nn.Module:
    return WeatherUNet(channels, channels, grid)


def _resblock(channels: int, grid: tuple[int, int]) -> nn.Module:
    return PeriodicResBlock(max(channels, 2) + max(channels, 2) % 2)


def _afno(channels: int, grid: tuple[int, int]) -> nn.Module:
    patch = 8 if grid[0] % 8 == 0 and grid[1] % 8 == 0 else 4
    return AFNONet(channels, channels, grid, patch=patch, embed_dim=256, depth=4, num_blocks=8)


def _fno(channels: int, grid: tuple[int, int]) -> nn.Module:
    return FNO2d(channels, channels, modes1=32, modes2=32, width=32, depth=4)


def _swin(channels: int, grid: tuple[int, int]) -> nn.Module:
    patch = 8 if grid[0] % 8 == 0 and grid[1] % 8 == 0 else 4
    return SwinNet(channels, channels, grid, patch=patch, embed_dim=192, heads=6, window=(6, 12))


def _graph(channels: int, grid: tuple[int, int]) -> nn.Module:
    return GraphCastNet(channels, channels, grid, mesh_nodes=2562, hidden=128, layers=4)


def _patch(channels: int, grid: tuple[int, int]) -> nn.Module:
    return PatchEmbedRecover(channels, 32, grid)


#: The example networks by the names ``mpidp plan --model`` takes: factories of
#: ``(channels, grid)`` (mpidp.preflight.plan.EXAMPLE_MODELS lists the same names).
EXAMPLES: dict[str, Callable[[int, tuple[int, int]], nn.Module]] = {
    "unet": _unet,
    "resblock": _resblock,
    "patch": _patch,
    "afno": _afno,
    "fno": _fno,
    "swin": _swin,
    "graph": _graph,
}
