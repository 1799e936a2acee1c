"""A ShardedTensor's layout as its cuts, one per cut axis, so that a rule is written once per
axis: a band is the layout of one cut (its sharded dim over the domain group, holding
``blocks`` merged blocks), a latitude x longitude block the layout of two (the latitude dim
over the latitude column, the longitude dim over the longitude row; DESIGN.md, "Blocks"). A
block's cut holds ``grid.lead`` blocks merged before it (a batch folded into a window index)
as a band's holds its ``blocks``.

The element-wise rule (:mod:`mpidp.sharded.pointwise`) and the batch rule
(:mod:`mpidp.sharded.batch`) loop over :func:`cuts`: a plain argument of the global length
along a cut dim is cut to this rank's entries (:func:`part`), and the result takes the input's
cuts at the dims they land on (:func:`placed`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mpidp.sharded.block_layout import TokenSpec
from mpidp.sharded.layout import Cut
from mpidp.sharded.tensor import ShardedTensor

__all__ = ["Cut", "cuts", "part", "placed", "same_cuts"]


def cuts(x: ShardedTensor) -> tuple[Cut, ...]:
    """``x``'s cuts: one for a band or tokens, latitude then longitude for a block."""
    g = x._grid
    if g is None:
        return (Cut(x._dim, x._spec, x.rank, x._blocks),)
    if isinstance(g, TokenSpec):
        return (Cut(g.dim, x._spec, x.rank, 1, g),)
    i_lat, i_lon = x._manager.grid_coords
    return Cut(g.dims[0], g.lat, i_lat, g.lead[0]), Cut(g.dims[1], g.lon, i_lon, g.lead[1])


def part(x: ShardedTensor, cut: Cut, t: torch.Tensor, at: int) -> torch.Tensor:
    """This rank's entries of the plain ``t`` along its dim ``at``, which runs along ``cut``
    of ``x`` (the global length there); along the sharded dim, ``x.rows_of``."""
    return x.rows_of(t, at) if cut.dim == x._dim and x._grid is None else cut.part(t, at)


def placed(x: ShardedTensor, local: torch.Tensor, dims: tuple[int, ...]) -> ShardedTensor:
    """``local`` with ``x``'s cuts, at ``dims`` (one per cut, as :func:`cuts` lists them)."""
    g = x._grid
    if g is None:
        return x.like(local, dims[0])
    if isinstance(g, TokenSpec):
        return ShardedTensor(local, x._spec, dims[0], x._manager, grid=g.at(dims[0]))
    grid = replace(g, dims=(dims[0], dims[1]))
    return ShardedTensor(local, g.lat, dims[0], x._manager, grid=grid)


def same_cuts(a: ShardedTensor, x: ShardedTensor) -> bool:
    """Whether ``a`` is cut as ``x`` is, its cut dims counted from the end (each rank's part of
    ``a`` lines up with its part of ``x``)."""
    return (
        a.dim() - a._dim == x.dim() - x._dim
        and a._spec == x._spec
        and a._blocks == x._blocks
        and a._grid == x._grid
    )
