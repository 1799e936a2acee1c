"""Indexing a band with an index tensor: a node encoder picks nodes by global id (shuffled,
with repeats), by a boolean mask, by a list, with ``index_select``, ``gather`` and
``take_along_dim`` along the sharded dim, through both front ends, against serial torch in
float64 on uneven bands (13 nodes over 1-4 ranks; 3 picked nodes over 4 ranks leaves a band
empty): outputs, input gradients, every parameter gradient at 1e-10. A mutation whose
backward writes repeated rows instead of adding them fails."""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpidp
import mpidp.sharded.select as select
from mpidp.sharded import shard
from mpidp.testing import assert_matches_serial
from tests.mpi.helpers import check_sharded, rand

WORLD = MPI.COMM_WORLD.Get_size()
N, C = 13, 3
_g = torch.Generator().manual_seed(5)
IDS = torch.randint(0, N, (17,), generator=_g)  # shuffled, with repeats
FEW = torch.tensor([9, 2, 9])  # 3 picks: one band of the result empty at 4 ranks
MASK = torch.rand(N, generator=_g) > 0.4
GATHER = torch.randint(0, N, (2, 11, C), generator=_g)


class NodeEncoder(nn.Module):
    """Picks nodes of a (B, N, C) band by id, then a linear layer on what it picked."""

    def __init__(self, pick) -> None:
        super().__init__()
        self.lin = nn.Linear(C, 4)
        self.pick = pick

    def forward(self, x):
        return self.lin(torch.tanh(self.pick(x)))


PICKS = {
    "ids with repeats": lambda x: x[:, IDS],
    "few ids": lambda x: x[:, FEW],
    "boolean mask": lambda x: x[:, MASK],
    "a list": lambda x: x[:, [4, 0, 4, 12]],
    "index_select": lambda x: torch.index_select(x, 1, IDS),
    "gather": lambda x: torch.gather(x, 1, GATHER),
    "take_along_dim": lambda x: torch.take_along_dim(x, GATHER, dim=1),
}


@pytest.fixture(scope="module")
def m():
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as manager:
        yield manager


def build(name):
    torch.manual_seed(3)
    return NodeEncoder(PICKS[name]).to(torch.float64)


@pytest.mark.parametrize("name", sorted(PICKS))
def test_picking_nodes_of_a_band_on_sharded_tensors(m, name):
    model = build(name)
    check_sharded(m, model, rand((2, N, C), 1), dim=1, module=model)


@pytest.mark.parametrize("name", sorted(PICKS))
def test_picking_nodes_of_a_band_through_conversion(m, name):
    serial = build(name)
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), m)
    assert_matches_serial(
        serial, dist, [rand((2, N, C), 2)], manager=m, modules=(serial, dist),
        rtol=1e-10, atol=1e-12,
    )  # fmt: skip


class _Overwrite(torch.autograd.Function):
    """The mutation: gather whose backward writes each picked row's gradient instead of adding
    (a repeated id keeps one of its gradients)."""

    @staticmethod
    def forward(ctx, src, dim, index):
        ctx.save_for_backward(index)
        ctx.dim, ctx.shape = dim, src.shape
        return torch.gather(src, dim, index)

    @staticmethod
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        return torch.zeros(ctx.shape, dtype=g.dtype).scatter(ctx.dim, index, g), None, None


@pytest.mark.mpi(min_size=2)
def test_a_backward_without_the_scatter_add_fails(m, monkeypatch):
    real = select.gather_rows
    monkeypatch.setattr(
        select, "gather_rows", lambda x, i, s, take=None: real(x, i, s, take=_Overwrite.apply)
    )
    model, full = build("gather"), rand((2, N, C), 1)
    xr = full.clone().requires_grad_()
    model(xr).sum().backward()
    x = shard(full, 1, m).requires_grad_()
    model(x).sum().backward()
    want = xr.grad.narrow(1, x.spec.start(x.rank), x.spec.sizes[x.rank])
    off = not torch.allclose(x.grad.local, want, rtol=1e-10, atol=1e-12)
    assert MPI.COMM_WORLD.allreduce(off, op=MPI.LOR)  # some rank's rows lost a repeat
