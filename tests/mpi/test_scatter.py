"""Graph ops with a sharded index (mpidp/sharded/scatter.py, select.py): messages gathered at a
band of edges and reduced back into the nodes (``scatter_add_``, ``scatter_reduce_``,
``index_add_``), and whole tensors read at a sharded index -- against the serial ops, float64,
uneven bands (empty ones too), forward, input and parameter gradients; a mutation that drops
the combine step fails."""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.runtime.partition import Balanced
from mpidp.sharded import Replicated, ShardedTensor, UnsupportedOp, replicated, shard
from mpidp.testing import assert_matches_serial
from tests.mpi.helpers import check_sharded, rand

WORLD = MPI.COMM_WORLD.Get_size()
TOL = {"rtol": 1e-10, "atol": 1e-12}
N, C = 11, 3


@pytest.fixture(scope="module")
def m():
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as manager:
        yield manager


def graph(edges: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(N, (edges,), generator=gen), torch.randint(N, (edges,), generator=gen)


REDUCTIONS = {
    "scatter_add_": lambda out, idx, msg, d: out.scatter_add_(0, idx, msg),
    "scatter_add": lambda out, idx, msg, d: torch.scatter_add(out, 0, idx, msg),
    "index_add_": lambda out, idx, msg, d: out.index_add_(0, d, msg, alpha=0.5),
    "sum": lambda out, idx, msg, d: out.scatter_reduce_(0, idx, msg, "sum"),
    "sum_without_self": lambda out, idx, msg, d: out.scatter_reduce(
        0, idx, msg, "sum", include_self=False
    ),
    "mean": lambda out, idx, msg, d: out.scatter_reduce_(0, idx, msg, "mean"),
    "mean_without_self": lambda out, idx, msg, d: out.scatter_reduce_(
        0, idx, msg, "mean", include_self=False
    ),
    "amax_detached": lambda out, idx, msg, d: out.scatter_reduce_(
        0, idx, msg.detach(), "amax", include_self=False
    ),
    "amin_detached": lambda out, idx, msg, d: out.scatter_reduce_(0, idx, msg.detach(), "amin"),
    "prod_detached": lambda out, idx, msg, d: out.scatter_reduce_(
        0, idx, msg.detach(), "prod", include_self=False
    ),
}


def message_passing(x, weight, src, dst, reduce):
    """Gather at the edges (sharded when x is), reduce into every node (a whole tensor on each
    rank), read it back at the edges and mix with the messages (a band of edges)."""
    msg = x.index_select(0, src) * weight
    idx = dst.view(-1, 1).expand_as(msg)
    base = rand((N, C), 7).to(msg.dtype)
    out = REDUCTIONS[reduce](base, idx, msg, dst)
    return out, out.index_select(0, dst) * msg + msg


def run(m, reduce, edges):
    src, dst = graph(edges)
    full = rand((N, C), 1)
    weight = rand((C,), 2).requires_grad_()
    xr = full.clone().requires_grad_()
    out_r, y_r = message_passing(xr, weight, src, dst, reduce)
    w = rand(tuple(y_r.shape), 5)
    ((y_r * w).sum() + (out_r * 0.25).sum()).backward()
    want_w = weight.grad.clone()
    weight.grad = None

    x = shard(full, 0, m).requires_grad_()
    out, y = message_passing(x, weight, src, dst, reduce)
    assert not isinstance(out, ShardedTensor) and isinstance(y, ShardedTensor)
    torch.testing.assert_close(out.as_subclass(torch.Tensor), out_r.detach(), **TOL)
    torch.testing.assert_close(y.full_tensor().as_subclass(torch.Tensor), y_r.detach(), **TOL)
    # the whole result is on every rank: its own term of the loss counts once (rank 0's)
    loss = (y * w).sum() + (out * 0.25).sum() * (1.0 if x.rank == 0 else 0.0)
    loss.backward()
    s = x.spec
    torch.testing.assert_close(x.grad.local, xr.grad[s.start(x.rank) : s.stop(x.rank)], **TOL)
    # each rank holds its share of a parameter's gradient; sync_gradients sums them
    torch.testing.assert_close(m.transport().all_reduce(weight.grad), want_w, **TOL)


@pytest.mark.parametrize("reduce", list(REDUCTIONS))
def test_messages_on_a_band_of_edges_reduce_into_the_nodes_as_serial(m, reduce):
    run(m, reduce, 23)


@pytest.mark.mpi(min_size=3)  # fewer edges than ranks: empty bands of edges
def test_fewer_edges_than_ranks_give_empty_bands_and_the_serial_result(m, monkeypatch):
    monkeypatch.setattr(m, "partition", Balanced(allow_empty=True))
    run(m, "scatter_add_", WORLD - 1)


@pytest.mark.mpi(min_size=2)  # one rank: nothing to combine
def test_dropping_the_combine_step_fails_the_comparison(m, monkeypatch):
    """Mutation: each rank's own edges only (no all-reduce) must not pass."""
    from mpidp.sharded import scatter

    monkeypatch.setattr(scatter, "all_reduce", lambda t, op, tr: t)
    with pytest.raises(AssertionError):
        run(m, "scatter_add_", 23)


def test_scatter_into_nodes_sharded_along_the_scatter_dim_equals_serial(m):
    src, dst = graph(23)
    full = rand((N, C), 1)
    xr = full.clone().requires_grad_()
    y_r = xr.index_add(0, dst, xr.index_select(0, src) * 2.0)
    w = rand((N, C), 5)
    (y_r * w).sum().backward()
    x = shard(full, 0, m).requires_grad_()
    y = x.index_add(0, dst, x.index_select(0, src) * 2.0)
    assert isinstance(y, ShardedTensor) and y.spec == x.spec
    torch.testing.assert_close(y.full_tensor().as_subclass(torch.Tensor), y_r.detach(), **TOL)
    (y * w).sum().backward()
    s = x.spec
    torch.testing.assert_close(x.grad.local, xr.grad[s.start(x.rank) : s.stop(x.rank)], **TOL)


@pytest.mark.parametrize("how", ["index_select", "getitem", "gather", "replicated"])
def test_a_whole_tensor_read_at_a_sharded_index_is_a_band_like_the_index(m, how):
    table = rand((N, C), 4).requires_grad_()
    _, dst = graph(23)
    idx = shard(dst, 0, m)
    reads = {
        "index_select": lambda t, i: t.index_select(0, i),
        "getitem": lambda t, i: t[i],
        "gather": lambda t, i: torch.gather(t, 0, i.view(-1, 1).expand(-1, C)),
        "replicated": lambda t, i: t.index_select(0, i),
    }
    want = reads[how](table, dst)
    w = rand(tuple(want.shape), 5)
    (want * w).sum().backward()
    want_g, table.grad = table.grad.clone(), None
    src = replicated(table, m.transport()) if how == "replicated" else table
    got = reads[how](src, idx)
    assert isinstance(got, ShardedTensor) and got.spec == idx.spec
    torch.testing.assert_close(got.full_tensor().as_subclass(torch.Tensor), want.detach(), **TOL)
    (got * w).sum().backward()
    g = table.grad if how == "replicated" else m.transport().all_reduce(table.grad)
    torch.testing.assert_close(g, want_g, **TOL)


def test_a_band_read_at_a_sharded_index_moves_the_rows_it_names(m):
    _, dst = graph(23)
    full = rand((N, C), 1)
    x = shard(full, 0, m)
    got = x.index_select(0, shard(dst, 0, m))
    torch.testing.assert_close(got.full_tensor().as_subclass(torch.Tensor), full[dst], **TOL)


@pytest.mark.mpi(min_size=2)  # one rank: the reduction is local
def test_amax_with_gradients_is_refused_on_every_rank(m):
    src, dst = graph(23)
    x = shard(rand((N, C), 1), 0, m).requires_grad_()
    msg = x.index_select(0, src)
    out = torch.zeros(N, C, dtype=msg.dtype)
    with pytest.raises(UnsupportedOp, match=r"reduce='amax'.*detach the source"):
        out.scatter_reduce_(0, dst.view(-1, 1).expand_as(msg), msg, "amax")
    assert not isinstance(out, Replicated)


class MessagePassing(nn.Module):
    """A graph layer written for one process: node features (B, N, C), messages gathered at
    the edges, summed into the nodes, a node update."""

    def __init__(self) -> None:
        super().__init__()
        src, dst = graph(23)
        self.register_buffer("src", src)
        self.register_buffer("dst", dst)
        self.msg = nn.Linear(C, C)
        self.update = nn.Linear(2 * C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.msg(x.index_select(1, self.src))
        agg = x.new_zeros(x.shape).index_add_(1, self.dst, m)
        return self.update(torch.cat([x, agg], -1))


def test_message_passing_through_both_front_ends_equals_serial(m):
    """The nodes cut into bands (dim 1 of (B, N, C)); the edges' messages summed into the
    node bands in place: a converted model and the model on ShardedTensors."""
    torch.manual_seed(4)
    serial = MessagePassing().to(torch.float64)
    full = rand((2, N, C), 1)
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), m, input_dim=-2)
    assert_matches_serial(
        serial, dist, [full], manager=m, dim=1, modules=(serial, dist), rtol=1e-10, atol=1e-12
    )
    twin = copy.deepcopy(serial)
    check_sharded(m, twin, full, dim=1, module=twin)


@pytest.mark.mpi(min_size=2)  # one rank: the band is the whole field
def test_a_converted_model_given_nothing_it_can_cut_is_an_error_on_every_rank(m):
    """(N, C) node bands pass a converted model as they are (they look like (B, D) vectors):
    its forward would index them with global node numbers; an error instead."""
    dist = mpidp.convert_to_domain_parallel(MessagePassing().to(torch.float64), m, input_dim=-2)
    band = shard(rand((N, C), 1), 0, m).local
    with pytest.raises(mpidp.ConfigError, match=rf"rank {m.rank}: .*no argument it can cut"):
        dist(band)
