"""The oracle helper itself: it passes on exact code and fails, on every rank, on wrong code."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import mpidp
from mpidp.testing import assert_matches_serial

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def manager():
    with mpidp.DistributedManager(domain_parallel_size=MPI.COMM_WORLD.Get_size()) as m:
        yield m


def _field(h: int, w: int = 5, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, h, w, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("h", [7, 13, 721])
def test_pointwise_function_matches(manager, h):
    result = assert_matches_serial(torch.sin, torch.sin, [_field(h)], manager=manager)
    assert result.max_abs_diff["output"] == 0.0
    assert "grad_input[0]" in result.max_abs_diff


def test_pointwise_module_parameter_gradients_match(manager):
    torch.manual_seed(3)
    serial = torch.nn.Conv2d(3, 4, kernel_size=1, dtype=torch.float64)
    dist = torch.nn.Conv2d(3, 4, kernel_size=1, dtype=torch.float64)
    dist.load_state_dict(serial.state_dict())
    result = assert_matches_serial(
        serial, dist, [_field(9)], manager=manager, modules=(serial, dist)
    )
    assert set(result.max_abs_diff) >= {"output", "grad_input[0]", "grad[weight]", "grad[bias]"}


def test_wrong_function_fails_on_every_rank(manager):
    # Only the last rank computes something wrong; every rank must see the failure.
    last = manager.domain_world_size - 1

    def wrong(x):
        return torch.sin(x) + (1e-6 if manager.domain_rank == last else 0.0)

    with pytest.raises(AssertionError, match=rf"rank {last}: output: max \|diff\|"):
        assert_matches_serial(torch.sin, wrong, [_field(11)], manager=manager)


def test_missing_cross_rank_term_is_caught(manager):
    # A "global" mean computed over the local band only: right at P=1, wrong at P>1.
    def local_mean(x):
        return x - x.mean(dim=-2, keepdim=True)

    def serial(x):
        return x - x.mean(dim=-2, keepdim=True)

    if manager.domain_world_size == 1:
        assert_matches_serial(serial, local_mean, [_field(8)], manager=manager)
    else:
        with pytest.raises(AssertionError, match="output"):
            assert_matches_serial(serial, local_mean, [_field(8)], manager=manager)
