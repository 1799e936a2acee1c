"""Band forms of the common spatial modules, through convert_to_domain_parallel (float64, 1-4
ranks, uneven and thin cuts): output, input gradient and parameter gradients against the torch
module on the whole field."""

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


def converted(module, manager):
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(module), manager)
    assert type(dist).__name__.startswith("DomainParallel"), type(dist)
    return dist


def cuts(n):
    out = {"balanced": None}
    if WORLD > 1:
        out["thin"] = [1] * (WORLD - 1) + [n - WORLD + 1]
    return out


# (module, input shape, sharded dim): asymmetric pads, a crop (negative), every mode and rank
PADS = [
    (nn.ZeroPad1d((2, 3)), (2, 3, 13), -1),
    (nn.ConstantPad1d((3, -2), 1.5), (2, 3, 13), -1),
    (nn.ReflectionPad1d((2, 3)), (2, 3, 13), -1),
    (nn.ReplicationPad1d((1, 4)), (2, 3, 13), -1),
    (nn.CircularPad1d((3, 2)), (2, 3, 13), -1),
    (nn.ZeroPad2d((1, 2, 3, 1)), (2, 3, 13, 6), -2),
    (nn.ZeroPad2d((1, 0, -2, 3)), (2, 3, 13, 6), -2),
    (nn.ConstantPad2d((1, 2, 2, 3), -0.5), (2, 3, 13, 6), -2),
    (nn.ReflectionPad2d((2, 1, 3, 2)), (2, 3, 13, 6), -2),
    (nn.ReplicationPad2d((2, 1, 1, 3)), (2, 3, 13, 6), -2),
    (nn.CircularPad2d((1, 2, 2, 3)), (2, 3, 13, 6), -2),
    (nn.ZeroPad3d((1, 1, 2, 1, 1, 0)), (1, 2, 3, 13, 5), -2),
    (nn.ConstantPad3d(2, 0.25), (1, 2, 3, 13, 5), -2),
    (nn.ReflectionPad3d((1, 1, 2, 3, 1, 1)), (1, 2, 3, 13, 5), -2),
    (nn.ReplicationPad3d((0, 1, 3, 1, 1, 2)), (1, 2, 3, 13, 5), -2),
    (nn.CircularPad3d((1, 0, 1, 2, 0, 1)), (1, 2, 3, 13, 5), -2),
]


@pytest.mark.parametrize("cut", list(cuts(13)))
@pytest.mark.parametrize("case", PADS, ids=lambda c: f"{type(c[0]).__name__}{c[0].padding}")
def test_pads(manager, case, cut):
    module, shape, dim = case
    dist = converted(module, manager)
    sizes = cuts(shape[dim])[cut]
    assert_matches_serial(module, dist, [rand(shape, 1)], manager=manager, dim=dim, sizes=sizes)


# (module, input shape, sharded dim): int and tuple arguments, ceil_mode, dilation, 1-3-D
POOLS = [
    (nn.MaxPool1d(3, 2, 1), (2, 3, 13), -1),
    (nn.MaxPool1d(2, ceil_mode=True), (2, 3, 13), -1),
    (nn.AvgPool1d(3, 2, 1, ceil_mode=True, count_include_pad=False), (2, 3, 13), -1),
    (nn.AvgPool1d(4, 3, 2, ceil_mode=True), (2, 3, 13), -1),
    (nn.MaxPool2d(2), (2, 3, 13, 8), -2),
    (nn.MaxPool2d(3, 2, 1), (2, 3, 13, 8), -2),
    (nn.MaxPool2d((3, 2), (2, 1), (1, 0), (2, 1), ceil_mode=True), (2, 3, 13, 8), -2),
    (nn.AvgPool2d(3, 2, 1), (2, 3, 13, 8), -2),
    (nn.AvgPool2d(2, ceil_mode=True), (2, 3, 13, 7), -2),
    (nn.AvgPool2d((3, 2), 2, 1, ceil_mode=True, count_include_pad=False), (2, 3, 13, 7), -2),
    (nn.AvgPool2d(3, 2, 1, divisor_override=5, ceil_mode=True), (2, 3, 13, 7), -2),
    (nn.MaxPool3d(2), (1, 2, 4, 13, 6), -2),
    (nn.MaxPool3d((1, 3, 3), (1, 2, 2), (0, 1, 1), ceil_mode=True), (1, 2, 3, 13, 6), -2),
    (nn.AvgPool3d((2, 3, 2), (1, 2, 2), (1, 1, 0), count_include_pad=False), (1, 2, 3, 13, 6), -2),
]


@pytest.mark.parametrize("cut", list(cuts(13)))
@pytest.mark.parametrize("case", POOLS, ids=lambda c: repr(c[0]).replace(" ", ""))
def test_pools(manager, case, cut):
    module, shape, dim = case
    dist = converted(module, manager)
    full = rand(shape, 2)
    sizes = cuts(shape[dim])[cut]
    assert_matches_serial(module, dist, [full], manager=manager, dim=dim, sizes=sizes)


ADAPTIVE = [
    (nn.AdaptiveAvgPool1d(5), (2, 3, 13), -1),
    (nn.AdaptiveMaxPool1d(6), (2, 3, 13), -1),
    (nn.AdaptiveAvgPool2d((5, 3)), (2, 3, 13, 8), -2),
    (nn.AdaptiveMaxPool2d((6, 4)), (2, 3, 13, 8), -2),
    (nn.AdaptiveAvgPool3d((2, 5, 3)), (1, 2, 3, 13, 6), -2),
    (nn.AdaptiveMaxPool3d((2, 4, None)), (1, 2, 3, 13, 6), -2),
]


@pytest.mark.parametrize("case", ADAPTIVE, ids=lambda c: repr(c[0]).replace(" ", ""))
def test_adaptive_pools_to_a_global_size(manager, case):
    module, shape, dim = case
    dist = converted(module, manager)
    assert_matches_serial(module, dist, [rand(shape, 3)], manager=manager, dim=dim)


def _squeeze_excitation(pool):
    class SE(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)
            self.pool = pool
            self.fc = nn.Sequential(nn.Conv2d(4, 2, 1), nn.ReLU(), nn.Conv2d(2, 4, 1))

        def forward(self, x):
            h = self.conv(x)
            return h * torch.sigmoid(self.fc(self.pool(h)))

    return SE().to(F64)


@pytest.mark.parametrize("pool", [nn.AdaptiveAvgPool2d(1), nn.AdaptiveMaxPool2d((1, 1))])
def test_fewer_output_rows_than_ranks_are_replicated(manager, pool):
    """Squeeze-excitation: the pooled value is the whole result on every rank (replicated),
    used by every rank on its band; the input and every parameter gradient equal serial."""
    torch.manual_seed(4)
    serial = _squeeze_excitation(pool)
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager)
    assert_matches_serial(
        serial, dist, [rand((2, 4, 13, 6), 5)], manager=manager, modules=(serial, dist)
    )


@pytest.mark.parametrize("pool", [nn.AdaptiveAvgPool2d((2, 3)), nn.AdaptiveMaxPool2d((3, 1))])
def test_replicated_output_is_the_whole_result_everywhere(manager, pool):
    """2 or 3 output rows over more ranks: every rank holds all of them, equal to serial."""
    alone = mpidp.convert_to_domain_parallel(copy.deepcopy(pool), manager)
    spec = manager.spec(13)
    x = rand((2, 4, 13, 6), 6)
    band = x.narrow(-2, spec.start(manager.domain_rank), spec[manager.domain_rank])
    out = alone(band)
    n_out = pool(x).shape[-2]
    if WORLD > n_out:  # replicated; else cut by the policy like any layer
        torch.testing.assert_close(out, pool(x), rtol=1e-13, atol=1e-14)
    else:
        rows = manager.spec(n_out)
        want = pool(x).narrow(-2, rows.start(manager.domain_rank), rows[manager.domain_rank])
        torch.testing.assert_close(out, want, rtol=1e-13, atol=1e-14)


@pytest.fixture(params=["balanced", "aligned"])
def policy(request, manager):
    old = manager.partition
    if request.param == "aligned":
        manager.partition = mpidp.Aligned(2)
    yield request.param
    manager.partition = old


@pytest.mark.parametrize("h", [13, 16])
def test_pixel_shuffle_and_unshuffle(manager, policy, h):
    """Shuffle by 2 of 13 or 16 rows, unshuffle back: the rows move to the policy's cut (none
    move under Aligned(2) when the cuts line up)."""
    shuffle = converted(nn.PixelShuffle(2), manager)
    assert_matches_serial(nn.PixelShuffle(2), shuffle, [rand((2, 8, h, 5), 7)], manager=manager)
    unshuffle = converted(nn.PixelUnshuffle(2), manager)
    assert_matches_serial(
        nn.PixelUnshuffle(2), unshuffle, [rand((2, 3, 2 * h, 6), 8)], manager=manager
    )


def test_super_resolution_net(manager, policy):
    """A super-resolution network: convolutions, PixelShuffle x 2 twice, every gradient."""
    torch.manual_seed(9)
    serial = nn.Sequential(
        nn.Conv2d(3, 12, 3, padding=1),
        nn.PReLU(),
        nn.Conv2d(12, 12, 3, padding=1),
        nn.PixelShuffle(2),
        nn.Conv2d(3, 12, 3, padding=1),
        nn.PixelShuffle(2),
        nn.Conv2d(3, 3, 3, padding=1),
    ).to(F64)
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager)
    assert_matches_serial(
        serial, dist, [rand((2, 3, 2 * WORLD + 5, 6), 10)], manager=manager, modules=(serial, dist)
    )


UPSAMPLE = [
    (nn.Upsample(scale_factor=2, mode="linear"), (2, 3, 13), -1),
    (nn.Upsample(size=20, mode="nearest"), (2, 3, 13), -1),
    (nn.Upsample(scale_factor=(1, 2, 2), mode="trilinear"), (1, 2, 3, 13, 5), -2),
    (nn.Upsample(size=(4, 21, 7), mode="trilinear", align_corners=True), (1, 2, 3, 13, 5), -2),
    (nn.Upsample(scale_factor=2, mode="nearest"), (1, 2, 3, 13, 5), -2),
    (nn.Upsample(scale_factor=1.5, mode="nearest-exact"), (2, 3, 13, 6), -2),
]


@pytest.mark.parametrize("cut", list(cuts(13)))
@pytest.mark.parametrize("case", UPSAMPLE, ids=lambda c: repr(c[0]).replace(" ", ""))
def test_upsample_1d_to_3d(manager, case, cut):
    module, shape, dim = case
    dist = converted(module, manager)
    sizes = cuts(shape[dim])[cut]
    assert_matches_serial(module, dist, [rand(shape, 11)], manager=manager, dim=dim, sizes=sizes)
