"""``mpidp explain`` (mpidp/preflight/explain.py): the model run once on meta ShardedTensors says
what a real run does. Checked against real runs: the bytes each rank sends in the forward pass equal
what a real forward on the same shapes sends (counted on the wire), the result layouts equal
the real ones, and a model with an op that has no band form is refused at that op, with the
same message on every rank as the real run; a meta transport that gets a shape wrong fails."""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.preflight.explain import explain, simulate
from mpidp.preflight.plan import build_model
from mpidp.sharded import UnsupportedOp, shard
from mpidp.testing import count_traffic
from tests.mpi.helpers import rand
from tests.mpi.test_layouts import Swin, Tokens3D

WORLD = MPI.COMM_WORLD.Get_size()


@pytest.fixture(scope="module")
def m():
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as manager:
        yield manager


CASES = {  # uneven bands at 2 and 3 ranks
    "unet": (lambda: build_model("unet", 3, (29, 16)), (1, 3, 29, 16)),
    "afno": (lambda: build_model("afno", 3, (20, 16)), (1, 3, 20, 16)),  # 5 patch rows
    "graph": (lambda: build_model("graph", 3, (13, 8)), (1, 3, 13, 8)),
    "swin_windows": (lambda: Swin((20, 8)), (2, 2, 20, 8)),
    "tokens_3d": (lambda: Tokens3D(), (2, 2, 3, 13, 6)),
}


def real_forward(m, model, shape):
    """Bytes this rank sends in a real forward, and the output's partition."""
    with count_traffic(m) as traffic:
        y = model(shard(rand(shape, 1), len(shape) - 2, m))
    return traffic.bytes, tuple(y.spec.sizes)


@pytest.mark.parametrize("name", list(CASES))
def test_the_explained_bytes_are_what_a_real_forward_sends(m, name):
    make, shape = CASES[name]
    torch.manual_seed(0)
    model = make().to(torch.float64)
    sent, rows = real_forward(m, copy.deepcopy(model), shape)
    e = explain(model, shape, dim=len(shape) - 2, manager=m, dtype=torch.float64)
    assert e.refused is None and e.stopped is None, (e.refused, e.stopped)
    assert e.sent[m.rank] == sent, (e.sent, sent)
    assert e.output.endswith(str(list(rows))), (e.output, rows)
    assert all(len(s.sent) == WORLD for s in e.steps)


def test_a_window_partition_shows_its_blocks(m):
    e = explain(Swin((20, 8)), (2, 2, 20, 8), manager=m)
    text = str(e)
    assert "blocks" in text and "blocks.0 (WindowBlock)" in text
    assert f"{WORLD} ranks" in text


class Unbandable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.inner = nn.Sequential(nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y + torch.linalg.matrix_exp(y)  # mixes every row of each (H, W) matrix


@pytest.mark.mpi(min_size=2)  # one rank holds the whole field: nothing to refuse
def test_the_first_refusal_is_the_real_runs_on_every_rank(m):
    shape = (1, 2, 8, 8)
    with pytest.raises(UnsupportedOp) as real:
        Unbandable()(shard(rand(shape, 1).float(), 2, m))
    with count_traffic(m) as outer:  # explain inside a count of the caller's: both count
        e = explain(Unbandable(), shape, manager=m)
    assert outer.bytes >= sum(s.sent[m.rank] for s in e.steps)
    assert e.refused is not None and "linalg_matrix_exp" in e.refused
    assert "fix:" in e.refused and "in Unbandable.forward" in e.refused
    assert e.refused.split(": ", 1)[1] == str(real.value).split(": ", 1)[1]
    assert [s.op for s in e.steps] == ["torch.conv2d"]
    assert "REFUSED" in str(e)


@pytest.mark.mpi(min_size=2)  # one rank: no collective to get wrong
def test_a_meta_collective_of_the_wrong_shape_fails_the_comparison(m, monkeypatch):
    """Mutation: an all-to-all that answers with the sent rows instead of the received ones
    changes what later calls send (the FFT's transposes of uneven bands)."""
    from mpidp.comm import meta

    monkeypatch.setattr(
        meta.MetaTransport,
        "_all_to_all_v",
        lambda self, x, send, recv, p=None: meta._meta(sum(send), x),
    )
    make, shape = CASES["afno"]
    torch.manual_seed(0)
    model = make().to(torch.float64)
    sent, _ = real_forward(m, copy.deepcopy(model), shape)
    try:
        e = explain(model, shape, manager=m, dtype=torch.float64)
    except Exception:  # a shape error: the mutation is caught too
        return
    assert e.stopped is not None or e.sent[m.rank] != sent


def _seeded(make):
    def build():
        torch.manual_seed(0)
        return make().to(torch.float64)

    return build


@pytest.mark.parametrize("name", list(CASES))
def test_one_process_simulating_every_rank_explains_what_the_job_does(m, name):
    """``simulate`` runs each rank's forward in turn in this one process (no launch, no
    communication): the same steps, layouts and bytes per rank as the explanation of the real
    job of as many ranks, and the same output layout. The job is a fresh one (a new manager), as
    every simulation is: its halo exchanges agree on their arguments at their first call."""
    make, shape = CASES[name]
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as fresh:
        real = explain(
            _seeded(make)(), shape, dim=len(shape) - 2, manager=fresh, dtype=torch.float64
        )
    alone = simulate(_seeded(make), shape, parts=WORLD, dim=len(shape) - 2, dtype=torch.float64)
    assert alone.sent == real.sent, (alone.sent, real.sent)
    assert [(s.path, s.op, s.layout, s.calls) for s in alone.steps] == [
        (s.path, s.op, s.layout, s.calls) for s in real.steps
    ]
    assert (alone.output, alone.refused, alone.input_rows) == (
        real.output,
        real.refused,
        real.input_rows,
    )


def test_one_process_simulating_every_rank_finds_the_first_refusal(m):
    real = explain(Unbandable(), (1, 2, 8, 8), manager=m)
    alone = simulate(Unbandable, (1, 2, 8, 8), parts=WORLD)
    assert alone.refused is not None and real.refused is not None
    assert alone.refused.split(": ", 1)[1] == real.refused.split(": ", 1)[1]
    assert alone.sent == real.sent
