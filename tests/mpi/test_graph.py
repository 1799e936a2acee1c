"""Graphs on sharded nodes (mpidp.graph): the halo planner against the sets derived from the
whole edge list (symmetric, directed, bipartite graphs; empty halos and empty shards), the
halo exchange against the serial gather (forward, gradient, gradcheck, adjoint; both routes,
both transports), and the message-passing layers and GraphCastNet against the serial modules
on the whole graph (outputs, input, edge and parameter gradients; float64)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import adjoint_gap, gradcheck_global, on_transports, rand
from mpi4py import MPI

import mpidp
from mpidp.graph import (
    Graph,
    Nodes,
    ShardedGraph,
    get_k_hop_edges,
    graph_halo_exchange,
    plan_graph_halo,
    plan_graph_halo_local,
    sort_edges_1hop_sharding,
)
from mpidp.models import GraphCastNet, GraphTransformerLayer, InteractionNetwork
from mpidp.runtime.partition import ShardSpec
from mpidp.testing import assert_matches_serial

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
ME = MPI.COMM_WORLD.Get_rank()
F64 = torch.float64


def random_edges(n_src, n_dst, most, seed, reach=None):
    """Each destination gets 0..most random sources (within ``reach`` ids of it when given),
    in a shuffled order (not sorted by destination)."""
    gen = torch.Generator().manual_seed(seed)
    pairs = []
    for d in range(n_dst):
        for _ in range(int(torch.randint(0, most + 1, (1,), generator=gen))):
            if reach is None:
                s = int(torch.randint(0, n_src, (1,), generator=gen))
            else:
                s = min(
                    max(d + int(torch.randint(-reach, reach + 1, (1,), generator=gen)), 0),
                    n_src - 1,
                )
            pairs.append((s, d))
    order = torch.randperm(len(pairs), generator=gen)
    return torch.tensor([pairs[i] for i in order], dtype=torch.long).reshape(-1, 2).T


def graphs():
    """name -> (edge_index, sources, destinations)."""
    directed = random_edges(23, 23, 4, 1)
    both = torch.cat([directed, directed.flip(0)], 1)
    return {
        "directed": (directed, 23, 23),
        "symmetric": (torch.unique(both, dim=1), 23, 23),
        "bipartite": (random_edges(31, 11, 5, 2), 31, 11),
        "mesh-to-grid": (random_edges(11, 31, 3, 3), 11, 31),
        "banded": (random_edges(23, 23, 3, 4, reach=1), 23, 23),
        "self-loops": (torch.arange(23).repeat(2, 1), 23, 23),  # no halo under any cut
    }


def cuts(n):
    """name -> spec of n nodes over the world: balanced, and with an empty first shard."""
    out = {"balanced": ShardSpec.balanced(n, WORLD, allow_empty=True)}
    if WORLD > 1:
        out["empty-first"] = ShardSpec.from_weights((0,) + (1,) * (WORLD - 1), n, True)
    return out


def expected(edge_index, src_spec, dst_spec, rank):
    """What rank ``rank`` reads from every rank, from the whole edge list: (edge positions in
    order, {owner: sorted global source ids})."""
    lo, hi = dst_spec.start(rank), dst_spec.stop(rank)
    mine = [e for e in range(edge_index.size(1)) if lo <= int(edge_index[1, e]) < hi]
    need = {int(edge_index[0, e]) for e in mine}
    reads = {}
    for q in range(src_spec.parts):
        got = sorted(s for s in need if src_spec.owner(s) == q) if src_spec[q] else []
        if q != rank and got:
            reads[q] = got
    return mine, reads


def global_sources(plan):
    """The global id of each source index of ``plan.edge_index`` row 0."""
    lo = plan.src_spec.start(plan.rank)
    if plan.route == "gather":
        return list(range(plan.src_spec.total))
    return list(range(lo, lo + plan.src_spec[plan.rank])) + list(plan.halo)


@pytest.mark.parametrize("route", ["halo", "gather"])
@pytest.mark.parametrize("name", list(graphs()))
def test_planner_matches_the_whole_edge_list(t, name, route):
    edge_index, n_src, n_dst = graphs()[name]
    for cut in cuts(n_dst):
        src_spec = cuts(n_src)[cut]
        dst_spec = cuts(n_dst)[cut]
        plans = [plan_graph_halo(edge_index, src_spec, dst_spec, r, route) for r in range(WORLD)]
        for r, plan in enumerate(plans):
            mine, reads = expected(edge_index, src_spec, dst_spec, r)
            assert plan.edge_ids.tolist() == mine, (name, cut, r)
            ids = global_sources(plan)
            got_src = [ids[i] for i in plan.edge_index[0].tolist()]
            got_dst = [dst_spec.start(r) + i for i in plan.edge_index[1].tolist()]
            assert got_src == edge_index[0, mine].tolist()
            assert got_dst == edge_index[1, mine].tolist()
            halo = sorted(s for got in reads.values() for s in got)
            assert list(plan.halo) == halo
            for q in range(WORLD):  # what q sends r, seen from both ends
                sent = [src_spec.start(q) + i for i in plans[q].send[r]]
                assert sent == reads.get(q, []), (name, cut, q, r)
                assert plan.sizes[q][r] == len(reads.get(q, []))
        if name == "self-loops" and route == "halo":
            assert all(not any(row) for row in plans[0].sizes) and not plans[ME].halo
        # from each rank's own edges only: the same plan, learned in one all-gather
        mine = expected(edge_index, src_spec, dst_spec, ME)[0]
        local = plan_graph_halo_local(edge_index[:, mine], src_spec, dst_spec, t, route)
        assert local.halo == plans[ME].halo and local.sizes == plans[ME].sizes
        assert local.send == plans[ME].send
        assert torch.equal(local.edge_index, plans[ME].edge_index)


def test_banded_graph_on_thick_bands_has_no_halo_beyond_neighbours():
    edge_index, n, _ = graphs()["banded"]
    spec = ShardSpec.balanced(n, WORLD)
    plan = plan_graph_halo(edge_index, spec, spec, ME, "auto")
    assert plan.route == "halo"
    far = [q for q in range(WORLD) if abs(q - ME) > 1 and plan.sizes[q][ME]]
    assert not far and len(plan.halo) <= 2


@pytest.mark.mpi(min_size=2)
def test_local_planner_refuses_edges_of_other_ranks_on_every_rank(t):
    edge_index, n, _ = graphs()["directed"]
    spec = ShardSpec.balanced(n, WORLD)
    mine = expected(edge_index, spec, spec, ME)[0]
    wrong = edge_index[:, mine] if ME else edge_index  # rank 0 passes the whole list
    with pytest.raises(mpidp.ConfigError, match=r"rank 0: .* edges end outside"):
        plan_graph_halo_local(wrong, spec, spec, t)


def test_1hop_sharding_puts_each_ranks_edges_together(t):
    edge_index, n, _ = graphs()["directed"]
    attr = torch.arange(edge_index.size(1), dtype=F64)[:, None]
    got_attr, got_index, sizes = sort_edges_1hop_sharding(n, attr, edge_index, t)
    if WORLD == 1:
        assert sizes is None and got_attr is attr and got_index is edge_index
        return
    spec = ShardSpec.balanced(n, WORLD)
    at = 0
    for r in range(WORLD):
        mine = expected(edge_index, spec, spec, r)[0]
        assert sizes[r] == len(mine)
        assert got_attr[at : at + len(mine), 0].tolist() == mine
        assert torch.equal(got_index[:, at : at + len(mine)], edge_index[:, mine])
        at += len(mine)


@pytest.mark.parametrize("hops", [1, 2, 3])
@pytest.mark.parametrize("cut", list(cuts(23)))
def test_k_hop_edges_of_each_ranks_node_mask_give_the_whole_graph(manager, cut, hops):
    """anemoi's k-hop selection with a boolean mask of this rank's nodes (and with their ids):
    ``hops`` layers of message passing on the selected edges give this rank's nodes their
    whole-graph values, bit for bit, and the bands gathered are the whole graph's result."""
    edge_index, n, _ = graphs()["directed"]
    attr = torch.arange(edge_index.size(1), dtype=F64)[:, None]
    spec = cuts(n)[cut]
    x = torch.randn(n, 3, dtype=F64, generator=torch.Generator().manual_seed(7))

    def layers(index):
        h = x
        for _ in range(hops):
            h = torch.tanh(h + torch.zeros_like(h).index_add(0, index[1], h[index[0]]))
        return h

    mask = torch.zeros(n, dtype=torch.bool)
    mask[spec.slice(ME)] = True
    _, by_mask = get_k_hop_edges(mask, attr, edge_index, hops, num_nodes=n)
    _, by_ids = get_k_hop_edges(torch.nonzero(mask).flatten(), attr, edge_index, hops, n)
    assert torch.equal(by_mask, by_ids)
    band = layers(by_mask)[spec.slice(ME)]
    t = manager.transport("domain", "cpu")
    assert torch.equal(t.all_gather_v(band.contiguous(), list(spec.sizes)), layers(edge_index))


def exchange_case(name, route, cut):
    edge_index, n_src, n_dst = graphs()[name]
    src_spec, dst_spec = cuts(n_src)[cut], cuts(n_dst)[cut]
    return plan_graph_halo(edge_index, src_spec, dst_spec, ME, route)


EXCHANGES = [
    (g, r, c)
    for g in ("directed", "bipartite")
    for r in ("halo", "gather")
    for c in cuts(1 + 2 * WORLD)
] + [("self-loops", "halo", "balanced")]


@pytest.mark.parametrize("name,route,cut", EXCHANGES)
def test_halo_exchange_equals_the_serial_gather(t, name, route, cut):
    plan = exchange_case(name, route, cut)
    spec = plan.src_spec
    full = rand((2, spec.total, 3), 1)
    own = full[:, spec.slice(ME)].clone().requires_grad_()
    ext = graph_halo_exchange(own, plan, -2, t)
    ids = global_sources(plan)
    assert torch.equal(ext, full[:, ids])
    # the gradient: every rank's seed, added at the nodes it read
    w = rand(tuple(ext.shape), 10 + ME)
    ext.backward(w)
    want = torch.zeros_like(full)
    for wr, idr in t.all_gather_object((w, ids)):
        want.index_add_(1, torch.tensor(idr, dtype=torch.long), wr)
    torch.testing.assert_close(own.grad, want[:, spec.slice(ME)], rtol=1e-14, atol=1e-14)
    x = rand(tuple(own.shape), 20 + ME).requires_grad_()
    assert adjoint_gap(t, lambda z: graph_halo_exchange(z, plan, -2, t), x) < 1e-13


@pytest.mark.parametrize(
    "t,name,route,cut",
    # the gather route is all_gather_v, gradchecked with the collectives: one case here
    on_transports(
        [c for c in EXCHANGES if c[1] == "halo"] + [("bipartite", "gather", "balanced")],
        [("directed", "halo", "balanced")],
    ),
    indirect=["t"],
)
def test_gradcheck_halo_exchange(t, name, route, cut):
    plan = exchange_case(name, route, cut)
    shapes = [(plan.src_spec[r], 2) for r in range(WORLD)]
    gradcheck_global(t, shapes, lambda x: graph_halo_exchange(x, plan, 0, t))


def layer_run(layer, graph, xs, xd, e, same):
    """The layer's outputs as a tuple (destination features, and edge features when it
    returns them)."""
    out = layer(xs, xs if same else xd, e, graph)
    return out if isinstance(out, tuple) else (out,)


LAYERS = {
    "interaction-sum": lambda: InteractionNetwork(3, 4, 5, 6, "sum"),
    "interaction-mean": lambda: InteractionNetwork(3, 4, 5, 6, "mean"),
    "transformer": lambda: GraphTransformerLayer(3, 4, 5, 2, 6),
}


@pytest.mark.parametrize("layer_name", list(LAYERS))
@pytest.mark.parametrize("name", ["directed", "bipartite", "mesh-to-grid"])
def test_layers_equal_serial_on_the_whole_graph(manager, layer_name, name):
    edge_index, n_src, n_dst = graphs()[name]
    same = n_src == n_dst
    make = LAYERS[layer_name]
    if same and layer_name.startswith("interaction"):
        serial = InteractionNetwork(4, 4, 5, 6, layer_name.split("-")[1]).to(F64)
    elif same:
        serial = GraphTransformerLayer(4, 4, 5, 2, 6).to(F64)
    else:
        serial = make().to(F64)
    src_dim = 4 if same else 3
    graph = Graph(edge_index, Nodes(n_src), Nodes(n_dst))
    xs_full, xd_full = rand((2, n_src, src_dim), 1), rand((2, n_dst, 4), 2)
    e_full = rand((graph.num_edges, 5), 3)
    old = manager.partition
    try:
        for cut, policy in policies().items():
            manager.partition = policy
            check_layer(manager, serial, graph, xs_full, xd_full, e_full, same, (name, cut))
    finally:
        manager.partition = old


def policies():
    out = {"balanced": mpidp.Balanced(allow_empty=True)}
    if WORLD > 1:
        out["empty-first"] = mpidp.Weighted((0,) + (1,) * (WORLD - 1), allow_empty=True)
    return out


def check_layer(manager, serial, graph, xs_full, xd_full, e_full, same, what):
    serial.zero_grad()
    leaves = [z.clone().requires_grad_() for z in (xs_full, xd_full, e_full)]
    outs = layer_run(serial, graph, *leaves, same)
    seeds = [rand(tuple(o.shape), 30 + i) for i, o in enumerate(outs)]
    sum((o * w).sum() for o, w in zip(outs, seeds, strict=True)).backward()
    refs = {n: p.grad.clone() for n, p in serial.named_parameters()}
    dist = copy.deepcopy(serial)
    dist.zero_grad()
    sharded = ShardedGraph.from_module(graph, manager)
    plan = sharded.plan()
    src, dst, edges = plan.src_spec.slice(ME), plan.dst_spec.slice(ME), plan.edge_ids
    own = [
        xs_full[:, src].clone().requires_grad_(),
        xd_full[:, dst].clone().requires_grad_(),
        e_full[edges].clone().requires_grad_(),
    ]
    got = layer_run(dist, sharded, *own, same)
    picks = [(slice(None), dst), (slice(None), edges)]
    for g, o, pick in zip(got, outs, picks, strict=False):  # not bitwise: see the next test
        torch.testing.assert_close(g, o.detach()[pick], rtol=1e-12, atol=1e-13, msg=str(what))
    local = [(w[pick]) for w, pick in zip(seeds, picks, strict=False)]
    sum((g * w).sum() for g, w in zip(got, local, strict=True)).backward()
    for mine, full, pick in zip(
        own, leaves, [(slice(None), src), (slice(None), dst), edges], strict=True
    ):
        if mine.grad is None:  # x_dst is x_src when the sets are one: its gradient is there
            assert same
            continue
        torch.testing.assert_close(
            mine.grad, full.grad[pick], rtol=1e-12, atol=1e-13, msg=str(what)
        )
    mpidp.sync_gradients(dist, manager)
    for n, p in dist.named_parameters():
        torch.testing.assert_close(p.grad, refs[n], rtol=1e-12, atol=1e-13, msg=f"{what} {n}")


@pytest.mark.parametrize("name", ["directed", "bipartite"])
def test_aggregations_on_a_shard_are_bitwise_serial(manager, name):
    """The sums into each destination take the same messages in the same order, so they are
    equal bit for bit. (The layers' MLPs are not: a GEMM's rounding depends on how many rows
    it is given, 3e-16 apart here, so the layers are compared to 1e-12 above.)"""
    from mpidp.graph.layers import edge_softmax, scatter_mean, scatter_sum

    edge_index, n_src, n_dst = graphs()[name]
    graph = Graph(edge_index, Nodes(n_src), Nodes(n_dst))
    plan = ShardedGraph.from_module(graph, manager).plan()
    values = rand((2, graph.num_edges, 3), 5) * 1e3 + rand((2, graph.num_edges, 3), 6)
    dst = graph.edge_index[1]
    mine, rows = plan.edge_ids, plan.dst_spec.slice(ME)
    n = plan.num_dst
    for f in (scatter_sum, scatter_mean, edge_softmax):
        want = f(values, dst, n_dst)
        got = f(values[:, mine], plan.edge_index[1], n)
        full_rows = want[:, rows] if f is not edge_softmax else want[:, mine]
        assert torch.equal(got, full_rows), f.__name__


@pytest.mark.parametrize("processor", ["interaction", "transformer"])
def test_graphcast_equals_serial(manager, processor):
    serial = GraphCastNet(2, 2, (13, 16), mesh_nodes=40, hidden=8, processor=processor)
    serial = serial.to(F64)
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager)
    assert all(isinstance(g, ShardedGraph) for g in (dist.g2m, dist.mesh, dist.m2g))
    x = rand((2, 2, 13, 16), 4)
    old = manager.partition
    try:
        for cut, policy in policies().items():
            manager.partition = policy
            sizes = list(manager.spec(13))
            res = assert_matches_serial(
                serial,
                dist,
                [x],
                manager=manager,
                sizes=sizes,
                out_sizes=sizes,
                modules=(serial, dist),
            )
            assert res is not None, cut
    finally:
        manager.partition = old


def test_graphcast_over_gloo():
    """The converted GraphCastNet through the torch.distributed transport (gloo) too, with an
    empty first band and mean aggregation."""
    policy = policies()["empty-first" if WORLD > 1 else "balanced"]
    with mpidp.DistributedManager(
        domain_parallel_size=WORLD, transport="torch", partition=policy
    ) as gloo:
        serial = GraphCastNet(2, 2, (9, 8), mesh_nodes=20, hidden=6, aggregation="mean")
        serial = serial.to(F64)
        dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), gloo)
        sizes = list(gloo.spec(9))
        x = rand((1, 2, 9, 8), 8)
        kw = dict(manager=gloo, sizes=sizes, out_sizes=sizes, modules=(serial, dist))
        assert assert_matches_serial(serial, dist, [x], **kw) is not None


@pytest.mark.parametrize("cut", list(policies()))
def test_plan_prices_the_graph_halos_that_move(manager, cut):
    """``mpidp plan``'s graph bytes equal what each rank sends in one forward and backward of
    the converted GraphCastNet (halo and gather routes)."""
    from mpidp.preflight.plan import plan_model
    from mpidp.testing import count_traffic

    serial = GraphCastNet(2, 2, (13, 16), mesh_nodes=40, hidden=8, k_mesh=12).to(F64)
    shape = (2, 2, 13, 16)
    old = manager.partition
    manager.partition = policies()[cut]
    try:
        priced = plan_model(serial, shape, WORLD, partition=manager.partition, dtype=F64)
        dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager)
        rows = manager.spec(13)
        x = rand(shape, 9).narrow(-2, rows.start(ME), rows[ME]).requires_grad_()
        with count_traffic(manager) as traffic:
            dist(x).sum().backward()
        routes = {g.plan().route for g in (dist.g2m, dist.mesh, dist.m2g)}
    finally:
        manager.partition = old
    assert WORLD == 1 or cut != "balanced" or routes == {"halo", "gather"}, routes
    sent = sum(v[1] for v in traffic.ops.values())
    assert sent == priced.ranks[ME].graph_bytes, (traffic.ops, priced.ranks[ME])
