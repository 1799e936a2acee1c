"""The halo of a graph shard: which source nodes a rank needs from whom, without assuming
the graph is symmetric.

A rank owns a contiguous range of destination nodes and every edge that ends in them
(:mod:`mpidp.graph.edges`). Its layers read the features of those edges' source nodes: the
ones in its own range of the source nodes are local, the rest (its halo) live on their owners.
What rank i must send to rank j is what j's edges read from i's range, known exactly from
j's edges. anemoi derives what to send from what a rank receives, which is the same only on
symmetric graphs; here a directed graph, and the bipartite grid -> mesh and mesh -> grid
graphs (whose source and destination nodes are different sets, cut differently), are planned
the same way.

Two routes move the halo:

- ``"halo"``: one :func:`~mpidp.ops.collectives.indexed_all_to_all_v` of exactly the halo nodes;
  the backward sends their gradients back and adds them on the owners.
- ``"gather"``: one :func:`~mpidp.ops.collectives.all_gather_v` of every source node, for halos
  that reach most of the graph (coarse multi-mesh edges span tens of degrees, so at 4 ranks a
  rank reads nearly every node): it moves a little more and skips the index work.

``"auto"`` picks the gather when the halos add up to more than ``gather_above`` of what the
gather would move. The plan is a pure function of global facts, the same on every rank, so
the messages pair up with no negotiation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import torch

from mpidp.errors import ConfigError
from mpidp.graph.edges import _check_index, edges_of
from mpidp.ops.collectives import all_gather_v, indexed_all_to_all_v, resolve_transport
from mpidp.runtime.partition import ShardSpec

__all__ = [
    "ROUTES",
    "GraphHaloPlan",
    "graph_halo_exchange",
    "plan_graph_halo",
    "plan_graph_halo_local",
]

ROUTES = ("auto", "halo", "gather")


@dataclasses.dataclass(frozen=True, eq=False)
class GraphHaloPlan:
    """One rank's view of a graph cut by destination: its edges, relabelled, and its halo.

    ``edge_index`` holds this rank's edges in their global order; row 1 counts from the
    first destination node it owns, row 0 indexes what :func:`graph_halo_exchange` returns:
    its own source nodes first, then ``halo`` (``"halo"`` route), or every source node
    (``"gather"`` route). ``edge_ids`` are those edges' positions in the global edge list
    (to pick their attributes). ``send[j]`` are the local source nodes this rank sends rank j,
    ``sizes[i][j]`` how many rank i sends rank j (the same matrix on every rank).
    """

    rank: int
    src_spec: ShardSpec
    dst_spec: ShardSpec
    route: str
    halo: tuple[int, ...]
    send: tuple[tuple[int, ...], ...]
    sizes: tuple[tuple[int, ...], ...]
    edge_index: torch.Tensor
    edge_ids: torch.Tensor

    @property
    def parts(self) -> int:
        return self.src_spec.parts

    @property
    def num_src(self) -> int:
        """Source nodes :func:`graph_halo_exchange` returns on this rank."""
        if self.route == "gather":
            return self.src_spec.total
        return self.src_spec[self.rank] + len(self.halo)

    @property
    def num_dst(self) -> int:
        return self.dst_spec[self.rank]

    def received(self) -> int:
        """Source nodes this rank receives from others (rows of the exchange)."""
        if self.route == "gather":
            return self.src_spec.total - self.src_spec[self.rank]
        return len(self.halo)

    @functools.cached_property
    def send_index(self) -> list[torch.Tensor]:
        """``send`` as index tensors (made once: the exchange runs every layer, every step)."""
        return [torch.tensor(s, dtype=torch.long) for s in self.send]

    @functools.cached_property
    def size_matrix(self) -> list[list[int]]:
        return [list(r) for r in self.sizes]

    def __repr__(self) -> str:
        return (
            f"GraphHaloPlan(rank={self.rank}, route={self.route!r}, src={self.src_spec}, "
            f"dst={self.dst_spec}, edges={self.edge_ids.numel()}, halo={len(self.halo)})"
        )


def _needs(src: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Sorted distinct sources outside ``[lo, hi)``."""
    ids = torch.unique(src)
    return ids[(ids < lo) | (ids >= hi)]


def _check_specs(src_spec: ShardSpec, dst_spec: ShardSpec, route: str, rank: int) -> None:
    if src_spec.parts != dst_spec.parts:
        raise ConfigError(
            f"rank {rank}: the source nodes are cut into {src_spec.parts} parts and the "
            f"destinations into {dst_spec.parts}; cut both over the same group"
        )
    if route not in ROUTES:
        raise ConfigError(f"rank {rank}: route={route!r}; use one of {', '.join(ROUTES)}")


def _check_ids(edge_index: torch.Tensor, src_spec: ShardSpec, dst_spec: ShardSpec, rank: int):
    for row, spec, what in ((0, src_spec, "source"), (1, dst_spec, "destination")):
        ids = edge_index[row]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= spec.total):
            raise ConfigError(
                f"rank {rank}: {what} ids span [{int(ids.min())}, {int(ids.max())}] but there "
                f"are {spec.total} {what} nodes ({spec})"
            )


def _build(
    rank: int,
    src_spec: ShardSpec,
    dst_spec: ShardSpec,
    needs: Sequence[torch.Tensor],
    local: torch.Tensor,
    edge_ids: torch.Tensor,
    route: str,
    gather_above: float,
) -> GraphHaloPlan:
    """The plan from every rank's halo (sorted global source ids) and this rank's edges."""
    p = src_spec.parts
    bounds = torch.tensor(src_spec.offsets[1:], dtype=torch.long)
    owners = [torch.bucketize(n.cpu(), bounds, right=True) for n in needs]
    sizes = tuple(
        tuple(int((owners[j] == i).sum()) for j in range(p)) for i in range(p)
    )  # sizes[i][j]: from i to j
    if route == "auto":
        moved = sum(n.numel() for n in needs)
        everything = (p - 1) * src_spec.total
        route = "gather" if p > 1 and moved > gather_above * everything else "halo"
    me, lo = rank, src_spec.start(rank)
    send = tuple(
        tuple((needs[j].cpu()[owners[j] == me] - lo).tolist()) if j != me else () for j in range(p)
    )
    halo = tuple(needs[me].tolist())
    src = local[0].to(torch.long)
    if route == "gather":
        new_src = src
    else:  # own sources first, then the halo in its (sorted) order
        own = (src >= lo) & (src < src_spec.stop(me))
        new_src = torch.where(own, src - lo, 0)
        if halo:
            halo_t = needs[me].to(src.device)
            at = torch.searchsorted(halo_t, src[~own])
            new_src[~own] = src_spec[me] + at
    new_dst = local[1].to(torch.long) - dst_spec.start(me)
    return GraphHaloPlan(
        rank=me,
        src_spec=src_spec,
        dst_spec=dst_spec,
        route=route,
        halo=halo,
        send=send,
        sizes=sizes,
        edge_index=torch.stack([new_src, new_dst]),
        edge_ids=edge_ids,
    )


def plan_graph_halo(
    edge_index: torch.Tensor,
    src_spec: ShardSpec,
    dst_spec: ShardSpec,
    rank: int,
    route: str = "auto",
    gather_above: float = 0.5,
) -> GraphHaloPlan:
    """Rank ``rank``'s plan from the whole edge list (global ids; any order: the edges ending
    in each rank's destinations are taken in edge order), with the source nodes cut by
    ``src_spec`` and the destinations by ``dst_spec`` (the same spec twice for a graph on one
    node set). Pure: every rank computes every rank's halo, nothing is sent."""
    _check_index(edge_index)
    _check_specs(src_spec, dst_spec, route, rank)
    _check_ids(edge_index, src_spec, dst_spec, rank)
    needs, mine = [], None
    for q in range(dst_spec.parts):
        ids = edges_of(edge_index, dst_spec.start(q), dst_spec.stop(q))
        needs.append(_needs(edge_index[0, ids], src_spec.start(q), src_spec.stop(q)))
        if q == rank:
            mine = ids
    assert mine is not None
    local = edge_index[:, mine]
    return _build(rank, src_spec, dst_spec, needs, local, mine, route, gather_above)


def plan_graph_halo_local(
    edge_index: torch.Tensor,
    src_spec: ShardSpec,
    dst_spec: ShardSpec,
    group: Any = None,
    route: str = "auto",
    gather_above: float = 0.5,
) -> GraphHaloPlan:
    """This rank's plan from its own edges only (global ids, every destination in its range,
    e.g. read from its part of a graph file): the ranks learn each other's halos in one
    all-gather of node ids. ``edge_ids`` count this rank's edges from 0.

    Collective over ``group`` (None: the domain group)."""
    t = resolve_transport(group, edge_index.device)
    _check_index(edge_index)
    _check_specs(src_spec, dst_spec, route, t.rank)
    problem = ""
    if src_spec.parts != t.size:
        problem = f"the node partitions have {src_spec.parts} parts for {t.size} ranks"
    else:
        _check_ids(edge_index, src_spec, dst_spec, t.rank)
        dst = edge_index[1]
        lo, hi = dst_spec.start(t.rank), dst_spec.stop(t.rank)
        outside = int(((dst < lo) | (dst >= hi)).sum())
        if outside:
            problem = (
                f"{outside} of its {dst.numel()} edges end outside its destinations [{lo}, "
                f"{hi}); give each rank the edges into its own nodes (sort_edges_1hop_sharding)"
            )
    mine = (
        _needs(edge_index[0], src_spec.start(t.rank), src_spec.stop(t.rank))
        if not problem
        else None
    )
    gathered = t.all_gather_object((problem, None if mine is None else mine.tolist()))
    bad = [(r, why) for r, (why, _) in enumerate(gathered) if why]
    if bad:
        raise ConfigError(
            f"rank {t.rank}: plan_graph_halo_local: "
            + "; ".join(f"rank {r}: {why}" for r, why in bad)
        )
    needs = [torch.tensor(ids, dtype=torch.long) for _, ids in gathered]
    ids = torch.arange(edge_index.size(1), device=edge_index.device)
    return _build(t.rank, src_spec, dst_spec, needs, edge_index, ids, route, gather_above)


def graph_halo_exchange(
    x: torch.Tensor, plan: GraphHaloPlan, dim: int = -2, group: Any = None
) -> torch.Tensor:
    """The source-node features this rank's edges read (``plan.edge_index`` row 0 indexes
    them), from its own ``x`` (its part of the source nodes along ``dim``): its own nodes then
    its halo, or every node on the gather route. The backward adds the halo's gradients on
    their owners. Collective over ``group`` (None: the domain group)."""
    t = resolve_transport(group, x.device)
    d = dim % max(x.dim(), 1)
    if x.size(d) != plan.src_spec[t.rank] or plan.parts != t.size or plan.rank != t.rank:
        raise ConfigError(
            f"rank {t.rank}: graph_halo_exchange: {x.size(d)} source nodes along dim {dim}, "
            f"but the plan (rank {plan.rank}, {plan.parts} ranks) gives this rank "
            f"{plan.src_spec[plan.rank]} of {plan.src_spec}; feed the nodes of the plan's cut"
        )
    if t.size == 1:
        return x
    if plan.route == "gather":
        return all_gather_v(x, list(plan.src_spec), d, group=t)
    index = plan.send_index
    if index and index[0].device != x.device:
        index = [i.to(x.device) for i in index]
    halo = indexed_all_to_all_v(x, index, plan.size_matrix, d, group=t)
    return torch.cat([x, halo], d)
