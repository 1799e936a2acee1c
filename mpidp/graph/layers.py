"""Message-passing layers written against a :class:`~mpidp.graph.Graph` (serial reference
modules; a :class:`~mpidp.graph.ShardedGraph` makes them domain-parallel, unchanged).

Node features are ``(..., N, C)`` (the node dim second to last), edge features ``(..., E, C)``
or ``(E, C)`` shared by the batch. Aggregations add the messages into each destination in
edge order (``index_add``), so a shard holding every edge into its nodes, in the serial order,
sums the same numbers in the same order: its rows equal the serial ones bit for bit on CPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from mpidp.errors import ConfigError

__all__ = [
    "AGGREGATIONS",
    "GraphTransformerLayer",
    "InteractionNetwork",
    "edge_softmax",
    "scatter_mean",
    "scatter_sum",
]

AGGREGATIONS = ("sum", "mean")


def scatter_sum(values: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    """``out[..., i, :]``: the sum of ``values[..., e, :]`` over the edges ``e`` with
    ``index[e] == i``, added in edge order (``count`` destinations)."""
    shape = list(values.shape)
    shape[-2] = count
    index = index.to(values.device)  # an edge list kept on the CPU meets meta values (explain)
    return values.new_zeros(shape).index_add(values.dim() - 2, index, values)


def scatter_mean(values: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    """The mean of the messages into each destination (zero where none arrive)."""
    total = scatter_sum(values, index, count)
    ones = torch.ones(index.numel(), 1, dtype=values.dtype, device=values.device)
    degree = scatter_sum(ones, index, count).clamp(min=1)
    return total / degree


def edge_softmax(scores: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    """Softmax of ``scores`` (..., E, heads) over the edges into each destination."""
    d = scores.dim() - 2
    expanded = index.view([-1] + [1] * (scores.dim() - d - 1)).expand_as(scores)
    shape = list(scores.shape)
    shape[-2] = count
    with torch.no_grad():  # the softmax does not depend on the shift: no gradient through it
        top = scores.new_full(shape, -math.inf).scatter_reduce(d, expanded, scores, "amax")
    ex = torch.exp(scores - top.index_select(d, index))
    return ex / scatter_sum(ex, index, count).index_select(d, index)


def _mlp(inp: int, hidden: int, out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(inp, hidden), nn.SiLU(), nn.Linear(hidden, out), nn.LayerNorm(out)
    )


def _check(x_src: torch.Tensor, x_dst: torch.Tensor, graph: Any, layer: str) -> None:
    if x_dst.size(-2) != graph.num_dst:
        raise ConfigError(
            f"{layer}: {x_dst.size(-2)} destination nodes (dim -2 of x_dst) for a graph with "
            f"{graph.num_dst} here; feed the destination nodes the graph's cut gives this rank"
        )


def _batched(edge: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if edge.dim() < like.dim():
        return edge.expand(*like.shape[:-2], *edge.shape)
    return edge


class InteractionNetwork(nn.Module):
    """GraphCast's interaction network: each edge gets a message from its attributes and its
    two end nodes (an MLP), each destination adds (``"sum"``) or averages (``"mean"``) the
    messages it receives and updates itself (an MLP); both are residual. ``forward(x_src,
    x_dst, edge_attr, graph)`` returns the new destination and edge features."""

    #: written for node bands and a ShardedGraph: a converted model runs it on the bands
    _mpidp_band_forward = True

    def __init__(
        self,
        src_dim: int,
        dst_dim: int,
        edge_dim: int,
        hidden: int,
        aggregation: str = "sum",
    ) -> None:
        super().__init__()
        if aggregation not in AGGREGATIONS:
            raise ConfigError(f"aggregation={aggregation!r}; use one of {AGGREGATIONS}")
        self.aggregation = aggregation
        self.edge_mlp = _mlp(edge_dim + src_dim + dst_dim, hidden, edge_dim)
        self.node_mlp = _mlp(dst_dim + edge_dim, hidden, dst_dim)

    def forward(
        self, x_src: torch.Tensor, x_dst: torch.Tensor, edge_attr: torch.Tensor, graph: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check(x_src, x_dst, graph, type(self).__name__)
        src, dst = graph.edge_index
        x_src = graph.src_features(x_src)
        d = x_src.dim() - 2
        edge_attr = _batched(edge_attr, x_dst)
        parts = [edge_attr, x_src.index_select(d, src), x_dst.index_select(d, dst)]
        message = self.edge_mlp(torch.cat(parts, -1))
        reduce = scatter_sum if self.aggregation == "sum" else scatter_mean
        received = reduce(message, dst, x_dst.size(-2))
        return x_dst + self.node_mlp(torch.cat([x_dst, received], -1)), edge_attr + message


class GraphTransformerLayer(nn.Module):
    """anemoi's graph transformer: multi-head attention of each destination over the edges
    into it (queries from the destination, keys and values from the source plus an edge
    embedding; softmax per destination), then an MLP; pre-norm and residual.
    ``forward(x_src, x_dst, edge_attr, graph)`` returns the new destination features."""

    #: written for node bands and a ShardedGraph: a converted model runs it on the bands
    _mpidp_band_forward = True

    def __init__(self, src_dim: int, dst_dim: int, edge_dim: int, heads: int, hidden: int):
        super().__init__()
        if dst_dim % heads:
            raise ConfigError(f"dst_dim={dst_dim} is not a multiple of heads={heads}")
        self.heads = heads
        self.norm_src, self.norm_dst = nn.LayerNorm(src_dim), nn.LayerNorm(dst_dim)
        self.query = nn.Linear(dst_dim, dst_dim)
        self.key, self.value = nn.Linear(src_dim, dst_dim), nn.Linear(src_dim, dst_dim)
        self.edge_key = nn.Linear(edge_dim, dst_dim, bias=False)
        self.edge_value = nn.Linear(edge_dim, dst_dim, bias=False)
        self.proj = nn.Linear(dst_dim, dst_dim)
        self.norm_mlp = nn.LayerNorm(dst_dim)
        self.mlp = nn.Sequential(nn.Linear(dst_dim, hidden), nn.SiLU(), nn.Linear(hidden, dst_dim))

    def forward(
        self, x_src: torch.Tensor, x_dst: torch.Tensor, edge_attr: torch.Tensor, graph: Any
    ) -> torch.Tensor:
        _check(x_src, x_dst, graph, type(self).__name__)
        src, dst = graph.edge_index
        h_src = self.norm_src(graph.src_features(x_src))
        h_dst = self.norm_dst(x_dst)
        d = h_dst.dim() - 2
        n, heads = x_dst.size(-2), self.heads
        q = self.query(h_dst).index_select(d, dst)
        k = self.key(h_src).index_select(d, src) + self.edge_key(edge_attr)
        v = self.value(h_src).index_select(d, src) + self.edge_value(edge_attr)
        per_head = (*q.shape[:-1], heads, q.size(-1) // heads)
        scores = (q.view(per_head) * k.view(per_head)).sum(-1) / math.sqrt(per_head[-1])
        alpha = edge_softmax(scores, dst, n)
        out = scatter_sum((alpha.unsqueeze(-1) * v.view(per_head)).flatten(-2), dst, n)
        x = x_dst + self.proj(out)
        return x + self.mlp(self.norm_mlp(x))
