"""``mpidp plan``'s price of a spectral convolution with more output channels than input
channels against the bytes a real training step sends: rfft2's transposes carry the input's
channels and irfft2's the output's (and their adjoints in the backward), on bands and on
blocks (the world's grid: 2: 1 x 2, 3: bands, 4: 2 x 2, 6: 3 x 2), uneven in both dims.
Counted by :func:`mpidp.testing.count_traffic` on every rank."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import mpidp
from mpidp.models import SpectralConv2d
from mpidp.preflight.plan import plan_model
from mpidp.testing import count_traffic

WORLD = MPI.COMM_WORLD.Get_size()
GRID = {1: (1, 1), 2: (1, 2), 3: (3, 1), 4: (2, 2), 6: (3, 2)}.get(WORLD, (WORLD, 1))
SHAPE = (1, 2, 13, 20)


@pytest.mark.skipif(WORLD == 1, reason="one rank moves nothing")
def test_the_inverse_transform_is_priced_with_the_output_channels():
    def make() -> SpectralConv2d:
        torch.manual_seed(0)
        return SpectralConv2d(2, 5, 3, 4)

    with mpidp.DistributedManager(domain_parallel_size=GRID) as m:
        model = mpidp.convert_to_domain_parallel(make(), m)
        i, j = m.grid_coords
        rows = m.partition.spec(SHAPE[-2], GRID[0])
        cols = m.partition.spec(SHAPE[-1], GRID[1])
        x = torch.randn(SHAPE)[..., rows.slice(i), cols.slice(j)].contiguous()
        x.requires_grad_()  # as inside a network: the backward transposes the input's gradient
        model(x).sum().backward()  # the first call learns the partitions
        with count_traffic(m) as traffic:
            model(x).sum().backward()
        sent = traffic.ops.get("all_to_all_v", [0, 0])[1]
        rank = m.domain_rank
    priced = plan_model(make(), SHAPE, GRID, simulate=False, compare=False)
    assert sent == priced.ranks[rank].transpose_bytes > 0, (GRID, traffic)
