"""Domain-parallel layers against their torch modules: output, input gradient, every parameter
gradient, float64, uneven partitions, every rank position (the oracle gathers all ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.testing import assert_matches_serial

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
F64 = torch.float64


def rand(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=F64)


def check(manager, serial, wrapper, shape, shard_dim=-2, seed=0):
    serial = serial.to(F64)
    dist = wrapper.from_module(copy.deepcopy(serial), manager, shard_dim)
    assert_matches_serial(
        serial, dist, [rand(shape, seed)], manager=manager, dim=shard_dim, modules=(serial, dist)
    )


# (kernel, stride, padding, dilation, padding_mode, groups, bias)
CONV2D = [
    (3, 1, 1, 1, "zeros", 1, True),
    (1, 1, 0, 1, "zeros", 1, True),
    (2, 1, "same", 1, "zeros", 1, False),
    (4, 1, "same", 2, "reflect", 1, True),
    (5, 1, 2, 1, "replicate", 2, True),
    (3, 2, 1, 1, "zeros", 1, True),
    (3, 2, 1, 1, "circular", 1, True),
    (4, 2, 1, 1, "reflect", 2, False),
    (5, 3, 2, 2, "zeros", 1, True),
    (3, 3, 0, 1, "zeros", 1, True),
    (2, 2, 0, 1, "zeros", 1, True),
    (5, 1, "valid", 1, "zeros", 1, True),
    (3, 1, 2, 2, "circular", 2, True),
    ((3, 5), (2, 1), (1, 2), (1, 1), "replicate", 1, True),
    ((5, 3), (1, 2), (2, 1), (2, 1), "reflect", 1, True),
]


@pytest.mark.parametrize("geometry", CONV2D, ids=str)
@pytest.mark.parametrize("h", [13, 37])
def test_conv2d(manager, geometry, h):
    k, s, p, d, mode, g, bias = geometry
    conv = nn.Conv2d(4, 6, k, s, p, d, groups=g, bias=bias, padding_mode=mode)
    n_out = conv(torch.zeros(1, 4, h, 10)).size(-2)
    if n_out < WORLD:  # fewer output rows than ranks: a clear error, on every rank
        with pytest.raises(mpidp.ConfigError, match=f"gives {n_out} output rows"):
            check(manager, conv, mpidp.DomainParallelConv2d, (2, 4, h, 10))
        return
    check(manager, conv, mpidp.DomainParallelConv2d, (2, 4, h, 10))


@pytest.mark.parametrize(
    "geometry",
    [
        (3, 1, 1, 1, "zeros"),
        (5, 2, 2, 1, "circular"),
        (4, 3, "valid", 2, "zeros"),
        (3, 1, "same", 2, "reflect"),
    ],
    ids=str,
)
def test_conv1d_along_its_length(manager, geometry):
    k, s, p, d, mode = geometry
    conv = nn.Conv1d(3, 5, k, s, p, d, padding_mode=mode)
    check(manager, conv, mpidp.DomainParallelConv1d, (2, 3, 29), shard_dim=-1)


@pytest.mark.parametrize(
    "geometry",
    [
        (3, 1, 1, 1, "zeros"),
        ((3, 5, 3), (1, 2, 2), (1, 2, 0), 1, "zeros"),
        (3, 1, 1, 1, "replicate"),
    ],
    ids=str,
)
def test_conv3d_along_h(manager, geometry):
    k, s, p, d, mode = geometry
    conv = nn.Conv3d(2, 3, k, s, p, d, padding_mode=mode)
    check(manager, conv, mpidp.DomainParallelConv3d, (1, 2, 4, 17, 6))


# (kernel, stride, padding, output_padding, dilation, groups)
CONV_T = [
    (2, 2, 0, 0, 1, 1),
    (3, 2, 1, 1, 1, 1),
    (4, 2, 1, 0, 1, 2),
    (3, 1, 1, 0, 1, 1),
    (1, 3, 0, 2, 1, 1),
    (5, 3, 2, 1, 2, 1),
    (3, 2, 0, 1, 2, 1),
    (4, 4, 0, 0, 1, 1),
    ((3, 2), (2, 1), (1, 0), (1, 0), (1, 1), 1),
]


@pytest.mark.parametrize("geometry", CONV_T, ids=str)
@pytest.mark.parametrize("h", [13, 19])
def test_conv_transpose2d(manager, geometry, h):
    k, s, p, op, d, g = geometry
    conv = nn.ConvTranspose2d(4, 6, k, s, p, op, groups=g, dilation=d)
    check(manager, conv, mpidp.DomainParallelConvTranspose2d, (2, 4, h, 7))


def test_conv_transpose3d_and_1d(manager):
    conv3 = nn.ConvTranspose3d(2, 3, 3, (1, 2, 2), 1, (0, 1, 1))
    check(manager, conv3, mpidp.DomainParallelConvTranspose3d, (1, 2, 3, 11, 5))
    conv1 = nn.ConvTranspose1d(2, 3, 4, 2, 1)
    check(manager, conv1, mpidp.DomainParallelConvTranspose1d, (2, 2, 15), shard_dim=-1)


def test_thin_shards_multi_hop(manager):
    """A 7-row kernel over shards of 2-3 rows: the halo comes from two ranks away."""
    conv = nn.Conv2d(2, 2, 7, 1, 3, padding_mode="reflect")
    check(manager, conv, mpidp.DomainParallelConv2d, (1, 2, 2 * WORLD + 3, 5))


def test_state_dict_keys_unchanged(manager):
    conv = nn.ConvTranspose2d(2, 3, 3, 2, 1).to(F64)
    dist = mpidp.DomainParallelConvTranspose2d.from_module(copy.deepcopy(conv), manager)
    assert list(dist.state_dict()) == list(conv.state_dict())
    assert isinstance(dist, nn.ConvTranspose2d)
