"""The oracle helper itself: it passes on exact code and fails, on every rank, on wrong code."""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI

import mpidp
from mpidp.testing import CommBudget, assert_matches_serial

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

    with pytest.raises(AssertionError, match=r"output: max \|diff\|"):
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


# -- every kind of wrong result is caught, on every rank (item by item of issue 16) ----------


def _gather_compute_slice(manager, op, cut):
    """A "layer" that all-gathers the whole field, runs ``op`` serially and returns the rows
    ``cut(n_out, P)`` assigns to this rank: right values, wrong everything else."""

    def layer(x):
        t = manager.transport()
        sizes = [row[0] for row in t.all_gather_ints([x.size(-2)])]
        whole = mpidp.all_gather_v(x, sizes, dim=-2, group=manager)
        y = op(whole)
        out = cut(y.size(-2), t.size)
        return y.narrow(-2, sum(out[: t.rank]), out[t.rank])

    return layer


def _reversed_policy(manager):
    return lambda n, p: tuple(reversed(manager.spec(n).sizes))


def test_reversed_output_partition_is_caught(manager):
    conv = torch.nn.Conv2d(3, 2, 3, padding=1, dtype=torch.float64)
    layer = _gather_compute_slice(manager, conv, _reversed_policy(manager))
    x = _field(7)
    if manager.spec(7).sizes == tuple(reversed(manager.spec(7).sizes)):  # P=1: the same cut
        assert_matches_serial(conv, layer, [x], manager=manager)
        return
    with pytest.raises(AssertionError, match=r"output: partition \(.*\) along dim 2 is not"):
        assert_matches_serial(conv, layer, [x], manager=manager)


def test_weighted_policy_ignored_is_caught(manager):
    p = manager.domain_world_size
    balanced = lambda n, parts: mpidp.ShardSpec.balanced(n, parts).sizes  # noqa: E731
    layer = _gather_compute_slice(manager, torch.sin, balanced)
    old = manager.partition
    manager.partition = mpidp.Weighted(tuple(range(1, p + 1)))
    try:
        if p == 1:
            assert_matches_serial(torch.sin, layer, [_field(17)], manager=manager)
            return
        with pytest.raises(AssertionError, match=r"is not the expected .*Weighted"):
            assert_matches_serial(torch.sin, layer, [_field(17)], manager=manager)
    finally:
        manager.partition = old


def test_communication_budget_catches_a_gathering_layer(manager):
    conv = torch.nn.Conv2d(3, 2, 3, padding=1, dtype=torch.float64)
    layer = _gather_compute_slice(manager, conv, lambda n, parts: manager.spec(n).sizes)
    x = _field(13, w=8)
    row = 2 * 3 * 8 * 8  # bytes of one row of the input
    result = assert_matches_serial(conv, layer, [x], manager=manager)  # values are right
    me = manager.domain_rank
    if manager.domain_world_size == 1:
        assert result.traffic.bytes == 0
        return
    assert result.traffic.ops["all_gather_v"] == [1, manager.spec(13).sizes[me] * row]
    with pytest.raises(AssertionError, match=r"sent \d+ bytes, budget"):
        assert_matches_serial(conv, layer, [x], manager=manager, budget=CommBudget(bytes=2 * row))


def test_nan_in_part_of_the_output_is_caught(manager):
    x = _field(10)
    x[0, 0, 0, 0] = float("nan")  # the serial output holds one NaN

    def nan_band(y):
        out = torch.sin(y)
        return torch.where(torch.arange(y.size(-1)) < 2, torch.nan, out)  # 40% NaN

    with pytest.raises(AssertionError, match=r"output: .* entries differ; first at .*got nan"):
        assert_matches_serial(torch.sin, nan_band, [x], manager=manager)
    result = assert_matches_serial(torch.sin, torch.sin, [x], manager=manager)  # NaN where NaN
    assert result.max_abs_diff["output"] == 0.0


def test_wrong_value_where_serial_is_finite_names_both_values(manager):
    def shifted(y):
        return torch.sin(y) + 0.5

    with pytest.raises(AssertionError, match=r"got -?\d\.\d+ want -?\d\.\d+"):
        assert_matches_serial(torch.sin, shifted, [_field(9)], manager=manager)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def test_wrong_input_gradient_is_caught(manager):
    def wrong(x):
        return torch.sin(_ScaleGrad.apply(x, 1.0 + 1e-9))

    with pytest.raises(AssertionError, match=r"grad_input\[0\]: max \|diff\|"):
        assert_matches_serial(torch.sin, wrong, [_field(9)], manager=manager)


class _Affine(torch.nn.Module):
    def __init__(self, scale=1.0, detach=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))
        self.scale, self.detach = scale, detach

    def forward(self, x):
        w = self.weight.detach() if self.detach else _ScaleGrad.apply(self.weight, self.scale)
        return x * w[:, None, None]


def test_wrong_and_missing_parameter_gradients_are_caught(manager):
    serial = _Affine()
    with pytest.raises(AssertionError, match=r"grad\[weight\]: max \|diff\|"):
        wrong = _Affine(scale=1.0 + 1e-9)
        assert_matches_serial(serial, wrong, [_field(9)], manager=manager, modules=(serial, wrong))
    serial.zero_grad()
    with pytest.raises(AssertionError, match=r"grad\[weight\]: no gradient on any rank"):
        missing = _Affine(detach=True)
        assert_matches_serial(
            serial, missing, [_field(9)], manager=manager, modules=(serial, missing)
        )


def test_shape_and_dtype_mismatches_are_caught(manager):
    with pytest.raises(AssertionError, match=r"output: shapes by rank .* do not cut"):
        assert_matches_serial(
            torch.sin, lambda x: torch.sin(x)[..., :-1], [_field(9)], manager=manager
        )
    with pytest.raises(AssertionError, match=r"output: dtype torch.float32 != serial"):
        assert_matches_serial(
            torch.sin, lambda x: torch.sin(x).float(), [_field(9)], manager=manager
        )


def test_float32_round_trip_in_a_float64_path_is_caught(manager):
    with pytest.raises(AssertionError, match=r"output: max \|diff\|"):
        assert_matches_serial(
            torch.sin, lambda x: torch.sin(x.float()).double(), [_field(9)], manager=manager
        )


def test_modules_must_start_from_the_same_state(manager):
    torch.manual_seed(5)
    serial = torch.nn.Conv2d(3, 4, 1, dtype=torch.float64)
    other = torch.nn.Conv2d(3, 4, 1, dtype=torch.float64)  # other weights: not repaired
    with pytest.raises(AssertionError, match=r"(?s)\(before the run\).*distributed weight differs"):
        assert_matches_serial(serial, other, [_field(9)], manager=manager, modules=(serial, other))


def test_garbage_in_buffers_is_caught(manager):
    def pair():
        serial = torch.nn.BatchNorm2d(3, dtype=torch.float64)
        return serial, mpidp.DomainParallelBatchNorm2d.from_module(copy.deepcopy(serial), manager)

    serial, dist = pair()
    assert_matches_serial(serial, dist, [_field(9)], manager=manager, modules=(serial, dist))
    serial, dist = pair()

    def garbage(x):
        y = dist(x)
        dist.running_mean.data.add_(1e-9)
        return y

    with pytest.raises(AssertionError, match=r"buffer\[running_mean\]: max \|diff\|"):
        assert_matches_serial(serial, garbage, [_field(9)], manager=manager, modules=(serial, dist))
