"""A graph as a module, and its sharded form: the one object message-passing layers ask for
their edges and for the source-node features those edges read.

A layer written against :class:`Graph` (``graph.edge_index``, ``graph.edge_attr``,
``graph.num_dst``, ``graph.src_features(x)``) runs unchanged on a shard of destination nodes:
:func:`~mpidp.convert_to_domain_parallel` swaps each :class:`Graph` for a
:class:`ShardedGraph`, whose edges are this rank's (every edge into its nodes, in the serial
order, relabelled) and whose ``src_features`` adds the halo. Each destination then sums the
same messages in the same order as in serial.

The node sets say how they are cut: :class:`GridNodes` are the points of an H x W grid, row
after row, cut as the latitude bands of the fields (so a band's reshape is its nodes);
:class:`BandNodes` are nodes sorted by the grid row they sit on, owned by the rank that owns
that row (a mesh whose halo to and from the grid stays small); :class:`Nodes` are cut by
the manager's partition policy.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mpidp.errors import ConfigError
from mpidp.graph.edges import _check_index, sort_by_destination
from mpidp.graph.halo import ROUTES, GraphHaloPlan, graph_halo_exchange, plan_graph_halo
from mpidp.layers.base import DomainParallel
from mpidp.layers.registry import register_layer
from mpidp.runtime.manager import DistributedManager
from mpidp.runtime.partition import ShardSpec

__all__ = [
    "BandNodes",
    "Graph",
    "GraphExchange",
    "GridNodes",
    "NodeSet",
    "Nodes",
    "ShardedGraph",
    "logging_exchanges",
]


@dataclasses.dataclass(frozen=True)
class Nodes:
    """``count`` nodes, cut by the manager's partition policy."""

    count: int

    def spec(self, manager: DistributedManager) -> ShardSpec:
        return self.cut(manager.spec)

    def cut(self, rows: Callable[[int], ShardSpec]) -> ShardSpec:
        """The cut, given how a length is cut (``manager.spec``)."""
        return rows(self.count)


@dataclasses.dataclass(frozen=True)
class GridNodes:
    """The points of a ``rows`` x ``cols`` grid, row after row: a latitude band of the
    fields is a contiguous range of them."""

    rows: int
    cols: int

    @property
    def count(self) -> int:
        return self.rows * self.cols

    def spec(self, manager: DistributedManager) -> ShardSpec:
        return self.cut(manager.spec)

    def cut(self, rows: Callable[[int], ShardSpec]) -> ShardSpec:
        return ShardSpec(tuple(n * self.cols for n in rows(self.rows)))


@dataclasses.dataclass(frozen=True)
class BandNodes:
    """Nodes sorted by ``row``, the grid row (of ``grid_rows``) each one sits on: a node is
    owned by the rank that owns its row (ranks may own none)."""

    row: tuple[int, ...]
    grid_rows: int

    def __post_init__(self) -> None:
        if any(b < a for a, b in zip(self.row, self.row[1:], strict=False)):
            raise ConfigError("BandNodes: sort the nodes by their grid row (north to south)")
        if self.row and not 0 <= self.row[0] <= self.row[-1] < self.grid_rows:
            raise ConfigError(
                f"BandNodes: rows span [{self.row[0]}, {self.row[-1]}] of a grid of "
                f"{self.grid_rows} rows"
            )

    @property
    def count(self) -> int:
        return len(self.row)

    def spec(self, manager: DistributedManager) -> ShardSpec:
        return self.cut(manager.spec)

    def cut(self, rows: Callable[[int], ShardSpec]) -> ShardSpec:
        bands = rows(self.grid_rows)
        row = torch.tensor(self.row, dtype=torch.long)
        bounds = torch.tensor(bands.offsets[1:], dtype=torch.long)
        owner = torch.bucketize(row, bounds, right=True)
        return ShardSpec(tuple(torch.bincount(owner, minlength=bands.parts).tolist()))

    def __repr__(self) -> str:
        return f"BandNodes({self.count} nodes on a grid of {self.grid_rows} rows)"


NodeSet = Nodes | GridNodes | BandNodes


class Graph(nn.Module):
    """Edges from ``src`` nodes to ``dst`` nodes (``dst`` None: the same set), with optional
    per-edge attributes. The edges are kept sorted by destination (stably; ``edge_attr``
    follows). The tensors are not in the state_dict (they are built from the model's
    arguments), so checkpoints do not depend on how the graph is cut.

    ``route`` picks how a sharded copy moves its halo (``"auto"``, ``"halo"``, ``"gather"``;
    :mod:`mpidp.graph.halo`)."""

    edges: torch.Tensor
    attr: torch.Tensor | None

    def __init__(
        self,
        edge_index: torch.Tensor,
        src: NodeSet,
        dst: NodeSet | None = None,
        edge_attr: torch.Tensor | None = None,
        route: str = "auto",
    ) -> None:
        super().__init__()
        _check_index(edge_index)
        dst = src if dst is None else dst
        for row, nodes, what in ((0, src, "source"), (1, dst, "destination")):
            ids = edge_index[row]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= nodes.count):
                raise ConfigError(
                    f"Graph: {what} ids span [{int(ids.min())}, {int(ids.max())}] for "
                    f"{nodes.count} nodes"
                )
        if edge_attr is not None and edge_attr.size(0) != edge_index.size(1):
            raise ConfigError(
                f"Graph: {edge_attr.size(0)} edge attributes for {edge_index.size(1)} edges"
            )
        if route not in ROUTES:
            raise ConfigError(f"Graph: route={route!r}; use one of {', '.join(ROUTES)}")
        edges, perm = sort_by_destination(edge_index.to(torch.long))
        self.src, self.dst, self.route = src, dst, route
        self.register_buffer("edges", edges, persistent=False)
        attr = None if edge_attr is None else edge_attr[perm]
        self.register_buffer("attr", attr, persistent=False)

    @property
    def num_edges(self) -> int:
        return int(self.edges.size(1))

    @property
    def edge_index(self) -> torch.Tensor:
        """The edges: row 0 indexes :meth:`src_features`' result, row 1 the destinations."""
        return self.edges

    @property
    def edge_attr(self) -> torch.Tensor | None:
        return self.attr

    @property
    def num_dst(self) -> int:
        """Destination nodes computed here."""
        return self.dst.count

    def src_features(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """The source-node features the edges read, from the source nodes held here."""
        return x

    def own_src(self, values: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The entries of a per-source-node tensor (all nodes) for the nodes held here."""
        return values

    def own_dst(self, values: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The entries of a per-destination-node tensor (all nodes) for the nodes held here."""
        return values

    def extra_repr(self) -> str:
        return f"{self.src} -> {self.dst}, {self.num_edges} edges"


class ShardedGraph(DomainParallel, Graph):
    """A :class:`Graph` on this rank's destination nodes (made by
    ``ShardedGraph.from_module(graph, manager)`` or conversion): its edges, relabelled, and a
    halo exchange in ``src_features`` (collective over the domain group). The plan is made on
    first use for the manager's cut and kept."""

    _plans: dict[tuple[Any, ...], GraphHaloPlan]

    def plan(self) -> GraphHaloPlan:
        """This rank's :class:`~mpidp.graph.halo.GraphHaloPlan` for the current cut."""
        manager = self._manager()
        src, dst = self.src.spec(manager), self.dst.spec(manager)
        key = (manager.domain_rank, src, dst, self.edges.device)
        plans = self.__dict__.setdefault("_plans", {})
        if key not in plans:
            plans[key] = plan_graph_halo(self.edges, src, dst, manager.domain_rank, self.route)
        return plans[key]

    @property
    def edge_index(self) -> torch.Tensor:
        if self._alone():
            return self.edges
        return self.plan().edge_index.to(self.edges.device)

    @property
    def edge_attr(self) -> torch.Tensor | None:
        if self.attr is None or self._alone():
            return self.attr
        return self.attr[self.plan().edge_ids.to(self.attr.device)]

    @property
    def num_dst(self) -> int:
        return self.dst.count if self._alone() else self.plan().num_dst

    def src_features(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        if self._alone():
            return x
        plan = self._dry_logged(x, dim)
        return graph_halo_exchange(x, plan, dim, self._transport(x))

    def _dry_logged(self, x: torch.Tensor, dim: int) -> GraphHaloPlan:
        """This rank's plan, its exchange logged when a dry run asks (:func:`logging_exchanges`)."""
        plan = self.plan()
        active = _LOG.get()
        if active is not None:
            active[1].append(GraphExchange.of(plan, active[0].get(id(self), "?"), x, dim))
        return plan

    def _own(self, values: torch.Tensor, spec: ShardSpec, dim: int) -> torch.Tensor:
        if values.size(dim) != spec.total:
            raise ConfigError(
                f"rank {self._manager().rank}: {values.size(dim)} entries along dim {dim} "
                f"for a node set of {spec.total}; pass a value for every node"
            )
        rank = self._manager().domain_rank
        return values.narrow(dim, spec.start(rank), spec[rank])

    def own_src(self, values: torch.Tensor, dim: int = 0) -> torch.Tensor:
        if self._alone():
            return values
        return self._own(values, self.plan().src_spec, dim)

    def own_dst(self, values: torch.Tensor, dim: int = 0) -> torch.Tensor:
        if self._alone():
            return values
        return self._own(values, self.plan().dst_spec, dim)


@dataclasses.dataclass(frozen=True)
class GraphExchange:
    """One halo exchange of a graph in one rank's forward (from a dry run), in source nodes:
    what this rank hands to the exchange's collectives in the forward (``sent``) and in the
    backward (``sent_back``), what it receives in each (``received``, ``received_back``), and
    the elements per node (batch and channels)."""

    path: str
    rank: int
    route: str
    sent: int
    sent_back: int
    received: int
    received_back: int
    elements: int

    @classmethod
    def of(cls, plan: GraphHaloPlan, path: str, x: torch.Tensor, dim: int) -> GraphExchange:
        """The exchange ``plan`` makes of ``x``'s nodes along ``dim`` (graph ``path``)."""
        d = dim % x.dim()
        per_node = math.prod(x.shape[:d] + x.shape[d + 1 :])
        own, others = plan.src_spec[plan.rank], plan.received()
        if plan.route == "halo":  # the backward is the reverse exchange
            sent = sum(len(s) for s in plan.send)
            counts = (sent, others, others, sent)
        else:  # all_gather_v of this rank's nodes; its backward reduce-scatters every node
            total = plan.src_spec.total
            counts = (own, total, others, own * (plan.parts - 1))
        return cls(path, plan.rank, plan.route, *counts, per_node)


#: (graph paths by module id, the log) while :func:`logging_exchanges` is active
_LOG: contextvars.ContextVar[tuple[dict[int, str], list[GraphExchange]] | None] = (
    contextvars.ContextVar("mpidp_graph_exchanges", default=None)
)


@contextlib.contextmanager
def logging_exchanges(paths: dict[int, str], log: list[GraphExchange]) -> Iterator[None]:
    """Inside this block every halo exchange of a :class:`ShardedGraph` is appended to
    ``log`` as a :class:`GraphExchange` (its path looked up by ``id`` in ``paths``): what the
    dry run (mpidp.preflight.validate, over simulated ranks) tells ``mpidp plan``."""
    token = _LOG.set((paths, log))
    try:
        yield
    finally:
        _LOG.reset(token)


register_layer(Graph, ShardedGraph)
