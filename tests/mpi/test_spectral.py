"""Spectral models converted to domain parallel (float64, uneven token rows): the AFNO filter,
FNO's spectral convolution, the AFNONet and FNO2d models, against the serial models with the
oracle (output, input gradient, every parameter gradient, buffers); a 2 x 2 (dp x domain)
training run reproduces the serial losses."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import rand
from mpi4py import MPI

import mpidp
from mpidp.models import AFNOFilter, AFNONet, FNO2d, SpectralConv2d
from mpidp.models.spectral import (
    DomainParallelAFNOFilter,
    DomainParallelPatchRecovery,
    DomainParallelPositionEmbedding,
    DomainParallelSpectralConv2d,
)
from mpidp.testing import assert_matches_serial

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
F64 = torch.float64


def randomise(model, seed, scale=0.3):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return model


def converted(serial, manager):
    return mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager)


def cuts(h):
    """Row cuts of h rows: balanced, weighted, thin (one row on all but the last rank)."""
    p = WORLD
    out = {"balanced": mpidp.ShardSpec.balanced(h, p)}
    if p > 1:
        out["weighted"] = mpidp.ShardSpec.from_weights(range(p, 0, -1), h)
        out["thin"] = mpidp.ShardSpec.from_sizes([1] * (p - 1) + [h - p + 1])
    return out


CUTS = list(cuts(13))


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_afno_filter(manager, cut, fraction):
    h, w, c = 13, 10, 8
    serial = randomise(AFNOFilter(c, (h, w), num_blocks=2, hard_thresholding_fraction=fraction), 1)
    serial = serial.to(F64)
    dist = converted(serial, manager)
    assert isinstance(dist, DomainParallelAFNOFilter)
    sizes = cuts(h)[cut].sizes
    assert_matches_serial(
        serial,
        dist,
        [rand((2, h, w, c), 2)],
        manager=manager,
        dim=1,
        sizes=sizes,
        out_sizes=sizes,
        modules=(serial, dist),
    )


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("modes", [(3, 2), (6, 7)], ids=str)
def test_spectral_conv(manager, cut, modes):
    """modes2 = 2 of 7 W modes: at 2-4 ranks only the first ranks hold kept modes; the others
    still take part in both exchanges, forward and backward."""
    h, w = 13, 12
    serial = randomise(SpectralConv2d(3, 4, *modes), 3).to(F64)
    dist = converted(serial, manager)
    assert isinstance(dist, DomainParallelSpectralConv2d)
    sizes = cuts(h)[cut].sizes
    assert_matches_serial(
        serial,
        dist,
        [rand((2, 3, h, w), 4)],
        manager=manager,
        sizes=sizes,
        out_sizes=sizes,
        modules=(serial, dist),
    )


@pytest.fixture(params=["balanced", "weighted"])
def policy(request, manager):
    old = manager.partition
    if request.param == "weighted" and WORLD > 1:
        manager.partition = mpidp.Weighted(tuple(range(1, WORLD + 1)))
    yield request.param
    manager.partition = old


@pytest.mark.parametrize("grid", [(24, 16), (36, 20)], ids=str)
def test_afnonet(manager, policy, grid):
    """Patch 4: 6 or 9 token rows, cut unevenly (2/2/1/1 at 4 ranks); the head moves its pixel
    rows to the policy's cut of H."""
    serial = randomise(
        AFNONet(3, 2, grid, patch=4, embed_dim=8, depth=2, num_blocks=2, mlp_ratio=1.5), 5
    ).to(F64)
    dist = converted(serial, manager)
    assert isinstance(dist.pos_embed, DomainParallelPositionEmbedding)
    assert isinstance(dist.blocks[0].filter, DomainParallelAFNOFilter)
    assert isinstance(dist.head, DomainParallelPatchRecovery)
    assert isinstance(dist.patch_embed, mpidp.DomainParallelConv2d)
    assert list(dist.state_dict()) == list(serial.state_dict())
    assert_matches_serial(
        serial, dist, [rand((2, 3, *grid), 6)], manager=manager, modules=(serial, dist)
    )


def test_fno(manager, policy):
    serial = randomise(FNO2d(3, 2, modes1=4, modes2=3, width=6, depth=3), 7).to(F64)
    dist = converted(serial, manager)
    assert all(isinstance(s, DomainParallelSpectralConv2d) for s in dist.spectral)
    assert_matches_serial(
        serial, dist, [rand((2, 3, 19, 14), 8)], manager=manager, modules=(serial, dist)
    )


def test_plan_prices_the_transposes_that_run(manager, policy):
    """``mpidp plan``'s bytes for the spectral filters' all-to-alls and the head's row move equal
    what each rank's all-to-alls send in one forward and backward of the converted AFNONet."""
    from mpidp.preflight.plan import plan_model
    from mpidp.testing import count_traffic

    grid, shape = (36, 20), (2, 3, 36, 20)
    serial = AFNONet(3, 2, grid, patch=4, embed_dim=8, depth=2, num_blocks=2).to(F64)
    priced = plan_model(serial, shape, WORLD, partition=manager.partition, dtype=F64)
    dist = converted(serial, manager)
    rows = manager.spec(grid[0])
    me = manager.domain_rank
    x = rand(shape, 9).narrow(-2, rows.start(me), rows[me]).requires_grad_()
    with count_traffic(manager) as traffic:
        dist(x).sum().backward()
    sent = traffic.ops.get("all_to_all_v", [0, 0])[1]
    assert sent == priced.ranks[me].transpose_bytes, (sent, priced.ranks[me])
    assert (sent > 0) == (WORLD > 1)
