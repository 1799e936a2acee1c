"""Models built like the PhysicsNeMo and CREDIT zoos' convolutional models, converted end to end
with plain convert_to_domain_parallel (no safe=, no converters): output, input gradient and
every parameter gradient equal the serial model's (float64, uneven bands, 1-4 ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import rand
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.testing import assert_matches_serial

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
F64 = torch.float64


class SqueezeExcite(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Sequential(nn.Conv2d(c, c // 2, 1), nn.ReLU(), nn.Conv2d(c // 2, c, 1))

    def forward(self, x):
        return x * torch.sigmoid(self.fc(self.pool(x)))


class ResBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.se = SqueezeExcite(c_out)
        self.skip = nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
        )

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.se(self.bn2(self.conv2(h))) + self.skip(x))


class ResNetUNet(nn.Module):
    """A ResNet-encoder U-Net: 7x7 stride-2 stem, MaxPool2d(3, 2, 1), residual blocks with
    squeeze-excitation, bilinear upsampling and skip connections."""

    def __init__(self, c: int = 3, w: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(c, w, 7, 2, 3, bias=False), nn.BatchNorm2d(w), nn.ReLU()
        )
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.enc1 = ResBlock(w, w, 1)
        self.enc2 = ResBlock(w, 2 * w, 2)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.dec2 = nn.Sequential(nn.Conv2d(3 * w, w, 3, padding=1), nn.ReLU())
        self.dec1 = nn.Sequential(nn.Conv2d(2 * w, w, 3, padding=1), nn.ReLU())
        self.head = nn.Conv2d(w, c, 1)

    def forward(self, x):
        s0 = self.stem(x)  # H/2
        s1 = self.enc1(self.pool(s0))  # H/4
        s2 = self.enc2(s1)  # H/8
        d1 = self.dec2(torch.cat([self.up(s2), s1], 1))
        d0 = self.dec1(torch.cat([self.up(d1), s0], 1))
        return self.head(self.up(d0))


class UNet3d(nn.Module):
    """A 3-D U-Net on (B, C, T, H, W): Conv3d, MaxPool3d, ConvTranspose3d, InstanceNorm3d."""

    def __init__(self, c: int = 2, w: int = 4) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv3d(c, w, 3, padding=1), nn.InstanceNorm3d(w), nn.GELU())
        self.pool = nn.MaxPool3d((1, 2, 2))
        self.mid = nn.Sequential(nn.Conv3d(w, 2 * w, 3, padding=1), nn.GELU())
        self.up = nn.ConvTranspose3d(2 * w, w, (1, 2, 2), (1, 2, 2))
        self.dec = nn.Conv3d(2 * w, c, 3, padding=1)

    def forward(self, x):
        e = self.enc(x)
        return self.dec(torch.cat([self.up(self.mid(self.pool(e))), e], 1))


class ReflectResNet(nn.Module):
    """Pix2pix-style residual generator: ReflectionPad2d + 7x7 conv, stride-2 down, residual
    blocks with ReflectionPad2d(1) + 3x3 convs and InstanceNorm, transposed conv up."""

    def __init__(self, c: int = 3, w: int = 6) -> None:
        super().__init__()

        def block():
            return nn.Sequential(
                nn.ReflectionPad2d(1),
                nn.Conv2d(2 * w, 2 * w, 3),
                nn.InstanceNorm2d(2 * w, affine=True),
                nn.ReLU(),
                nn.ReflectionPad2d(1),
                nn.Conv2d(2 * w, 2 * w, 3),
                nn.InstanceNorm2d(2 * w, affine=True),
            )

        self.stem = nn.Sequential(nn.ReflectionPad2d(3), nn.Conv2d(c, w, 7), nn.ReLU())
        self.down = nn.Sequential(nn.Conv2d(w, 2 * w, 3, 2, 1), nn.ReLU())
        self.blocks = nn.ModuleList(block() for _ in range(2))
        self.up = nn.Sequential(nn.ConvTranspose2d(2 * w, w, 3, 2, 1, output_padding=1), nn.ReLU())
        self.out = nn.Sequential(nn.ReflectionPad2d(3), nn.Conv2d(w, c, 7), nn.Tanh())

    def forward(self, x):
        h = self.down(self.stem(x))
        for b in self.blocks:
            h = h + b(h)
        return self.out(self.up(h))


def _check(manager, serial, shape, seed):
    serial = serial.to(F64)
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager)
    refused = [v for v in mpidp.explain_conversion(serial) if v.action == "refused"]
    assert not refused, refused
    # the dry run, band runs of every rank included, finds nothing in a model that is exact
    report = mpidp.validate_sharding_constraints(serial, shape, manager)
    assert report.ok, report.problems
    assert_matches_serial(
        serial, dist, [rand(shape, seed)], manager=manager, modules=(serial, dist)
    )


def test_resnet_encoder_unet_with_squeeze_excitation(manager):
    torch.manual_seed(1)
    _check(manager, ResNetUNet(), (2, 3, 56, 16), 1)  # 56, 28, 14, 7 rows: uneven cuts


def test_unet_3d(manager):
    torch.manual_seed(2)
    _check(manager, UNet3d(), (1, 2, 3, 4 * WORLD + 4, 8), 2)


def test_reflection_padded_resnet(manager):
    torch.manual_seed(3)
    _check(manager, ReflectResNet(), (2, 3, 4 * WORLD + 10, 12), 3)
