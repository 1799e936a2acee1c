"""Edge helpers of mpidp.graph (no MPI): anemoi's k-hop and 1-hop chunk helpers against
direct definitions, destination sorting, node sets and the generated mesh graphs."""

from __future__ import annotations

import pytest
import torch

from mpidp.errors import ConfigError
from mpidp.graph import (
    BandNodes,
    Graph,
    Nodes,
    edge_split,
    get_k_hop_edges,
    is_dst_sorted,
    sort_by_destination,
    sort_edges_1hop_chunks,
)
from mpidp.graph.graphcast import fibonacci_mesh, grid_points, knn_edges
from mpidp.runtime.partition import ShardSpec


def random_graph(n=17, e=60, seed=0):
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, n, (2, e), generator=gen)
    attr = torch.arange(e, dtype=torch.float64)[:, None] * torch.ones(1, 2, dtype=torch.float64)
    return index, attr


@pytest.mark.parametrize("hops", [1, 2, 3])
def test_k_hop_edges_are_every_edge_whose_message_reaches_the_nodes(hops):
    index, attr = random_graph()
    nodes = torch.tensor([3, 11])
    got_attr, got_index = get_k_hop_edges(nodes, attr, index, hops, num_nodes=17)
    # direct definition: an edge counts when its destination is within hops-1 steps upstream
    frontier, keep = {3, 11}, set()
    for _ in range(hops):
        new = {e for e in range(index.size(1)) if int(index[1, e]) in frontier}
        keep |= new
        frontier = frontier | {int(index[0, e]) for e in new}
    want = sorted(keep)
    assert got_index.tolist() == index[:, want].tolist()
    assert got_attr[:, 0].tolist() == [float(e) for e in want]  # in edge order


def test_k_hop_edges_compute_the_nodes_exactly():
    """Two layers of a sum aggregation on the 2-hop edges give the nodes their full-graph value."""
    index, attr = random_graph(seed=3)
    x = torch.randn(17, dtype=torch.float64)

    def layer(h, idx):
        return h + torch.zeros_like(h).index_add(0, idx[1], h[idx[0]])

    full = layer(layer(x, index), index)
    nodes = torch.tensor([0, 5])
    _, sub = get_k_hop_edges(nodes, attr, index, 2, 17)
    part = layer(layer(x, sub), sub)
    assert torch.equal(part[nodes], full[nodes])


def brute_force_k_hop(index, nodes, hops):
    """Edge positions by the definition: an edge counts when its destination is within
    hops-1 steps upstream of ``nodes`` (a set of ids)."""
    frontier, keep = set(nodes), set()
    for _ in range(hops):
        new = {e for e in range(index.size(1)) if int(index[1, e]) in frontier}
        keep |= new
        frontier = frontier | {int(index[0, e]) for e in new}
    return sorted(keep)


@pytest.mark.parametrize("hops", [1, 2, 3])
@pytest.mark.parametrize(
    "picked", [[], [3, 11], [0, 16], list(range(17)), [5, 5, 2]], ids=lambda p: f"{len(p)}nodes"
)
def test_k_hop_edges_of_a_mask_equal_those_of_its_ids_and_the_definition(hops, picked):
    """anemoi calls get_k_hop_edges with a boolean node mask as well as with ids: both give
    the brute-force edges, in edge order (an empty mask: none; an all-true mask: every edge)."""
    index, attr = random_graph()
    mask = torch.zeros(17, dtype=torch.bool)
    mask[picked] = True
    want = brute_force_k_hop(index, picked, hops)
    for nodes in (mask, torch.tensor(picked, dtype=torch.long), mask.nonzero().flatten()):
        for n in (17, None):
            got_attr, got_index = get_k_hop_edges(nodes, attr, index, hops, num_nodes=n)
            assert got_index.tolist() == index[:, want].tolist(), (nodes, n)
            assert got_attr[:, 0].tolist() == [float(e) for e in want]
    if len(set(picked)) == 17:
        assert len(want) == index.size(1)


def test_k_hop_edges_of_a_mask_with_isolated_trailing_nodes():
    """A mask longer than the largest id in edge_index (nodes without edges) is exact too."""
    index, attr = random_graph()
    mask = torch.zeros(20, dtype=torch.bool)
    mask[[4, 19]] = True
    _, got = get_k_hop_edges(mask, attr, index, 2)
    assert got.tolist() == index[:, brute_force_k_hop(index, [4], 2)].tolist()


def test_k_hop_edges_refuse_what_they_cannot_do_exactly():
    index, attr = random_graph()
    with pytest.raises(ConfigError, match="a node mask of 16 entries for a graph of 17 nodes"):
        get_k_hop_edges(torch.ones(16, dtype=torch.bool), attr, index, num_nodes=17)
    with pytest.raises(ConfigError, match="a node mask of 10 entries for a graph of at least 17"):
        get_k_hop_edges(torch.ones(10, dtype=torch.bool), attr, index)
    with pytest.raises(ConfigError, match="a node mask of shape \\(1, 17\\)"):
        get_k_hop_edges(torch.ones(1, 17, dtype=torch.bool), attr, index)
    with pytest.raises(ConfigError, match=r"node ids span \[-1, 3\].*no negative ids"):
        get_k_hop_edges(torch.tensor([3, -1]), attr, index)
    with pytest.raises(ConfigError, match=r"node ids span \[2, 17\] but the graph has 17"):
        get_k_hop_edges(torch.tensor([2, 17]), attr, index, num_nodes=17)
    with pytest.raises(ConfigError, match=r"dtype torch\.float32"):
        get_k_hop_edges(torch.tensor([1.0, 0.0]), attr, index)
    with pytest.raises(ConfigError, match="edge_index names node 16 but num_nodes=10"):
        get_k_hop_edges(torch.tensor([1]), attr, index, num_nodes=10)
    with pytest.raises(ConfigError, match="num_hops=0"):
        get_k_hop_edges(torch.tensor([1]), attr, index, 0)
    with pytest.raises(ConfigError, match="3 edge attributes for 60 edges"):
        get_k_hop_edges(torch.tensor([1]), attr[:3], index)


@pytest.mark.parametrize("chunks", [1, 3, 5])
def test_1hop_chunks_hold_each_chunks_incoming_edges_in_order(chunks):
    index, attr = random_graph()
    spec = ShardSpec.balanced(17, chunks)
    attrs, indices = sort_edges_1hop_chunks(17, attr, index, chunks, edges_are_dst_sorted=False)
    for i, (a, idx) in enumerate(zip(attrs, indices, strict=True)):
        want = [e for e in range(index.size(1)) if spec.start(i) <= int(index[1, e]) < spec.stop(i)]
        assert idx.tolist() == index[:, want].tolist() and a[:, 0].tolist() == want
    # the fast path on sorted edges: the same chunks (a slice each)
    s_index, perm = sort_by_destination(index)
    fast = sort_edges_1hop_chunks((17, 17), attr[perm], s_index, chunks)
    slow = sort_edges_1hop_chunks(17, attr[perm], s_index, chunks, edges_are_dst_sorted=False)
    for a, b in zip(fast[1], slow[1], strict=True):
        assert torch.equal(a, b)
    assert [int(i.size(1)) for i in fast[1]] == edge_split(index, spec)


def test_sorted_claims_are_checked():
    index, attr = random_graph()
    assert not is_dst_sorted(index)
    with pytest.raises(ConfigError, match="not sorted"):
        sort_edges_1hop_chunks(17, attr, index, 2)
    s_index, perm = sort_by_destination(index)
    assert is_dst_sorted(s_index)
    for d in range(17):  # stable: edges into one node keep their order
        assert perm[s_index[1] == d].tolist() == sorted(perm[s_index[1] == d].tolist())


def test_graph_refuses_ids_out_of_range_and_bad_node_sets():
    index, _ = random_graph()
    with pytest.raises(ConfigError, match=r"destination ids span \[0, 16\] for 10 nodes"):
        Graph(index, Nodes(17), Nodes(10))
    with pytest.raises(ConfigError, match="2 edge attributes for 60 edges"):
        Graph(index, Nodes(17), edge_attr=torch.zeros(2, 1))
    with pytest.raises(ConfigError, match="sort the nodes"):
        BandNodes((0, 2, 1), 3)
    with pytest.raises(ConfigError, match="expecting \\(2, E\\)"):
        Graph(index.T, Nodes(17))


def test_generated_graphs():
    xyz, lat = fibonacci_mesh(50)
    assert torch.all(lat[1:] <= lat[:-1]) and torch.allclose(
        xyz.norm(dim=1), torch.ones(50, dtype=torch.float64)
    )
    grid, glat = grid_points(5, 8)
    assert grid.shape == (40, 3) and glat[0] > glat[-1]
    mesh = knn_edges(xyz, xyz, 6)
    assert mesh.shape == (2, 300) and not torch.any(mesh[0] == mesh[1])
    assert torch.equal(torch.bincount(mesh[1], minlength=50), torch.full((50,), 6))
    g2m = knn_edges(grid, xyz, 2, from_src=True)
    assert torch.equal(torch.bincount(g2m[0], minlength=40), torch.full((40,), 2))
    # each source's neighbours are its nearest destinations
    d = torch.cdist(grid, xyz)
    nearest = d.argmin(dim=1)
    assert torch.equal(g2m[1].view(40, 2)[:, 0], nearest)
