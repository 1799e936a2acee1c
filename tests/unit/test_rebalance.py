"""mpidp.rebalance without MPI: the fastest cut of measured costs, its policy, bad costs."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest

import mpidp
from mpidp.errors import ConfigError
from mpidp.runtime.partition import Aligned, Balanced, ShardSpec, Weighted
from mpidp.runtime.rebalance import fastest_counts


class _Agreeing:
    """A transport of ranks that all passed what this one passed."""

    def agree(self, problems, facts):
        return [], [f"rank 0: {p}" for p in problems]


def _manager(p, policy):
    m = SimpleNamespace(
        domain_world_size=p, rank=0, domain_rank=0, partition=policy, grid=(p, 1), dp_world_size=1
    )
    m.spec = lambda n: m.partition.spec(n, p)
    m.transport = lambda *a: _Agreeing()
    return m


def _worst(counts, speeds, unit=1, extra=None):
    extra = extra or [0] * len(counts)
    return max((c * unit + e) / s for c, e, s in zip(counts, extra, speeds, strict=True))


@pytest.mark.parametrize("speeds", [(1.0, 1.0, 2.0), (3.0, 1.0), (1.0, 5.0, 1.0, 0.5)])
@pytest.mark.parametrize("units", [4, 7, 13])
def test_fastest_counts_minimise_the_slowest_rank(speeds, units):
    """Against every composition of ``units`` (at least one unit each): no cut is faster."""
    p = len(speeds)
    got = fastest_counts(units, speeds, least=1)
    assert sum(got) == units and min(got) >= 1
    best = min(
        _worst(c, speeds)
        for c in itertools.product(range(1, units + 1), repeat=p)
        if sum(c) == units
    )
    assert math.isclose(_worst(got, speeds), best)
    # aligned: blocks of 4 rows, the last rank also holds 3 rows left over
    extra = [0] * (p - 1) + [3]
    got = fastest_counts(units, speeds, 4, extra, least=0)
    best = min(
        _worst(c, speeds, 4, extra)
        for c in itertools.product(range(units + 1), repeat=p)
        if sum(c) == units
    )
    assert math.isclose(_worst(got, speeds, 4, extra), best)


def test_rebalance_gives_a_policy_of_the_current_kind():
    # two ranks, 37 rows (19, 18); rank 1 took twice as long per row: it gets a third
    m = _manager(2, Balanced())
    policy = mpidp.rebalance(m, [1.0, 36 / 19], rows=37)
    assert policy == Weighted((25, 12))
    assert policy.spec(37, 2).sizes == (25, 12) and policy.spec(19, 2).total == 19
    # aligned stays aligned (blocks of 4 and the row left over on the last rank)
    m = _manager(3, Aligned(4))
    policy = mpidp.rebalance(m, [1.0, 1.0, 3.0], rows=m.spec(37))
    spec = policy.spec(37, 3)
    assert isinstance(policy, Aligned) and all(o % 4 == 0 for o in spec.offsets)
    assert spec.sizes == (16, 16, 5)
    # a band with no rows (allowed to be empty) is taken at the mean speed and gets rows back
    m = _manager(3, Weighted((0, 1, 1), allow_empty=True))
    policy = mpidp.rebalance(m, [0.0, 1.0, 1.0], rows=30)
    assert policy.spec(30, 3).sizes == (10, 10, 10) and policy.allow_empty


@pytest.mark.parametrize(
    ("seconds", "match"),
    [
        ([1.0], "has 1 values"),
        ([1.0, -2.0], "negative, NaN"),
        ([1.0, float("nan")], "negative, NaN"),
        ([float("inf"), 1.0], "negative, NaN"),
        ([0.0, 1.0], "zero for a band with rows"),
        (["fast", 1.0], "not a sequence of numbers"),
    ],
)
def test_bad_costs_are_refused_and_the_partition_kept(seconds, match):
    m = _manager(2, Balanced())
    with pytest.raises(ConfigError, match=match) as err:
        mpidp.rebalance(m, seconds, rows=13)
    assert "rank 0" in str(err.value) and "fix:" in str(err.value)
    assert m.partition == Balanced()


def test_aligned_weights_cut_whole_blocks():
    a = Aligned(4, weights=(1, 1, 1, 3))
    assert a.spec(90, 4).sizes == (16, 12, 16, 46)  # 22 blocks: 4, 3, 4, 11; +2 on the last
    with pytest.raises(ConfigError, match="has 4 weights"):
        a.spec(90, 3)
    assert ShardSpec.from_sizes(Aligned(4).spec(90, 4).sizes) == Aligned(4).spec(90, 4)


def test_blocks_are_refused_with_the_reason():
    m = _manager(4, Balanced())
    m.grid = (2, 2)
    with pytest.raises(ConfigError, match=r"\(2, 2\) grid of blocks.*not a latitude factor"):
        mpidp.rebalance(m, [1.0] * 4, rows=13)
    assert m.partition == Balanced()
