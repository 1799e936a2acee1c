"""The example spectral networks (plain torch): FourCastNet's AFNO filter, block and network,
and the Fourier neural operator (spectral convolution, FNO2d).

Written as serial torch code with three hooks, ``_rfft2``, ``_irfft2`` and ``_modes``: the
serial forms call torch.fft; the domain-parallel forms (mpidp.models.spectral) override only
the hooks with mpidp.ops.fft. The forward code reads global sizes from the spectrum (all H there)
and W from the ``_width`` hook (the field's own W serially; the global W where blocks cut it), so
the same code is right on a band and on a block.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mpidp.models.patch import PatchNet, PreNormBlock

__all__ = ["AFNOBlock", "AFNOFilter", "AFNONet", "FNO2d", "SpectralConv2d"]


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

    def _width(self, x: torch.Tensor) -> int:
        """The global extent of the halved dim (W) of the field ``x`` (its own, serially)."""
        return x.size(self.fft_dims[1])


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
        return self._irfft2(Y, (X.size(1), self._width(x))) + x


class AFNOBlock(PreNormBlock):
    """One AFNO block on channels-last tokens (B, h, w, D): LayerNorm + AFNO filter + residual,
    then LayerNorm + channel MLP (``mlp_ratio`` x D hidden, GELU) + residual."""

    def __init__(self, dim: int, grid: tuple[int, int], mlp_ratio: float, **filter_args) -> None:
        super().__init__(dim, "filter", AFNOFilter(dim, grid, **filter_args), mlp_ratio)


class AFNONet(PatchNet):
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
        n, m = max(hi - lo, 0), self.modes1
        out = X.new_zeros(X.size(0), self.out_channels, h, X.size(-1))
        # run also where no kept mode is held (n = 0: empty products): the output then still
        # depends on the input and the weights, so every rank's backward reaches the exchanges
        # of the FFTs and gives the weights a (zero) gradient; no extra term is needed, which
        # on a ShardedTensor would have to read across its cut dims
        w1 = torch.view_as_complex(self.weights1)[..., lo : lo + n]
        w2 = torch.view_as_complex(self.weights2)[..., lo : lo + n]
        out[..., :m, :n] = torch.einsum("bixy,ioxy->boxy", X[..., :m, :n], w1)
        out[..., h - m :, :n] = torch.einsum("bixy,ioxy->boxy", X[..., h - m :, :n], w2)
        return self._irfft2(out, (h, self._width(x)))


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
