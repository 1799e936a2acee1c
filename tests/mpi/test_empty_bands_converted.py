"""A level that leaves a rank an empty band (5 rows strided to 3 over 4 ranks), as CREDIT's
CrossFormer's deepest level does at 3 ranks: the converted layers after it (a 1x1 conv that
mpidp runs on the band as it is, a norm, an upsample) take the empty band as the ShardedTensor
rules do, through both front ends, against serial torch (float64, 1e-10, every gradient).
Before, torch's convolution refused the zero-row input on that rank alone. Empty bands come by
default (issue 46, item 6) under every policy: an aligned one whose deep level has fewer whole
blocks than ranks, a weighted one whose deep level has fewer rows than ranks; the model's
input keeps its own cut (no empty band there)."""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.errors import ConfigError
from mpidp.testing import assert_matches_serial
from tests.mpi.helpers import check_sharded, rand

WORLD = MPI.COMM_WORLD.Get_size()


class DeepLevel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.pointwise = nn.Conv2d(3, 3, 1)
        self.norm = nn.GroupNorm(1, 3)
        self.up = nn.Upsample(scale_factor=2)

    def forward(self, x):
        h = self.norm(torch.relu(self.pointwise(self.down(x))))
        return self.up(h)[..., : x.shape[-2], :] + x[:, :1]


#: name: (the policy, the input's rows): at 2 ranks and more the policy itself refuses the
#: deep level's rows (too few rows, or whole blocks, for the ranks), but cuts the input
POLICIES = {
    "balanced": (mpidp.Balanced(), max(2 * WORLD - 2, 2)),
    "aligned": (mpidp.Aligned(2), 2 * WORLD + 1),
    "weighted": (mpidp.Weighted(tuple(range(WORLD, 0, -1))), WORLD),
}


@pytest.fixture(scope="module")
def manager():
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as made:
        yield made


@pytest.fixture(params=list(POLICIES))
def case(request, manager):
    """(the manager under the case's policy, the input's rows), the policy reset after."""
    policy, h = POLICIES[request.param]
    manager.partition = policy
    assert min(manager.spec(h).sizes) > 0  # the data's own cut: no empty band
    yield manager, h
    manager.partition = mpidp.Balanced()


def build():
    torch.manual_seed(4)
    return DeepLevel().to(torch.float64)


def test_a_deep_level_with_an_empty_band_through_conversion(case):
    m, h = case
    if WORLD > 1:  # the case is what it says: the default gives empty bands where the
        with pytest.raises(ConfigError):  # policy would refuse
            m.partition.spec((h + 1) // 2, WORLD)
    serial = build()
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), m)
    assert_matches_serial(
        serial, dist, [rand((2, 2, h, 6), 1)], manager=m, modules=(serial, dist),
        rtol=1e-10, atol=1e-12,
    )  # fmt: skip


def test_a_deep_level_with_an_empty_band_on_sharded_tensors(case):
    m, h = case
    model = build()
    check_sharded(m, model, rand((2, 2, h, 6), 2), dim=2, module=model)
