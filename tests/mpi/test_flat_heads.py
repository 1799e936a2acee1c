"""A linear layer over a flattened field: ``Conv2d -> Flatten -> Linear`` (a global head, a
latent vector), the flatten merging the channels before the band (blocks) or not (one
channel), and the ``flat @ W`` form, through both front ends against serial torch, float64,
uneven bands (13 rows; 3 rows over 4 ranks strided leaves one empty): the contraction over
the band is a partial sum of each rank's entries against the weight's matching columns."""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.testing import assert_matches_serial
from tests.mpi.helpers import check_sharded, rand

WORLD = MPI.COMM_WORLD.Get_size()
H, W = 13, 4


class FlatHead(nn.Module):
    """A conv, then a linear map of the whole flattened field, fed back as a bias."""

    def __init__(self, channels: int = 3, stride: int = 1, rows: int = H, form: str = "linear"):
        super().__init__()
        self.conv = nn.Conv2d(2, channels, 3, padding=1, stride=stride)
        h, w = (rows - 1) // stride + 1, (W - 1) // stride + 1
        self.head = nn.Linear(channels * h * w, 2)
        self.form = form

    def forward(self, x):
        flat = nn.Flatten()(self.conv(x))
        z = self.head(flat) if self.form == "linear" else flat @ self.head.weight.T
        return x * torch.tanh(z)[:, :, None, None]


CASES = {
    "channels merged before the band": {},
    "one channel": {"channels": 1},
    "flat @ W": {"form": "matmul"},
}
if WORLD == 4:
    CASES["an empty band (5 rows strided to 3)"] = {"stride": 2, "rows": 5}


def build(name):
    torch.manual_seed(2)
    return FlatHead(**CASES[name]).to(torch.float64)


def rows(name):
    return CASES[name].get("rows", H)


@pytest.fixture(scope="module")
def m():
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as manager:
        yield manager


@pytest.mark.parametrize("name", sorted(CASES))
def test_flat_head_on_sharded_tensors(m, name):
    model = build(name)
    check_sharded(m, model, rand((2, 2, rows(name), W), 1), dim=2, module=model)


@pytest.mark.parametrize("name", sorted(CASES))
def test_flat_head_through_conversion(m, name):
    serial = build(name)
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), m)
    assert_matches_serial(
        serial, dist, [rand((2, 2, rows(name), W), 2)], manager=m, modules=(serial, dist),
        rtol=1e-10, atol=1e-12,
    )  # fmt: skip
