"""The patch-token backbone the example AFNO and Swin networks share: a patch embedding, a
learned position embedding, blocks on channels-last tokens, a norm and a linear head that
un-patches to the field (plain torch)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = ["PatchNet", "PatchRecovery", "PositionEmbedding", "PreNormBlock"]


class PositionEmbedding(nn.Module):
    """A learned embedding added at every position of a channels-last (B, h, w, C) grid."""

    def __init__(self, grid: tuple[int, int], channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.02 * torch.randn(1, *grid, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight


class PreNormBlock(nn.Module):
    """A transformer block on channels-last tokens (B, h, w, D): LayerNorm, the token
    ``mixer`` (an AFNO filter, windowed attention) and the residual, then LayerNorm, a channel
    MLP (``mlp_ratio`` x D hidden, GELU) and the residual. The mixer is the submodule
    ``mixer_name`` (the serial model's state_dict keys: ``norm1``, it, ``norm2``, ``mlp``)."""

    def __init__(self, dim: int, mixer_name: str, mixer: nn.Module, mlp_ratio: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.add_module(mixer_name, mixer)
        self._mixer = mixer_name
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + getattr(self, self._mixer)(self.norm1(x))
        return x + self.mlp(self.norm2(x))


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
