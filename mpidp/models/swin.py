"""The example windowed-attention networks (plain torch): Swin/Pangu window attention, its
block and network.

Written around one hook, ``_windows(x, first, grid)``: attention inside every window of a
padded, rolled block of tokens whose first window along each dim has global window number
``first`` on a padded grid ``grid``. The serial form pads and rolls the whole field; the
domain-parallel form (mpidp.models.window) builds the windows that hold its rows and keeps
them. Masks and earth-specific biases follow the global window number, so both are exact.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mpidp.models.patch import PatchNet, PreNormBlock

__all__ = ["SwinBlock", "SwinNet", "WindowAttention"]


def _window_cut(n: int, w: int) -> tuple[int, int]:
    """Zero rows added before and after ``n`` rows to make them a multiple of ``w``: half of
    them before (rounded down), the rest after (Pangu: 181 rows, windows of 6: 2 and 3)."""
    total = -n % w
    return total // 2, total - total // 2


def _partition(x: torch.Tensor, window: tuple[int, ...]) -> torch.Tensor:
    """(B, n1 w1, ..., C) -> (B, windows, w1 ... wk, C): windows in row-major order."""
    b, c, k = x.size(0), x.size(-1), len(window)
    shape = [b]
    for n, w in zip(x.shape[1:-1], window, strict=True):
        shape += [n // w, w]
    y = x.reshape(*shape, c)
    order = [0, *range(1, 2 * k, 2), *range(2, 2 * k + 1, 2), 2 * k + 1]
    return y.permute(order).reshape(b, -1, math.prod(window), c)


def _unpartition(y: torch.Tensor, window: tuple[int, ...], grid: tuple[int, ...]) -> torch.Tensor:
    """The inverse of :func:`_partition` for a block of ``grid`` tokens."""
    b, c, k = y.size(0), y.size(-1), len(window)
    counts = [n // w for n, w in zip(grid, window, strict=True)]
    y = y.reshape(b, *counts, *window, c)
    order = [0]
    for i in range(k):
        order += [1 + i, 1 + k + i]
    return y.permute(*order, 2 * k + 1).reshape(b, *grid, c)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside windows of channels-last tokens (B, H, W, C) or
    (B, Z, H, W, C), as in Swin and Pangu-Weather.

    - The grid is padded with zeros to a multiple of ``window`` (half before, rounded down).
    - ``shift``: the windows move by half a window along every dim (the padded field is rolled,
      as Swin's ``torch.roll``), and the windows that wrap around mask out (-100) the pairs of
      tokens that come from different regions.
    - Bias: Swin's relative position bias (one table for every window), or with
      ``earth_grid`` (the token grid) Pangu's earth-specific bias: absolute positions inside
      the window along every dim but the last, relative along the last (longitude), and one
      table per window position along the dims before the last.
    """

    bias_index: torch.Tensor

    def __init__(
        self,
        dim: int,
        heads: int,
        window: tuple[int, ...],
        shift: bool = False,
        earth_grid: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        if len(window) not in (2, 3) or dim % heads:
            raise ValueError(f"window {window} must be 2-D or 3-D and heads {heads} divide {dim}")
        if earth_grid is not None and len(earth_grid) != len(window):
            raise ValueError(f"earth_grid {earth_grid} and window {window}: one size per dim")
        self.window = tuple(window)
        self.shift = tuple(w // 2 for w in window) if shift else (0,) * len(window)
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        c = torch.stack(torch.meshgrid(*map(torch.arange, window), indexing="ij")).flatten(1)
        index = torch.zeros(c.size(1), c.size(1), dtype=torch.long)
        self.earth_grid = None if earth_grid is None else tuple(earth_grid)
        for d, w in enumerate(window):
            if earth_grid is not None and d < len(window) - 1:  # absolute pairs
                index = (index * w + c[d][:, None]) * w + c[d][None, :]
            else:  # relative offset
                index = index * (2 * w - 1) + c[d][:, None] - c[d][None, :] + w - 1
        self.register_buffer("bias_index", index, persistent=False)
        size = int(index.max()) + 1
        if earth_grid is None:
            self.bias = nn.Parameter(0.02 * torch.randn(size, heads))
        else:
            kinds = math.prod(-(-n // w) for n, w in zip(earth_grid[:-1], window[:-1], strict=True))
            self.bias = nn.Parameter(0.02 * torch.randn(size, kinds, heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = tuple(range(1, x.dim() - 1))
        cuts = [_window_cut(x.size(d), w) for d, w in zip(dims, self.window, strict=True)]
        pad = [v for lo, hi in reversed(cuts) for v in (lo, hi)]
        y = nn.functional.pad(x, [0, 0, *pad])
        grid = tuple(y.shape[1:-1])
        if any(self.shift):
            y = torch.roll(y, [-s for s in self.shift], dims)
        y = self._windows(y, (0,) * len(dims), grid)
        if any(self.shift):
            y = torch.roll(y, self.shift, dims)
        for d, (lo, _) in zip(dims, cuts, strict=True):
            y = y.narrow(d, lo, x.size(d))
        return y

    def _windows(
        self, x: torch.Tensor, first: tuple[int, ...], grid: tuple[int, ...]
    ) -> torch.Tensor:
        """Attention inside each window of ``x`` (padded and rolled, a whole number of windows
        along each dim), whose first window is window number ``first`` of a padded ``grid``."""
        block = tuple(x.shape[1:-1])
        b, c, h = x.size(0), x.size(-1), self.heads
        xw = _partition(x, self.window)  # (B, nW, N, C)
        nw, n = xw.size(1), xw.size(2)
        q, k, v = self.qkv(xw).reshape(b, nw, n, 3, h, c // h).permute(3, 0, 1, 4, 2, 5)
        attn = (q * (c // h) ** -0.5) @ k.transpose(-2, -1)  # (B, nW, heads, N, N)
        attn = attn + self._bias(block, first, grid)
        if any(self.shift):
            attn = attn + self._mask(block, first, grid).to(attn.dtype)
        y = (attn.softmax(-1) @ v).transpose(2, 3).reshape(b, nw, n, c)
        return _unpartition(self.proj(y), self.window, block)

    def _numbers(
        self, block: tuple[int, ...], first: tuple[int, ...], grid: tuple[int, ...], d: int
    ) -> torch.Tensor:
        """Global padded, rolled positions of the block's tokens along dim ``d``."""
        w = self.window[d]
        return (first[d] * w + torch.arange(block[d], device=self.bias.device)) % grid[d]

    def _bias(
        self, block: tuple[int, ...], first: tuple[int, ...], grid: tuple[int, ...]
    ) -> torch.Tensor:
        n = self.bias_index.size(0)
        table = self.bias[self.bias_index.view(-1)]
        if self.earth_grid is None:
            return table.view(n, n, -1).permute(2, 0, 1)  # (heads, N, N), every window
        want = tuple(-(-g // w) * w for g, w in zip(self.earth_grid, self.window, strict=True))
        if tuple(grid) != want:
            raise ValueError(
                f"earth-specific bias built for the grid {self.earth_grid}, got a "
                f"padded grid {tuple(grid)} (expected {want})"
            )
        kind = torch.zeros((), dtype=torch.long, device=self.bias.device)
        for d in range(len(block) - 1):  # the window's number along every dim but the last
            nums = self._numbers(block, first, grid, d)[:: self.window[d]] // self.window[d]
            kind = kind[..., None] * (grid[d] // self.window[d]) + nums
        kind = kind[..., None].expand(*kind.shape, block[-1] // self.window[-1]).reshape(-1)
        table = table.view(n, n, -1, self.heads)[:, :, kind]  # (N, N, nW, heads)
        return table.permute(2, 3, 0, 1)  # (nW, heads, N, N)

    def _mask(
        self, block: tuple[int, ...], first: tuple[int, ...], grid: tuple[int, ...]
    ) -> torch.Tensor:
        """-100 between tokens of a window that come from different regions of the rolled
        field (Swin's three slices per dim: before the last window, the last window's rows
        that were there, the rows rolled in)."""
        label = torch.zeros((), dtype=torch.long, device=self.bias.device)
        for d, (w, s) in enumerate(zip(self.window, self.shift, strict=True)):
            r = self._numbers(block, first, grid, d)
            lab = (r >= grid[d] - w).long() + (r >= grid[d] - s).long() if s else r * 0
            label = label[..., None] * 3 + lab
        lw = _partition(label[None, ..., None], self.window)[0, ..., 0]  # (nW, N)
        diff = lw[:, None, :, None] != lw[:, None, None, :]
        return torch.zeros(diff.shape, device=diff.device).masked_fill(diff, -100.0)


class SwinBlock(PreNormBlock):
    """A Swin / Pangu transformer block on channels-last tokens: LayerNorm, windowed attention
    (:class:`WindowAttention`) and the residual, then LayerNorm, an MLP and the residual."""

    def __init__(
        self,
        dim: int,
        heads: int,
        window: tuple[int, ...],
        shift: bool = False,
        earth_grid: tuple[int, ...] | None = None,
        mlp_ratio: float = 2.0,
    ) -> None:
        attn = WindowAttention(dim, heads, window, shift, earth_grid)
        super().__init__(dim, "attn", attn, mlp_ratio)


class SwinNet(PatchNet):
    """A Pangu / Swin-style transformer on an (H, W) grid: a patch embedding (convolution with
    kernel = stride = ``patch``), a learned position embedding, ``depth`` :class:`SwinBlock`
    s alternating unshifted and shifted windows (the token grid padded to a multiple of
    ``window`` as Pangu pads it; Pangu's earth-specific bias, or Swin's relative one with
    ``earth_bias=False``), LayerNorm and a linear head that un-patches to (out_channels, H, W).
    H and W must be multiples of ``patch``."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        grid: tuple[int, int],
        patch: int = 4,
        embed_dim: int = 32,
        depth: int = 2,
        heads: int = 4,
        window: tuple[int, int] = (4, 5),
        mlp_ratio: float = 2.0,
        earth_bias: bool = True,
    ) -> None:
        super().__init__()
        self._build(
            in_channels,
            out_channels,
            grid,
            patch,
            embed_dim,
            lambda tokens: (
                SwinBlock(
                    embed_dim,
                    heads,
                    tuple(window),
                    k % 2 == 1,
                    tokens if earth_bias else None,
                    mlp_ratio,
                )
                for k in range(depth)
            ),
        )
