"""mpidp.compat.anemoi: anemoi's documented usage with only the import changed, against the
same code with ``mgroup=None`` (anemoi's serial path: every primitive the identity), in
float64: outputs, input gradients and parameter gradients at 1e-10 relative, on uneven cuts
(7 and 11 nodes) and a cut with an empty shard (fewer nodes than ranks, fewer heads)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import rand
from mpi4py import MPI

import mpidp
from mpidp.comm import TorchTransport
from mpidp.compat.anemoi.graph import (
    gather_tensor,
    reduce_shard_tensor,
    reduce_tensor,
    shard_tensor,
    sync_tensor,
)
from mpidp.compat.anemoi.khop_edges import (
    get_k_hop_edges,
    sort_edges_1hop_chunks,
    sort_edges_1hop_sharding,
)
from mpidp.compat.anemoi.shapes import change_channels_in_shape, get_shape_shards
from mpidp.compat.anemoi.transformer import shard_heads, shard_sequence

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
ME = MPI.COMM_WORLD.Get_rank()
HEADS, CH = 3, 2  # 3 heads: uneven over 2 ranks, one rank without a head over 4
NODES = [7, 11] + ([WORLD - 1] if WORLD > 2 else [])  # WORLD - 1 nodes: the last shard empty
TOL = {"rtol": 1e-10, "atol": 1e-12}


@pytest.fixture(scope="module")
def manager():
    """The default manager, as an anemoi user's setup makes it: a torch ProcessGroup then
    names its group."""
    with mpidp.init(domain_parallel_size=WORLD) as m:
        yield m


@pytest.fixture(params=["process_group", "torch"])
def mgroup(request, manager):
    """What anemoi passes (a torch ProcessGroup; CPU tensors then go through MPI), and a
    torch.distributed transport."""
    if request.param == "process_group":
        return manager.domain_group
    return TorchTransport(manager.domain_group)


def graph(n, seed):
    """Edges into every node from random sources, in random order (not sorted by
    destination), and their attributes."""
    gen = torch.Generator().manual_seed(seed)
    dst = torch.randint(0, n, (3 * n,), generator=gen)
    src = torch.randint(0, n, (3 * n,), generator=gen)
    return torch.stack([src, dst]), rand((3 * n, 2), seed + 1)


def layer(x, edge_attr, edge_index, params, mgroup):
    """anemoi's processor pattern: shard the nodes, message passing on each rank's incoming
    edges (1-hop sharding), attention over the node sequence with heads exchanged, a reverse
    scatter reduced and sharded, everything gathered for a loss every rank computes alike."""
    w1, we, wq, w2 = params
    n = x.size(0)
    shapes = get_shape_shards(x, 0, mgroup)
    hshapes = change_channels_in_shape(shapes, HEADS * CH)
    rank = 0 if mgroup is None else _group_rank(mgroup)
    lo = sum(s[0] for s in shapes[:rank])

    h = torch.tanh(shard_tensor(x, 0, shapes, mgroup) @ w1)  # (n_r, HEADS * CH)
    attr, index, attr_shapes, index_shapes = sort_edges_1hop_sharding(
        n, edge_attr, edge_index, mgroup
    )
    ea = shard_tensor(attr, 0, attr_shapes, mgroup)
    ei = shard_tensor(index, 1, index_shapes, mgroup)
    h_all = sync_tensor(h, 0, hshapes, mgroup)  # every node, a different use on each rank
    msg = h_all[ei[0]] * (ea @ we)
    agg = torch.zeros(n, HEADS * CH, dtype=x.dtype).index_add(0, ei[1], msg)
    h = h + shard_tensor(agg, 0, hshapes, mgroup, gather_in_backward=False)

    q = (h @ wq).reshape(1, -1, HEADS, CH).transpose(1, 2)  # (1, heads, n_r, ch)
    q = shard_heads(q, shapes, mgroup)
    att = F.scaled_dot_product_attention(q, q, q)
    att = shard_sequence(att, shapes, mgroup).transpose(1, 2).reshape(-1, HEADS * CH)
    h = h + att

    back = h[ei[1] - lo] * (ea @ w2)  # from this rank's nodes back along its edges
    rev = torch.zeros(n, HEADS * CH, dtype=x.dtype).index_add(0, ei[0], back)
    h = h + reduce_shard_tensor(rev, 0, hshapes, mgroup)

    energy = reduce_tensor((h**2).sum(), mgroup)  # one value, the same on every rank
    return gather_tensor(h, 0, hshapes, mgroup), energy


def _group_rank(mgroup):
    """This rank's place in ``mgroup`` (a transport, or a process group of any ranks)."""
    return mgroup.rank if isinstance(mgroup, TorchTransport) else dist.get_rank(mgroup)


def run(n, mgroup):
    """Output, energy, and the gradients of x, the edge attributes and the parameters (summed
    over ranks, as anemoi's data-parallel reduction of the model group would)."""
    x = rand((n, 4), 1).requires_grad_()
    edge_index, edge_attr = graph(n, 2)
    edge_attr.requires_grad_()
    params = [
        rand(s, 3 + i).requires_grad_()
        for i, s in enumerate([(4, HEADS * CH), (2, HEADS * CH), (HEADS * CH,) * 2, (2, 1)])
    ]
    out, energy = layer(x, edge_attr, edge_index, params, mgroup)
    ((out * rand(out.shape, 9)).sum() + energy).backward()
    grads = [p.grad for p in params]
    if mgroup is not None:
        grads = [mpidp.all_reduce(g, group=mgroup) for g in grads]
    return [out.detach(), energy.detach(), x.grad, edge_attr.grad, *grads]


@pytest.mark.parametrize("n", NODES)
def test_anemoi_usage_equals_serial(mgroup, n):
    names = ["output", "energy", "x.grad", "edge_attr.grad", "w1", "we", "wq", "w2"]
    for name, got, want in zip(names, run(n, mgroup), run(n, None), strict=True):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, k=name: f"{k}: {m}")


def test_shapes_are_tensor_split_cut(mgroup):
    x = torch.zeros(2, 11, 5)
    want = [list(p.shape) for p in torch.tensor_split(x, WORLD, dim=1)]
    assert get_shape_shards(x, 1, mgroup) == want
    assert get_shape_shards(x, -2, mgroup) == want
    few = torch.zeros(WORLD - 1, 3)  # fewer rows than ranks: the last shard empty
    assert get_shape_shards(few, 0, mgroup) == [
        list(p.shape) for p in torch.tensor_split(few, WORLD)
    ]


def brute_chunks(num_nodes, attr, index, chunks):
    """anemoi's meaning, by brute force: chunk i holds the edges into the i-th part of
    tensor_split's cut of the destination nodes, in edge order."""
    n = num_nodes if isinstance(num_nodes, int) else num_nodes[1]
    out = []
    for part in torch.arange(n).tensor_split(chunks):
        keep = [e for e in range(index.size(1)) if int(index[1, e]) in part.tolist()]
        out.append((attr[keep], index[:, keep]))
    return out


@pytest.mark.parametrize("chunks", [1, 3, 4, 9])
def test_edge_chunks_match_anemoi_meaning(chunks):
    """Unsorted edges, a bipartite graph, more chunks than destination nodes (empty chunks)."""
    index, attr = graph(7, 5 + chunks)
    bip = torch.stack([index[0] + 2, index[1]])  # 9 sources, 7 destinations
    for num_nodes, idx in [(7, index), ((9, 7), bip)]:
        attrs, indices = sort_edges_1hop_chunks(num_nodes, attr, idx, chunks)
        want = brute_chunks(num_nodes, attr, idx, chunks)
        assert len(attrs) == len(indices) == chunks
        for a, i, (wa, wi) in zip(attrs, indices, want, strict=True):
            assert torch.equal(a, wa) and torch.equal(i, wi)


def test_sharding_concatenates_the_chunks_rank_by_rank(mgroup):
    index, attr = graph(11, 7)
    a, i, sa, si = sort_edges_1hop_sharding((11, 11), attr, index, mgroup)
    want = brute_chunks(11, attr, index, WORLD)
    assert torch.equal(a, torch.cat([w[0] for w in want]))
    assert torch.equal(i, torch.cat([w[1] for w in want], 1))
    assert sa == [w[0].shape for w in want] and si == [w[1].shape for w in want]


def test_k_hop_edges_reach_the_nodes():
    """Two hops into nodes {0, 5}: every edge into them, and every edge into those edges'
    sources, in edge order; the same with a boolean mask."""
    index, attr = graph(11, 8)
    nodes = torch.tensor([5, 0])
    hop1 = {int(s) for s, d in index.t() if int(d) in (0, 5)} | {0, 5}
    keep = [e for e in range(index.size(1)) if int(index[1, e]) in hop1]
    a, i = get_k_hop_edges(nodes, attr, index, num_hops=2)
    assert torch.equal(a, attr[keep]) and torch.equal(i, index[:, keep])
    mask = torch.zeros(11, dtype=torch.bool)
    mask[nodes] = True
    a, i = get_k_hop_edges(mask, attr, index, 2)
    assert torch.equal(i, index[:, keep])


@pytest.mark.mpi(min_size=2)
def test_refusals_are_raised_on_every_rank(mgroup):
    x = rand((1, HEADS, 5, CH), 1)
    with pytest.raises(mpidp.ConfigError, match="neither a size nor a shape"):
        gather_tensor(x, 2, [[5]] * WORLD, mgroup)
    with pytest.raises(mpidp.ConfigError, match="do not cut"):
        shard_tensor(x, 2, [(1, 1, 1, 1)] * WORLD, mgroup, gather_in_backward=False)
    heads = rand((1, 0 if ME == 0 else 1, 2 * WORLD, CH), 2)  # rank 0 none: not shard_heads' cut
    with pytest.raises(mpidp.ConfigError, match="expecting shard_heads' cut"):
        shard_sequence(heads, [2] * WORLD, mgroup)
