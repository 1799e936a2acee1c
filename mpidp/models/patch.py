"""The patch-token backbone the example AFNO and Swin networks share: a patch embedding, a
learned position embedding, blocks on channels-last tokens, a norm and a linear head that
un-patches to the field (plain torch)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = ["PatchNet", "PatchRecovery", "PositionEmbedding"]


class PositionEmbedding(nn.Module):
    """A learned embedding added at every position of a channels-last (B, h, w, C) grid."""

    def __init__(self, grid: tuple[int, int], channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.02 * torch.randn(1, *grid, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight


class PatchRecovery(nn.Module):
    """A linear head from channels-last tokens (B, h, w, C) to a (B, out, h p, w p) field:
    each token's ``p * p * out`` values become its patch of pixels."""

    def __init__(self, channels: int, out_channels: int, patch: int) -> None:
        super().__init__()
        self.patch, self.out_channels = patch, out_channels
        self.proj = nn.Linear(channels, patch * patch * out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, _ = x.shape
        p = self.patch
        y = self.proj(x).reshape(b, h, w, p, p, self.out_channels)
        return y.permute(0, 5, 1, 3, 2, 4).reshape(b, self.out_channels, h * p, w * p)


class PatchNet(nn.Module):
    """A token network on an (H, W) grid: a patch embedding (convolution with kernel = stride =
    ``patch``), a learned position embedding, ``self.blocks`` on channels-last tokens,
    LayerNorm and a linear head that un-patches to (out_channels, H, W)."""

    blocks: nn.ModuleList

    def _build(
        self,
        in_channels: int,
        out_channels: int,
        grid: tuple[int, int],
        patch: int,
        dim: int,
        blocks: Callable[[tuple[int, int]], Iterable[nn.Module]],
    ) -> None:
        """The embeddings, ``blocks(token grid)``, the norm and the head, in that order."""
        h, w = grid
        if h % patch or w % patch:
            raise ValueError(f"grid {grid} is not a multiple of patch {patch}")
        tokens = (h // patch, w // patch)
        self.grid, self.patch = grid, patch
        self.patch_embed = nn.Conv2d(in_channels, dim, patch, patch)
        self.pos_embed = PositionEmbedding(tokens, dim)
        self.blocks = nn.ModuleList(blocks(tokens))
        self.norm = nn.LayerNorm(dim)
        self.head = PatchRecovery(dim, out_channels, patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).permute(0, 2, 3, 1)  # (B, h, w, D) tokens, channels last
        x = self.pos_embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
