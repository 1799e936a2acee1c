"""Edges assigned to the owner of their destination node (local, no communication).

A message-passing layer is exact on a shard of destination nodes when the shard holds every
edge that ends in one of its nodes: the aggregation at a node then sums the same messages, in
the same order, as on the whole graph. These helpers cut an edge list that way. Edge order is
kept (a stable filter), so each destination's messages are summed in the serial order.

anemoi's helpers are here under their names and meanings (``get_k_hop_edges``,
``sort_edges_1hop_chunks``, ``sort_edges_1hop_sharding``), with no torch_geometric
dependency: they need a stable filter and a sort, which torch has.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from mpidp.errors import ConfigError
from mpidp.ops.collectives import resolve_transport
from mpidp.runtime.partition import ShardSpec

__all__ = [
    "edge_split",
    "edges_of",
    "get_k_hop_edges",
    "is_dst_sorted",
    "sort_by_destination",
    "sort_edges_1hop_chunks",
    "sort_edges_1hop_sharding",
]


def _check_index(edge_index: torch.Tensor, what: str = "edge_index") -> None:
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ConfigError(
            f"{what} has shape {tuple(edge_index.shape)}; expecting (2, E): sources in row 0, "
            "destinations in row 1"
        )
    if edge_index.dtype not in (torch.int32, torch.int64):
        raise ConfigError(f"{what} has dtype {edge_index.dtype}; expecting an integer tensor")


def is_dst_sorted(edge_index: torch.Tensor) -> bool:
    """Whether the destinations (row 1) never decrease."""
    _check_index(edge_index)
    dst = edge_index[1]
    return bool(dst.numel() <= 1 or (dst[1:] >= dst[:-1]).all())


def sort_by_destination(edge_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(edge_index, perm)``: the edges ordered by destination, stably (edges into one node
    keep their order), and the permutation (``edge_attr[perm]`` follows it)."""
    _check_index(edge_index)
    perm = torch.sort(edge_index[1], stable=True).indices
    return edge_index[:, perm], perm


def edges_of(edge_index: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Positions of the edges whose destination is in ``[lo, hi)``, in edge order: a range
    when the edges are sorted by destination (found by binary search), a stable filter
    otherwise."""
    dst = edge_index[1]
    if is_dst_sorted(edge_index):
        bounds = torch.tensor([lo, hi], dtype=dst.dtype, device=dst.device)
        a, b = torch.searchsorted(dst, bounds).tolist()
        return torch.arange(a, b, device=dst.device)
    return torch.nonzero((dst >= lo) & (dst < hi)).flatten()


def edge_split(edge_index: torch.Tensor, dst_spec: ShardSpec) -> list[int]:
    """How many edges end in each part of ``dst_spec`` (each rank's edge count)."""
    _check_index(edge_index)
    dst = edge_index[1]
    if dst.numel() and (int(dst.min()) < 0 or int(dst.max()) >= dst_spec.total):
        raise ConfigError(
            f"destinations span [{int(dst.min())}, {int(dst.max())}] but the node partition "
            f"{dst_spec} has {dst_spec.total} nodes"
        )
    bounds = torch.tensor(dst_spec.offsets[1:], dtype=dst.dtype, device=dst.device)
    owner = torch.bucketize(dst, bounds, right=True)
    return torch.bincount(owner, minlength=dst_spec.parts).tolist()


def _dst_spec(num_nodes: int | tuple[int, int], parts: int) -> ShardSpec:
    n = num_nodes if isinstance(num_nodes, int) else num_nodes[1]
    return ShardSpec.balanced(int(n), parts, allow_empty=True)


def sort_edges_1hop_chunks(
    num_nodes: int | tuple[int, int],
    edge_attr: torch.Tensor,
    edge_index: torch.Tensor,
    num_chunks: int,
    edges_are_dst_sorted: bool = True,
    *,
    spec: ShardSpec | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """anemoi's ``sort_edges_1hop_chunks``: the edges cut into ``num_chunks`` chunks, chunk
    i holding every edge that ends in the i-th part of the destination nodes (``num_nodes``:
    the node count, or (sources, destinations) of a bipartite graph; parts balanced, the first
    ones one node larger, or ``spec``). Indices stay global; edge order is kept. With
    ``edges_are_dst_sorted`` (checked) each chunk is a slice; otherwise a stable filter."""
    _check_index(edge_index)
    cut = spec if spec is not None else _dst_spec(num_nodes, num_chunks)
    if cut.parts != num_chunks:
        raise ConfigError(f"spec {cut} has {cut.parts} parts; num_chunks is {num_chunks}")
    if edges_are_dst_sorted and not is_dst_sorted(edge_index):
        raise ConfigError(
            "sort_edges_1hop_chunks(edges_are_dst_sorted=True): the destinations are not "
            "sorted; pass edges_are_dst_sorted=False, or sort them with sort_by_destination"
        )
    picks = [edges_of(edge_index, cut.start(i), cut.stop(i)) for i in range(num_chunks)]
    return [edge_attr[p] for p in picks], [edge_index[:, p] for p in picks]


def sort_edges_1hop_sharding(
    num_nodes: int | tuple[int, int],
    edge_attr: torch.Tensor,
    edge_index: torch.Tensor,
    mgroup: Any = None,
    *,
    spec: ShardSpec | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
    """anemoi's ``sort_edges_1hop_sharding``: the edges reordered so that each rank's (the
    edges ending in its part of the destination nodes) are contiguous, in rank order, and
    the edge count of each rank; ``(edge_attr, edge_index, None)`` unchanged on one rank.
    ``mgroup``: the group whose size is the number of parts (None: the domain group). Local:
    no communication (every rank computes the same from the whole edge list)."""

    parts = resolve_transport(mgroup, edge_index.device).size
    if parts == 1:
        return edge_attr, edge_index, None
    attrs, indices = sort_edges_1hop_chunks(
        num_nodes, edge_attr, edge_index, parts, edges_are_dst_sorted=False, spec=spec
    )
    return torch.cat(attrs), torch.cat(indices, dim=1), [int(i.size(1)) for i in indices]


def _start_nodes(nodes: Any, edge_index: torch.Tensor, num_nodes: int | None) -> torch.Tensor:
    """The boolean mask over every node of the nodes to reach (``nodes``: a boolean mask of
    one entry per node, or node ids), checked: anything whose meaning is not certain raises
    instead of selecting other edges."""
    nodes = torch.as_tensor(nodes, device=edge_index.device)
    top = int(edge_index.max()) + 1 if edge_index.numel() else 0
    low = int(edge_index.min()) if edge_index.numel() else 0
    if low < 0:
        raise ConfigError(f"edge_index holds the node id {low}; ids must be >= 0")
    if num_nodes is not None and top > num_nodes:
        raise ConfigError(
            f"edge_index names node {top - 1} but num_nodes={num_nodes}; pass the graph's "
            "node count"
        )
    if nodes.dtype == torch.bool:
        if nodes.dim() != 1:
            raise ConfigError(
                f"get_k_hop_edges: a node mask of shape {tuple(nodes.shape)}; expecting one "
                "boolean per node (1-D)"
            )
        n = nodes.numel()
        if (num_nodes is not None and n != num_nodes) or n < top:
            want = num_nodes if num_nodes is not None else f"at least {top}"
            raise ConfigError(
                f"get_k_hop_edges: a node mask of {n} entries for a graph of {want} nodes "
                f"(edge_index names node {top - 1}); pass one entry per node, or node ids"
            )
        return nodes
    if nodes.is_floating_point() or nodes.is_complex() or nodes.dim() > 1:
        raise ConfigError(
            f"get_k_hop_edges: nodes of dtype {nodes.dtype} and shape {tuple(nodes.shape)}; "
            "expecting node ids (a 1-D integer tensor) or a boolean mask of one entry per node"
        )
    ids = nodes.reshape(-1).to(torch.long)
    n = num_nodes if num_nodes is not None else max(top, int(ids.max()) + 1 if ids.numel() else 0)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise ConfigError(
            f"get_k_hop_edges: node ids span [{int(ids.min())}, {int(ids.max())}] but the graph "
            f"has {n} nodes (num_nodes={num_nodes}); pass ids in [0, {n}) (no negative ids: "
            "they would wrap around to other nodes)"
        )
    mask = torch.zeros(n, dtype=torch.bool, device=edge_index.device)
    mask[ids] = True
    return mask


def get_k_hop_edges(
    nodes: torch.Tensor,
    edge_attr: torch.Tensor,
    edge_index: torch.Tensor,
    num_hops: int = 1,
    num_nodes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """anemoi's ``get_k_hop_edges``: ``(edge_attr, edge_index)`` of every edge whose message
    reaches ``nodes`` within ``num_hops`` layers of message passing (the edges into
    ``nodes``, then the edges into their sources, and so on), in edge order, indices global.
    ``num_hops`` layers computed on these edges give ``nodes`` exactly their values on the
    whole graph.

    ``nodes``: node ids (an integer tensor, any order, repeats allowed) or a boolean mask of
    one entry per node (``num_nodes`` entries; without ``num_nodes``, at least as many as
    ``edge_index`` names), as anemoi accepts. Both give the same edges. Ids out of range,
    negative ids, a mask of another length and a float tensor raise a ConfigError. Local."""
    _check_index(edge_index)
    try:
        hops = operator.index(num_hops)
    except TypeError:
        hops = 0
    if isinstance(num_hops, bool) or hops < 1:
        raise ConfigError(f"num_hops={num_hops!r}: expecting an int of at least 1")
    if edge_attr.size(0) != edge_index.size(1):
        raise ConfigError(
            f"get_k_hop_edges: {edge_attr.size(0)} edge attributes for {edge_index.size(1)} "
            "edges; expecting one row per edge"
        )
    reached = _start_nodes(nodes, edge_index, None if num_nodes is None else int(num_nodes))
    src, dst = edge_index[0], edge_index[1]
    keep = torch.zeros(dst.numel(), dtype=torch.bool, device=edge_index.device)
    for _ in range(hops):
        into = reached[dst]
        keep |= into
        reached = reached.clone()
        reached[src[into]] = True
    picked = torch.nonzero(keep).flatten()
    return edge_attr[picked], edge_index[:, picked]
