"""One message-passing layer on sharded nodes against hand-written MPI.

    python bench/graph.py --json docs/bench/graph.json

Run at P = 2 and 4 (one thread per rank, float32); every figure is a median over rounds that
alternate the variants (bench/common.py). Not a test.

The graph: 40,962 nodes (a Fibonacci lattice on the sphere, the node count of a level-6
icosahedral mesh) sorted north to south, each hearing from its 6 nearest nodes (245,772
directed edges), cut into balanced ranges (latitude bands). Node features C = 256, edge
features 32.

- **exchange**: the halo only. ``mpidp``: :func:`mpidp.graph.graph_halo_exchange` (halo
  route). ``raw``: the same rows picked with numpy and moved by one ``Alltoallv`` from a
  precomputed plan, then one ``torch.cat``. ``gather``: the all-gather route.
- **layer**: one :class:`~mpidp.models.InteractionNetwork` (sum) forward. ``mpidp``: on a
  :class:`~mpidp.graph.ShardedGraph` (halo route). ``raw``: the raw exchange then the same
  local compute. ``gather``: the all-gather route.
- **bytes**: halo nodes received per rank (most), and the source-node features each route
  holds for the layer (the extended tensor, most on one rank), against the serial ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

NODES, K, C, EDGE = 40962, 6, 256, 32


def worker(args: argparse.Namespace) -> None:
    import copy

    import numpy as np
    import torch
    from common import timed_round_robin
    from mpi4py import MPI

    import mpidp
    from mpidp.graph import Graph, Nodes, ShardedGraph, graph_halo_exchange
    from mpidp.graph.graphcast import fibonacci_mesh, knn_edges
    from mpidp.models import InteractionNetwork

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    me, p = world.Get_rank(), world.Get_size()
    m = mpidp.init(domain_parallel_size=p)
    edges = knn_edges(*fibonacci_mesh(NODES)[:1] * 2, K) if me == 0 else None
    edges = world.bcast(edges, root=0)
    torch.manual_seed(0)
    graph = Graph(edges, Nodes(NODES))
    routes = {
        route: ShardedGraph.from_module(Graph(edges, Nodes(NODES), route=route), m)
        for route in ("halo", "gather")
    }
    plan = routes["halo"].plan()
    spec = plan.src_spec
    x = torch.randn(1, spec[me], C)
    e_local = torch.randn(plan.edge_ids.numel(), EDGE)
    layer = InteractionNetwork(C, C, EDGE, C)
    dist = copy.deepcopy(layer)

    # the raw exchange: the rows each rank sends, picked with numpy, one Alltoallv
    send_idx = np.concatenate([np.asarray(s, dtype=np.int64) for s in plan.send])
    send_counts = [len(s) * C for s in plan.send]
    recv_counts = [plan.sizes[q][me] * C for q in range(p)]
    recv = np.empty(sum(recv_counts), dtype=np.float32)

    def raw_exchange() -> torch.Tensor:
        own = x[0].numpy()
        send = np.ascontiguousarray(own[send_idx])
        world.Alltoallv([send, send_counts], [recv, recv_counts])
        return torch.cat([x, torch.from_numpy(recv).view(1, -1, C)], 1)

    class Fetched:
        """The sharded graph's edges with features already fetched (the raw layer)."""

        def __init__(self, ext: torch.Tensor) -> None:
            self.ext, self.edge_index, self.num_dst = ext, plan.edge_index, plan.num_dst

        def src_features(self, _: torch.Tensor, dim: int = -2) -> torch.Tensor:
            return self.ext

    with torch.no_grad():
        ext = graph_halo_exchange(x, plan, -2)
        assert torch.equal(ext, raw_exchange()), "raw and mpidp differ"
        got = dist(x, x, e_local, routes["halo"])[0]
        want = layer(x, x, e_local, Fetched(raw_exchange()))[0]
        assert torch.equal(got, want), "raw and mpidp layers differ"
        gplan = routes["gather"].plan()
        ms_x = timed_round_robin(
            {
                "mpidp": lambda: graph_halo_exchange(x, plan, -2),
                "raw": raw_exchange,
                "gather": lambda: graph_halo_exchange(x, gplan, -2),
            },
            world,
            args.repeats,
        )
        ms_l = (
            {}
            if args.exchange_only
            else timed_round_robin(
                {
                    "mpidp": lambda: dist(x, x, e_local, routes["halo"]),
                    "raw": lambda: layer(x, x, e_local, Fetched(raw_exchange())),
                    "gather": lambda: dist(x, x, e_local, routes["gather"]),
                },
                world,
                max(3, args.repeats // 2),
            )
        )
    row = {
        "ranks": p,
        "edges": graph.num_edges,
        "exchange_ms": ms_x,
        "layer_ms": ms_l,
        "halo_nodes_max": world.allreduce(len(plan.halo), op=MPI.MAX),
        "own_nodes_max": max(spec.sizes),
        "source_bytes_halo_max": world.allreduce(plan.num_src * C * 4, op=MPI.MAX),
        "source_bytes_gather": NODES * C * 4,
    }
    if me == 0:
        print(json.dumps(row))
    m.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--exchange-only", action="store_true", help="skip the layer timings")
    parser.add_argument("--ranks", default="2,4")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from common import run_worker

    flags = ["--repeats", str(args.repeats)] + ["--exchange-only"] * args.exchange_only
    rows = [run_worker(__file__, int(ranks), flags) for ranks in args.ranks.split(",")]
    print(f"{NODES} nodes, {K} in-edges each, C = {C}; ms (forward)")
    print(
        f"{'P':>3} {'halo':>6} {'exch mpidp':>11} {'raw':>8} {'ratio':>6} {'gather':>8}"
        f" {'layer mpidp':>12} {'raw':>8} {'ratio':>6} {'gather':>8}"
    )
    for r in rows:
        x, lay = r["exchange_ms"], r["layer_ms"] or {"mpidp": 0.0, "raw": 1.0, "gather": 0.0}
        print(
            f"{r['ranks']:>3} {r['halo_nodes_max']:>6} {x['mpidp']:>11.2f} {x['raw']:>8.2f}"
            f" {x['mpidp'] / x['raw']:>6.2f} {x['gather']:>8.2f} {lay['mpidp']:>12.1f}"
            f" {lay['raw']:>8.1f} {lay['mpidp'] / lay['raw']:>6.2f} {lay['gather']:>8.1f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
