"""A subclass of a torch layer that computes something else than the layer (its own
``forward``, or parameters given by a parametrization) is not swapped for the layer's band
form, which would silently drop the difference: a converted model runs its forward op by op
on ShardedTensors, equal to serial; a subclass that computes what its base does (a new
``__init__`` only) is still converted to the band layer.

Float64, uneven bands at 1-4 ranks; output, input gradient and every parameter gradient
against serial (``mpidp.testing.assert_matches_serial``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import rand
from mpi4py import MPI
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import mpidp
from mpidp.layers import DomainParallelConv2d
from mpidp.testing import assert_matches_serial

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()


class Standardised(nn.Conv2d):
    """A weight-standardised convolution (diffusion U-Nets' ``WeightStandardizedConv2d``)."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean((1, 2, 3), keepdim=True)) / (w.var((1, 2, 3), keepdim=True) + 1e-5).sqrt()
        return self._conv_forward(x, w, self.bias)


class Centred(nn.Conv2d):
    """Its output minus its mean over the whole field: not a local change."""

    def forward(self, x):
        y = super().forward(x)
        return y - y.mean((-2, -1), keepdim=True)


class Widened(nn.Conv2d):
    """A new constructor only: what a Conv2d computes."""

    def __init__(self, channels):
        super().__init__(channels, channels, 3, padding=1)


MODULES = {
    "own forward": lambda: Standardised(2, 3, 3, padding=1),
    "own forward, not local": lambda: Centred(2, 3, 3, padding=1),
    "weight norm": lambda: weight_norm(nn.Conv2d(2, 3, 3, padding=1)),
    "spectral norm": lambda: spectral_norm(nn.Conv2d(2, 3, 3, padding=1)),
}


@pytest.fixture(scope="module")
def m():
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as manager:
        yield manager


@pytest.mark.parametrize("name", list(MODULES))
def test_a_subclass_that_computes_otherwise_runs_op_by_op(m, name):
    torch.manual_seed(5)
    serial = nn.Sequential(MODULES[name](), nn.ReLU()).double().eval()
    verdicts = mpidp.explain_conversion(serial)
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), m)
    assert not isinstance(dist[0], DomainParallelConv2d)
    assert verdicts[0].action == "left" and "op by op" in verdicts[0].why, verdicts[0]
    assert_matches_serial(
        serial, dist, [rand((2, 2, 13, 8), 1)], manager=m, modules=(serial, dist),
        rtol=1e-10, atol=1e-12,
    )  # fmt: skip


def test_a_subclass_with_a_constructor_only_is_converted(m):
    torch.manual_seed(6)
    serial = nn.Sequential(Widened(2)).double()
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), m)
    assert isinstance(dist[0], DomainParallelConv2d)
    assert_matches_serial(
        serial, dist, [rand((2, 2, 13, 8), 2)], manager=m, modules=(serial, dist),
        rtol=1e-10, atol=1e-12,
    )  # fmt: skip
