"""A small GraphCast-style model: grid -> mesh -> processor -> grid, on a mesh generated here
(no downloads).

The grid is the latitude-longitude grid of the fields (row 0 north), its points row after
row (:class:`~mpidp.graph.GridNodes`: a latitude band is a range of them). The mesh is a
Fibonacci lattice on the sphere, sorted north to south and cut with the grid rows it sits on
(:class:`~mpidp.graph.BandNodes`), so a rank's mesh nodes lie over its band. Edges, all
directed and none symmetric by construction:

- grid -> mesh: every grid point sends to its ``k_encode`` nearest mesh nodes;
- mesh -> mesh: every mesh node receives from its ``k_mesh`` nearest other mesh nodes;
- mesh -> grid: every grid point receives from its ``k_decode`` nearest mesh nodes.

Edge attributes are the displacement between the two ends (unit-sphere coordinates) and its
length; node attributes are the positions. Everything is a pure function of the arguments,
so every rank builds the same graphs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mpidp.errors import ConfigError
from mpidp.graph.layers import GraphTransformerLayer, InteractionNetwork, _mlp
from mpidp.graph.module import BandNodes, Graph, GridNodes

__all__ = ["GraphCastNet", "fibonacci_mesh", "grid_points", "knn_edges"]

PROCESSORS = ("interaction", "transformer")


def _xyz(lat: torch.Tensor, lon: torch.Tensor) -> torch.Tensor:
    lat, lon = torch.deg2rad(lat), torch.deg2rad(lon)
    return torch.stack([lat.cos() * lon.cos(), lat.cos() * lon.sin(), lat.sin()], -1)


def grid_points(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xyz, lat)`` of the cell centres of a ``rows`` x ``cols`` grid, row 0 north, row
    after row (float64)."""
    lat = 90.0 - 180.0 * (torch.arange(rows, dtype=torch.float64) + 0.5) / rows
    lon = 360.0 * torch.arange(cols, dtype=torch.float64) / cols
    lat2, lon2 = torch.meshgrid(lat, lon, indexing="ij")
    return _xyz(lat2.reshape(-1), lon2.reshape(-1)), lat2.reshape(-1)


def fibonacci_mesh(count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xyz, lat)`` of ``count`` nearly evenly spread points on the sphere (a Fibonacci
    lattice), sorted north to south (float64)."""
    i = torch.arange(count, dtype=torch.float64)
    lat = torch.rad2deg(torch.asin(1.0 - 2.0 * (i + 0.5) / count))
    lon = torch.remainder(i * 180.0 * (3.0 - math.sqrt(5.0)), 360.0)
    order = torch.sort(-lat, stable=True).indices
    return _xyz(lat[order], lon[order]), lat[order]


def knn_edges(
    src_xyz: torch.Tensor, dst_xyz: torch.Tensor, k: int, from_src: bool = False
) -> torch.Tensor:
    """Edges (2, E) joining each destination to its ``k`` nearest sources (``from_src``:
    each source to its ``k`` nearest destinations), nearest first. The same on every rank
    (one deterministic kernel on the same numbers); a node is not its own neighbour when
    both sets are one."""
    same = src_xyz is dst_xyz
    a, b = (src_xyz, dst_xyz) if from_src else (dst_xyz, src_xyz)
    if k > b.size(0) - same:
        raise ConfigError(f"k={k} neighbours of {b.size(0) - same} candidates")
    step = max(1, (1 << 24) // max(b.size(0), 1))  # distances held at once: at most 2**24
    near = []
    for lo in range(0, a.size(0), step):
        dist = torch.cdist(a[lo : lo + step], b)
        if same:
            rows = torch.arange(dist.size(0))
            dist[rows, rows + lo] = math.inf
        near.append(torch.topk(dist, k, dim=1, largest=False, sorted=True).indices)
    mine = torch.arange(a.size(0)).repeat_interleave(k)
    pairs = (mine, torch.cat(near).reshape(-1))
    return torch.stack(pairs[::-1] if not from_src else pairs)


def _edge_attr(edge_index: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    delta = dst[edge_index[1]] - src[edge_index[0]]
    return torch.cat([delta, delta.norm(dim=-1, keepdim=True)], -1).float()


def _band_rows(lat: torch.Tensor, rows: int) -> tuple[int, ...]:
    """The grid row each latitude lies in (row 0 north)."""
    row = torch.floor((90.0 - lat) * rows / 180.0).clamp(0, rows - 1)
    return tuple(int(r) for r in row)


def _attr(graph: Graph, dtype: torch.dtype) -> torch.Tensor:
    assert graph.edge_attr is not None  # built with attributes
    return graph.edge_attr.to(dtype)


class GraphCastNet(nn.Module):
    """Fields (B, C, H, W) -> fields (B, out_channels, H, W) through a mesh of ``mesh_nodes``
    nodes: embed, encode grid -> mesh (interaction network), ``layers`` processor layers on the
    mesh (interaction networks, or graph transformers with ``processor="transformer"``),
    decode mesh -> grid, project. Domain-parallel after :func:`~mpidp.convert_to_domain_parallel`
    (its three graphs become :class:`~mpidp.graph.ShardedGraph`)."""

    grid_xyz: torch.Tensor
    mesh_xyz: torch.Tensor
    #: its forward is written for bands (``own_src``/``own_dst``): conversion runs it on them
    _mpidp_band_forward = True

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        grid: tuple[int, int],
        mesh_nodes: int = 256,
        hidden: int = 32,
        layers: int = 2,
        processor: str = "interaction",
        aggregation: str = "sum",
        heads: int = 4,
        k_encode: int = 2,
        k_mesh: int = 6,
        k_decode: int = 3,
    ) -> None:
        super().__init__()
        if processor not in PROCESSORS:
            raise ConfigError(f"processor={processor!r}; use one of {PROCESSORS}")
        rows, cols = grid
        grid_xyz, _ = grid_points(rows, cols)
        mesh_xyz, mesh_lat = fibonacci_mesh(mesh_nodes)
        g, m = GridNodes(rows, cols), BandNodes(_band_rows(mesh_lat, rows), rows)
        e_g2m = knn_edges(grid_xyz, mesh_xyz, k_encode, from_src=True)
        e_mm = knn_edges(mesh_xyz, mesh_xyz, k_mesh)
        e_m2g = knn_edges(mesh_xyz, grid_xyz, k_decode)
        self.g2m = Graph(e_g2m, g, m, _edge_attr(e_g2m, grid_xyz, mesh_xyz))
        self.mesh = Graph(e_mm, m, m, _edge_attr(e_mm, mesh_xyz, mesh_xyz))
        self.m2g = Graph(e_m2g, m, g, _edge_attr(e_m2g, mesh_xyz, grid_xyz))
        self.register_buffer("grid_xyz", grid_xyz.float(), persistent=False)
        self.register_buffer("mesh_xyz", mesh_xyz.float(), persistent=False)
        self.processor = processor
        d = hidden
        self.grid_embed = _mlp(in_channels + 3, d, d)
        self.mesh_embed = _mlp(3, d, d)
        self.edge_embeds = nn.ModuleList(_mlp(4, d, d) for _ in range(3))
        self.encoder = InteractionNetwork(d, d, d, d, aggregation)
        blocks: list[nn.Module]
        if processor == "interaction":
            blocks = [InteractionNetwork(d, d, d, d, aggregation) for _ in range(layers)]
        else:
            blocks = [GraphTransformerLayer(d, d, d, heads, 2 * d) for _ in range(layers)]
        self.blocks = nn.ModuleList(blocks)
        self.decoder = InteractionNetwork(d, d, d, d, aggregation)
        self.head = nn.Linear(d, out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        dtype = x.dtype
        grid = x.permute(0, 2, 3, 1).reshape(b, h * w, c)
        pos = self.g2m.own_src(self.grid_xyz).to(dtype).expand(b, -1, -1)
        g = self.grid_embed(torch.cat([grid, pos], -1))
        m = self.mesh_embed(self.g2m.own_dst(self.mesh_xyz).to(dtype)).expand(b, -1, -1)
        embed_g2m, embed_mm, embed_m2g = self.edge_embeds
        m, _ = self.encoder(g, m, embed_g2m(_attr(self.g2m, dtype)), self.g2m)
        e = embed_mm(_attr(self.mesh, dtype))
        for block in self.blocks:
            if isinstance(block, InteractionNetwork):
                m, e = block(m, m, e, self.mesh)
            else:
                m = block(m, m, e, self.mesh)
        g, _ = self.decoder(m, g, embed_m2g(_attr(self.m2g, dtype)), self.m2g)
        return self.head(g).reshape(b, h, w, self.head.out_features).permute(0, 3, 1, 2)
