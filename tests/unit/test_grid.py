"""The domain grid without MPI: its shape from ``domain_parallel_size``, block specs, and the
one-rank transport an axis with one rank along it is."""

from __future__ import annotations

import pytest
import torch

from mpidp.comm.single import SelfTransport
from mpidp.errors import ConfigError
from mpidp.runtime.grid import BlockSpec, block_spec, grid_shape
from mpidp.runtime.partition import Aligned, Balanced, ShardSpec


@pytest.mark.parametrize(
    ("domain", "world", "want"),
    [(1, 1, (1, 1)), (4, 8, (4, 1)), ((2, 2), 4, (2, 2)), ([1, 3], 6, (1, 3)), ((3, 1), 3, (3, 1))],
)
def test_grid_shape(domain, world, want):
    assert grid_shape(domain, world, 0) == want


@pytest.mark.parametrize(
    ("domain", "world", "match"),
    [
        (0, 4, r"^rank 2: domain_parallel_size must be an integer >= 1, got 0$"),
        (3, 4, r"world size 4 is not divisible by domain_parallel_size 3; use one of \[1, 2, 4\]"),
        ((2, 0), 4, r"pair of integers >= 1 \(blocks\), got \(2, 0\)"),
        ((2, -1), 4, r"got \(2, -1\)"),
        ((True, 2), 4, r"got \(True, 2\)"),
        ((2.0, 2), 4, r"got \(2.0, 2\)"),
        ((3, 2), 8, r"domain grid domain_parallel_size=\(3, 2\) of 6 ranks; use a grid whose "),
    ],
)
def test_bad_grid_is_refused(domain, world, match):
    with pytest.raises(ConfigError, match=match):
        grid_shape(domain, world, 2)


def test_grid_refusal_lists_the_grids_that_fit():
    with pytest.raises(ConfigError) as err:
        grid_shape((3, 1), 4, 0)
    assert "(2, 2)" in str(err.value) and "(1, 4)" in str(err.value)
    assert "launch a multiple of 3 ranks" in str(err.value)


def test_block_spec_cuts_each_dim_by_the_policy():
    bs = block_spec(Balanced(), (9, 13), (2, 3))
    assert bs == BlockSpec(ShardSpec((5, 4)), ShardSpec((5, 4, 4)))
    assert bs.grid == (2, 3) and bs.shape == (9, 13)
    assert bs.coords(4) == (1, 1)
    assert bs.block(4) == (slice(5, 9), slice(5, 9))
    assert bs.block_shape(2) == (5, 4)
    assert repr(bs) == "BlockSpec(lat=(5, 4), lon=(5, 4, 4), dims=(-2, -1))"
    # one policy per dim
    two = block_spec((Balanced(), Aligned(4)), (9, 13), (2, 3))
    assert two.lon == ShardSpec((4, 4, 5))
    with pytest.raises(ConfigError, match=r"^rank 1: blocks of \(2, 13\) over \(3, 1\): cannot"):
        block_spec(Balanced(), (2, 13), (3, 1), rank=1)
    with pytest.raises(ConfigError, match="rank 6 is not a block"):
        bs.coords(6)


def test_one_rank_transport_is_the_identity():
    t = SelfTransport()
    x = torch.arange(6.0).view(2, 3)
    assert (t.rank, t.size) == (0, 1)
    assert torch.equal(t.all_gather_v(x, [3], 1), x)
    assert torch.equal(t.all_reduce(x), x)
    assert t.all_gather_object("a") == ["a"] and t.all_gather_ints([1, 2]) == [[1, 2]]
    assert t.agree([], {"k": 1}, [5]) == ([[5]], [])
