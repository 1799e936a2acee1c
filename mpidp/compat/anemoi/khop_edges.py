"""anemoi's ``anemoi.models.distributed.khop_edges``: edges cut by destination, for message
passing on a shard of the destination nodes. Each is :mod:`mpidp.graph.edges`' function of
the same name (no torch_geometric): indices stay global, edge order is kept (a stable filter),
so a destination sums its messages in the serial order. ``edge_index`` is a ``(2, E)`` integer
tensor (anemoi's torch_sparse ``SparseTensor`` form is not taken)."""

from __future__ import annotations

from typing import Any

import torch

from mpidp.compat.anemoi._groups import transport
from mpidp.graph import edges

__all__ = ["get_k_hop_edges", "sort_edges_1hop_chunks", "sort_edges_1hop_sharding"]


def get_k_hop_edges(
    nodes: torch.Tensor, edge_attr: torch.Tensor, edge_index: torch.Tensor, num_hops: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(edge_attr, edge_index)`` of every edge whose message reaches ``nodes`` (ids, or a
    boolean mask of one entry per node) within ``num_hops`` layers, in edge order; attributes
    first, as anemoi returns them. Local."""
    return edges.get_k_hop_edges(nodes, edge_attr, edge_index, num_hops)


def sort_edges_1hop_chunks(
    num_nodes: int | tuple[int, int],
    edge_attr: torch.Tensor,
    edge_index: torch.Tensor,
    num_chunks: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(edge_attr chunks, edge_index chunks)``: chunk i holds every edge into the i-th part
    of the destination nodes (``torch.tensor_split``'s cut of ``num_nodes``, or of its second
    entry for a bipartite graph; chunks beyond the nodes are empty). The edges need not be
    sorted by destination. Local."""
    return edges.sort_edges_1hop_chunks(
        num_nodes, edge_attr, edge_index, num_chunks, edges_are_dst_sorted=False
    )


def sort_edges_1hop_sharding(
    num_nodes: int | tuple[int, int],
    edge_attr: torch.Tensor,
    edge_index: torch.Tensor,
    mgroup: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """``(edge_attr, edge_index, attr_shapes, index_shapes)``: the edges reordered so that each
    rank's (every edge into its part of the destinations, :func:`sort_edges_1hop_chunks`'s cut
    over the ranks of ``mgroup``) stand together in rank order, and every rank's shard shapes,
    to pass to :func:`~mpidp.compat.anemoi.graph.shard_tensor` (dims 0 and 1). ``mgroup``
    None: the edges unchanged and ``[], []``, as anemoi's. Local: no communication."""
    t = transport(mgroup, edge_index)
    if t is None:
        return edge_attr, edge_index, [], []
    attr, index, counts = edges.sort_edges_1hop_sharding(num_nodes, edge_attr, edge_index, t)
    per_rank = counts if counts is not None else [index.size(1)]
    attr_shapes = [torch.Size([n, *attr.shape[1:]]) for n in per_rank]
    return attr, index, attr_shapes, [torch.Size([2, n]) for n in per_rank]
