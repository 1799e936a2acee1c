"""Models written the way third-party weather models are written (PhysicsNeMo, CREDIT,
FourCastNet style): functional calls, shape checks against the configured grid, reshapes to
patch grids, einops, skip connections cut to the skip's shape, global conditioning, spectral
filters with plain torch.fft. Nothing in them knows about mpidp: the ShardedTensor tests run
them unchanged."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn


def block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(2, cout), nn.SiLU())


class UNet(nn.Module):
    """Encoder-decoder whose decoder upsamples to the skip's own size (odd grids work)."""

    def __init__(self, img_size: tuple[int, int], cin: int = 3, cout: int = 2, w: int = 4):
        super().__init__()
        self.img_size = img_size
        self.enc1, self.enc2 = block(cin, w), block(w, 2 * w)
        self.mid = block(2 * w, 2 * w)
        self.dec2, self.dec1 = block(4 * w, w), block(2 * w, w)
        self.head = nn.Conv2d(w, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(f"expected {self.img_size}, got {tuple(x.shape[-2:])}")
        s1 = self.enc1(x)
        s2 = self.enc2(F.max_pool2d(s1, 2))
        m = self.mid(F.max_pool2d(s2, 2))
        u = F.interpolate(m, size=s2.shape[-2:], mode="bilinear", align_corners=False)
        u = self.dec2(torch.cat([u, s2], dim=1))
        u = F.interpolate(u, size=s1.shape[-2:], mode="nearest")
        u = self.dec1(torch.cat([u, s1], dim=1))
        return self.head(u)


class UNet3D(nn.Module):
    """(B, C, T, H, W) fields: Conv3d, BatchNorm3d, MaxPool3d, trilinear upsampling."""

    def __init__(self, cin: int = 2, w: int = 4):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv3d(cin, w, 3, padding=1), nn.BatchNorm3d(w), nn.ReLU())
        self.pool = nn.MaxPool3d(2)
        self.mid = nn.Sequential(nn.Conv3d(w, w, 3, padding=1), nn.ReLU())
        self.out = nn.Conv3d(2 * w, cin, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.enc(x)
        m = self.mid(self.pool(s))
        u = F.interpolate(m, size=s.shape[2:], mode="trilinear", align_corners=False)
        return self.out(torch.cat([u, s], 1)) + x


class ResBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.ReflectionPad2d(1),
            nn.Conv2d(c, c, 3),
            nn.InstanceNorm2d(c, affine=True),
            nn.ReLU(),
            nn.ReflectionPad2d(1),
            nn.Conv2d(c, c, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class ResNet(nn.Module):
    """Pix2Pix-style generator body: reflection padding, instance norm, residual blocks."""

    def __init__(self, cin: int = 3, w: int = 6):
        super().__init__()
        self.stem = nn.Sequential(nn.ReflectionPad2d(2), nn.Conv2d(cin, w, 5), nn.ReLU())
        self.blocks = nn.Sequential(ResBlock(w), ResBlock(w))
        self.head = nn.Conv2d(w, cin, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.head(self.blocks(self.stem(x))))


class PatchMixer(nn.Module):
    """Patch embedding, a position embedding added by shape, token MLPs with LayerNorm,
    einops patch recovery: the shape of a ViT-style weather model without attention."""

    def __init__(self, img_size: tuple[int, int], patch: int = 2, cin: int = 3, dim: int = 8):
        super().__init__()
        h, w = img_size[0] // patch, img_size[1] // patch
        self.patch, self.grid = patch, (h, w)
        self.embed = nn.Conv2d(cin, dim, patch, stride=patch)
        self.pos_embed = nn.Parameter(torch.randn(1, h * w, dim) * 0.1)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.recover = nn.Linear(dim, patch * patch * cin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        t = self.embed(x).flatten(2).transpose(1, 2)  # (B, N, D)
        t = t + self.pos_embed
        t = t + self.mlp(self.norm(t))
        y = self.recover(t)  # (B, N, p * p * C)
        h, w = self.grid
        y = y.reshape(b, h, w, -1)
        return rearrange(y, "b h w (p1 p2 c) -> b c (h p1) (w p2)", p1=self.patch, p2=self.patch)


class FiLMNet(nn.Module):
    """Global-mean conditioning: per-channel scale and shift from the field's own mean."""

    def __init__(self, c: int = 3, w: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(c, w, 3, padding=1)
        self.cond = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, 2 * w))
        self.conv2 = nn.Conv2d(w, c, 3, padding=1, padding_mode="circular")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.conv1(x))
        scale, shift = self.cond(h.mean(dim=(2, 3))).chunk(2, dim=1)
        h = h * (1 + scale[:, :, None, None]) + shift[:, :, None, None]
        return self.conv2(h)


class AFNO(nn.Module):
    """An AFNO filter in FourCastNet's channels-last layout, with plain torch.fft calls:
    block-diagonal complex MLP over the channels of every mode, a mode mask, softshrink."""

    def __init__(self, img_size: tuple[int, int], c: int = 4, blocks: int = 2, keep: int = 3):
        super().__init__()
        self.c, self.nb, self.bs = c, blocks, c // blocks
        self.w1 = nn.Parameter(0.3 * torch.randn(2, blocks, self.bs, self.bs))
        self.b1 = nn.Parameter(0.1 * torch.randn(2, blocks, self.bs))
        self.w2 = nn.Parameter(0.3 * torch.randn(2, blocks, self.bs, self.bs))
        w = img_size[1]
        kx = torch.arange(w // 2 + 1) < keep
        self.register_buffer("mask", kx.to(torch.get_default_dtype()).view(1, 1, -1, 1, 1))
        self.lift = nn.Linear(3, c)
        self.proj = nn.Linear(c, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lift(x.permute(0, 2, 3, 1))  # (B, H, W, C)
        b, h, w, c = x.shape
        X = torch.fft.rfft2(x, dim=(1, 2), norm="ortho")
        X = X.reshape(b, h, w // 2 + 1, self.nb, self.bs)
        re = F.relu(
            torch.einsum("...bi,bio->...bo", X.real, self.w1[0])
            - torch.einsum("...bi,bio->...bo", X.imag, self.w1[1])
            + self.b1[0]
        )
        im = F.relu(
            torch.einsum("...bi,bio->...bo", X.imag, self.w1[0])
            + torch.einsum("...bi,bio->...bo", X.real, self.w1[1])
            + self.b1[1]
        )
        re2 = torch.einsum("...bi,bio->...bo", re, self.w2[0]) - torch.einsum(
            "...bi,bio->...bo", im, self.w2[1]
        )
        im2 = torch.einsum("...bi,bio->...bo", im, self.w2[0]) + torch.einsum(
            "...bi,bio->...bo", re, self.w2[1]
        )
        Y = torch.view_as_complex(
            torch.stack([F.softshrink(re2, 0.01), F.softshrink(im2, 0.01)], -1)
        )
        Y = (Y * self.mask).reshape(b, h, w // 2 + 1, c)
        y = torch.fft.irfft2(Y, s=(h, w), dim=(1, 2), norm="ortho")
        return self.proj(y + x).permute(0, 3, 1, 2)


class SuperRes(nn.Module):
    """SRResNet-style upsampler: convolution, PixelShuffle, PReLU."""

    def __init__(self, c: int = 3, w: int = 4, r: int = 2):
        super().__init__()
        self.head = nn.Conv2d(c, w, 5, padding=2)
        self.up = nn.Sequential(
            nn.Conv2d(w, w * r * r, 3, padding=1), nn.PixelShuffle(r), nn.PReLU()
        )
        self.tail = nn.Conv2d(w, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.up(F.relu(self.head(x))))


class FNOSpectral(nn.Module):
    """neuraloperator / PhysicsNeMo FNO style: the kept modes written into a zero spectrum
    made with torch.zeros of the global shape, complex weights, compl_mul2d as an einsum."""

    def __init__(self, c: int = 3, modes1: int = 3, modes2: int = 3):
        super().__init__()
        self.modes1, self.modes2 = modes1, modes2
        scale = 1 / (c * c)
        self.weights1 = nn.Parameter(scale * torch.rand(c, c, modes1, modes2, 2))
        self.weights2 = nn.Parameter(scale * torch.rand(c, c, modes1, modes2, 2))
        self.w = nn.Conv2d(c, c, 1)

    @staticmethod
    def compl_mul2d(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bixy,ioxy->boxy", x, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(b, c, h, w // 2 + 1, dtype=x_ft.dtype, device=x.device)
        w1 = torch.view_as_complex(self.weights1)
        w2 = torch.view_as_complex(self.weights2)
        out_ft[:, :, : self.modes1, : self.modes2] = self.compl_mul2d(
            x_ft[:, :, : self.modes1, : self.modes2], w1
        )
        out_ft[:, :, -self.modes1 :, : self.modes2] = self.compl_mul2d(
            x_ft[:, :, -self.modes1 :, : self.modes2], w2
        )
        return F.gelu(torch.fft.irfft2(out_ft, s=(h, w)) + self.w(x))


def window_partition(x, ws):
    B, H, W, C = x.shape
    x = x.view(B, H // ws, ws, W // ws, ws, C)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(-1, ws * ws, C)


def window_reverse(w, ws, H, W):
    B = int(w.shape[0] / (H * W / ws / ws))
    x = w.view(B, H // ws, W // ws, ws, ws, -1)
    return x.permute(0, 1, 3, 2, 4, 5).contiguous().view(B, H, W, -1)


class SwinBlock(nn.Module):
    """A Swin V1 block as the reference code writes it: shifted windows by torch.roll, window
    partition by view/permute, relative position bias, the -100 mask of shifted windows."""

    def __init__(self, dim, heads, ws, shift, H, W):
        super().__init__()
        self.ws, self.shift, self.heads, self.H, self.W = ws, shift, heads, H, W
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.rpb = nn.Parameter(torch.randn((2 * ws - 1) ** 2, heads) * 0.1)
        c = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")).flatten(
            1
        )
        rel = (c[:, :, None] - c[:, None, :]).permute(1, 2, 0) + ws - 1
        self.register_buffer("rpi", rel[..., 0] * (2 * ws - 1) + rel[..., 1])
        if shift:
            img = torch.zeros(1, H, W, 1)
            cnt = 0
            for h in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
                for w in (slice(0, -ws), slice(-ws, -shift), slice(-shift, None)):
                    img[:, h, w, :] = cnt
                    cnt += 1
            mw = window_partition(img, ws).squeeze(-1)
            mask = mw.unsqueeze(1) - mw.unsqueeze(2)
            self.register_buffer(
                "mask", mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)
            )
        else:
            self.mask = None
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):  # (B, H, W, C)
        _, H, W, C = x.shape
        s = x
        x = self.norm1(x)
        if self.shift:
            x = torch.roll(x, shifts=(-self.shift, -self.shift), dims=(1, 2))
        xw = window_partition(x, self.ws)  # (nW*B, N, C)
        Bw, N, _ = xw.shape
        qkv = self.qkv(xw).reshape(Bw, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = (q * (C // self.heads) ** -0.5) @ k.transpose(-2, -1)
        attn = attn + self.rpb[self.rpi.view(-1)].view(N, N, -1).permute(2, 0, 1).unsqueeze(0)
        if self.mask is not None:
            nW = self.mask.shape[0]
            attn = attn.view(Bw // nW, nW, self.heads, N, N) + self.mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.heads, N, N)
        attn = attn.softmax(-1)
        y = (attn @ v).transpose(1, 2).reshape(Bw, N, C)
        y = window_reverse(self.proj(y), self.ws, H, W)
        if self.shift:
            y = torch.roll(y, shifts=(self.shift, self.shift), dims=(1, 2))
        x = s + y
        return x + self.mlp(self.norm2(x))
