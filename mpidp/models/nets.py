"""Small serial example networks (plain torch): what the tests, the examples and ``mpidp plan``
convert to domain parallel. Sizes along the grid are fixed at construction, as in weather models
on a fixed grid, so no layer needs the (local) input shape to know the global one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

from mpidp.errors import ConfigError
from mpidp.layers.periodic import PeriodicConv2d
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


# -- spectral models ----------------------------------------------------------------------------
#
# Written as serial torch code with three hooks, ``_rfft2``, ``_irfft2`` and ``_modes``: the
# serial forms call torch.fft; the domain-parallel forms (mpidp.models.spectral) override only
# the hooks with mpidp.ops.fft. The forward code reads global sizes from the spectrum (all H there)
# and W from the band (W is never cut), so the same code is right on a band.


class _Spectral(nn.Module):
    """The FFT hooks of a module that works on a (..., H, W) field along ``fft_dims``."""

    fft_dims: tuple[int, int] = (-2, -1)

    def _rfft2(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft2(x, dim=self.fft_dims, norm="ortho")

    def _irfft2(self, X: torch.Tensor, s: tuple[int, int]) -> torch.Tensor:
        return torch.fft.irfft2(X, s=s, dim=self.fft_dims, norm="ortho")

    def _modes(self, X: torch.Tensor) -> slice:
        """The global W-mode numbers ``X`` holds (all of them in the serial module)."""
        return slice(0, X.size(self.fft_dims[1]))


class AFNOFilter(_Spectral):
    """FourCastNet's adaptive Fourier neural operator filter, on channels-last tokens
    (B, h, w, C): rfft2 over (h, w), a two-layer complex MLP that is block-diagonal over
    ``num_blocks`` channel blocks (the same weights at every mode), softshrink, the modes
    outside the kept fraction zeroed, irfft2, plus the input (the filter's skip).

    Modes kept: H frequencies ``|ky| < ceil(fraction * (h // 2 + 1))`` and W frequencies
    ``kx < ceil(fraction * (w // 2 + 1))``; fraction 1 keeps every mode."""

    fft_dims = (1, 2)

    def __init__(
        self,
        channels: int,
        grid: tuple[int, int],
        num_blocks: int = 4,
        hidden_factor: int = 1,
        sparsity_threshold: float = 0.01,
        hard_thresholding_fraction: float = 1.0,
    ) -> None:
        super().__init__()
        if channels % num_blocks:
            raise ValueError(f"channels {channels} must divide into num_blocks {num_blocks}")
        self.channels, self.num_blocks = channels, num_blocks
        self.block = channels // num_blocks
        self.sparsity_threshold = sparsity_threshold
        hidden = self.block * hidden_factor
        scale = 0.02
        self.w1 = nn.Parameter(scale * torch.randn(2, num_blocks, self.block, hidden))
        self.b1 = nn.Parameter(scale * torch.randn(2, num_blocks, hidden))
        self.w2 = nn.Parameter(scale * torch.randn(2, num_blocks, hidden, self.block))
        self.b2 = nn.Parameter(scale * torch.randn(2, num_blocks, self.block))
        h, w = grid
        ky = torch.fft.fftfreq(h, 1.0 / h).abs()  # |H frequency| of every row of the spectrum
        kx = torch.arange(w // 2 + 1)
        keep_y = math.ceil(hard_thresholding_fraction * (h // 2 + 1))
        keep_x = math.ceil(hard_thresholding_fraction * (w // 2 + 1))
        mask = (ky < keep_y)[:, None] & (kx < keep_x)[None, :]
        self.mask: torch.Tensor
        self.register_buffer("mask", mask, persistent=False)

    def _mlp(self, X: torch.Tensor) -> torch.Tensor:
        """The block-diagonal complex MLP over channels, at every mode."""
        shape = X.shape
        Z = X.reshape(*shape[:-1], self.num_blocks, self.block)
        re, im = Z.real, Z.imag

        def mix(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor, bias: torch.Tensor):
            r = torch.einsum("...nc,ncd->...nd", a, w[0]) - torch.einsum(
                "...nc,ncd->...nd", b, w[1]
            )
            i = torch.einsum("...nc,ncd->...nd", b, w[0]) + torch.einsum(
                "...nc,ncd->...nd", a, w[1]
            )
            return r + bias[0], i + bias[1]

        re, im = mix(re, im, self.w1, self.b1)
        re, im = torch.relu(re), torch.relu(im)
        re, im = mix(re, im, self.w2, self.b2)
        out = nn.functional.softshrink(torch.stack([re, im], -1), self.sparsity_threshold)
        return torch.view_as_complex(out.contiguous()).reshape(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        X = self._rfft2(x)  # (B, h, kx, C): every H frequency, this module's W modes
        mask = self.mask[:, self._modes(X)].to(X.real.dtype)
        Y = self._mlp(X) * mask[None, :, :, None]
        return self._irfft2(Y, (X.size(1), x.size(2))) + x


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


class AFNOBlock(nn.Module):
    """One AFNO block on channels-last tokens (B, h, w, D): LayerNorm + AFNO filter + residual,
    then LayerNorm + channel MLP (``mlp_ratio`` x D hidden, GELU) + residual."""

    def __init__(self, dim: int, grid: tuple[int, int], mlp_ratio: float, **filter_args) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.filter = AFNOFilter(dim, grid, **filter_args)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.filter(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _PatchNet(nn.Module):
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


class AFNONet(_PatchNet):
    """A FourCastNet-style AFNO network on an (H, W) grid: a patch embedding (convolution with
    kernel = stride = ``patch``), a learned position embedding, ``depth`` blocks of LayerNorm +
    AFNO filter + residual and LayerNorm + channel MLP + residual, and a linear head that
    un-patches to (out_channels, H, W). H and W must be multiples of ``patch``."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        grid: tuple[int, int],
        patch: int = 4,
        embed_dim: int = 32,
        depth: int = 2,
        num_blocks: int = 4,
        mlp_ratio: float = 2.0,
        sparsity_threshold: float = 0.01,
        hard_thresholding_fraction: float = 1.0,
    ) -> None:
        super().__init__()
        filter_args = dict(
            num_blocks=num_blocks,
            sparsity_threshold=sparsity_threshold,
            hard_thresholding_fraction=hard_thresholding_fraction,
        )
        self._build(
            in_channels,
            out_channels,
            grid,
            patch,
            embed_dim,
            lambda tokens: (
                AFNOBlock(embed_dim, tokens, mlp_ratio, **filter_args) for _ in range(depth)
            ),
        )


class SpectralConv2d(_Spectral):
    """FNO's spectral convolution on (B, C, H, W): the ``modes1`` lowest H frequencies of both
    signs and the ``modes2`` lowest W frequencies of rfft2 are multiplied by complex weights
    (``in x out`` per mode, stored as real pairs, shape (in, out, modes1, modes2, 2)), every
    other mode is zeroed, and irfft2 returns to the grid."""

    def __init__(self, in_channels: int, out_channels: int, modes1: int, modes2: int) -> None:
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.modes1, self.modes2 = modes1, modes2
        scale = 1.0 / (in_channels * out_channels)
        # complex weights stored as (..., 2) real pairs: .double() / .to(dtype) then move them
        # with the rest of the model (a complex parameter would stay complex64, or lose its
        # imaginary part under .to(torch.float64))
        shape = (in_channels, out_channels, modes1, modes2, 2)
        self.weights1 = nn.Parameter(scale * torch.rand(*shape))
        self.weights2 = nn.Parameter(scale * torch.rand(*shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        X = self._rfft2(x)  # (B, C, H, kx): every H frequency, this module's W modes
        h, held = X.size(-2), self._modes(X)
        if 2 * self.modes1 > h:
            raise ValueError(f"modes1={self.modes1} needs H >= {2 * self.modes1} (H = {h})")
        lo, hi = held.start, min(held.stop, self.modes2)  # the kept W modes held here
        n = max(hi - lo, 0)
        m = self.modes1
        out = X.new_zeros(X.size(0), self.out_channels, h, X.size(-1))
        if n:
            w1 = torch.view_as_complex(self.weights1)[..., lo:hi]
            w2 = torch.view_as_complex(self.weights2)[..., lo:hi]
            out[..., :m, :n] = torch.einsum("bixy,ioxy->boxy", X[..., :m, :n], w1)
            out[..., h - m :, :n] = torch.einsum("bixy,ioxy->boxy", X[..., h - m :, :n], w2)
        # joined to the input and the weights on every rank, also where no kept mode is held,
        # so every rank's backward reaches the exchanges of the FFTs
        out = out + _anchor(X, self.weights1, self.weights2)
        return self._irfft2(out, (h, x.size(-1)))


def _anchor(*tensors: torch.Tensor) -> torch.Tensor:
    """A zero that depends on every tensor (an empty slice summed): adding it keeps them in
    the graph without changing a value, even where they hold inf or NaN."""
    return sum(t.reshape(-1)[:0].sum() for t in tensors)  # type: ignore[return-value]


class FNO2d(nn.Module):
    """A small Fourier neural operator on (B, C, H, W): a 1x1 lift to ``width`` channels,
    ``depth`` layers of spectral convolution + 1x1 convolution + GELU, a 1x1 projection."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        modes1: int = 6,
        modes2: int = 6,
        width: int = 16,
        depth: int = 3,
    ) -> None:
        super().__init__()
        self.lift = nn.Conv2d(in_channels, width, 1)
        self.spectral = nn.ModuleList(
            SpectralConv2d(width, width, modes1, modes2) for _ in range(depth)
        )
        self.pointwise = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(depth))
        self.project = nn.Sequential(
            nn.Conv2d(width, 2 * width, 1), nn.GELU(), nn.Conv2d(2 * width, out_channels, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lift(x)
        for k, (spectral, pointwise) in enumerate(zip(self.spectral, self.pointwise, strict=True)):
            x = spectral(x) + pointwise(x)
            if k < len(self.spectral) - 1:
                x = nn.functional.gelu(x)
        return self.project(x)


# -- windowed attention (Swin, Pangu) -----------------------------------------------------------
#
# Written around one hook, ``_windows(x, first, grid)``: attention inside every window of a
# padded, rolled block of tokens whose first window along each dim has global window number
# ``first`` on a padded grid ``grid``. The serial form pads and rolls the whole field; the
# domain-parallel form (mpidp.models.window) builds the windows that hold its rows and keeps
# them. Masks and earth-specific biases follow the global window number, so both are exact.


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


class SwinBlock(nn.Module):
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
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, window, shift, earth_grid)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SwinNet(_PatchNet):
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
