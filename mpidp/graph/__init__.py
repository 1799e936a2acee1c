"""Graphs on sharded nodes: edges owned by their destination's rank, a halo planner that does
not assume symmetry, and the graph a message-passing layer reads (docs/graphs.md)."""

from mpidp.graph.edges import (
    edge_split,
    edges_of,
    get_k_hop_edges,
    is_dst_sorted,
    sort_by_destination,
    sort_edges_1hop_chunks,
    sort_edges_1hop_sharding,
)
from mpidp.graph.halo import (
    GraphHaloPlan,
    graph_halo_exchange,
    plan_graph_halo,
    plan_graph_halo_local,
)
from mpidp.graph.module import BandNodes, Graph, GridNodes, Nodes, NodeSet, ShardedGraph

__all__ = [
    "BandNodes",
    "Graph",
    "GraphHaloPlan",
    "GridNodes",
    "NodeSet",
    "Nodes",
    "ShardedGraph",
    "edge_split",
    "edges_of",
    "get_k_hop_edges",
    "graph_halo_exchange",
    "is_dst_sorted",
    "plan_graph_halo",
    "plan_graph_halo_local",
    "sort_by_destination",
    "sort_edges_1hop_chunks",
    "sort_edges_1hop_sharding",
]
