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
