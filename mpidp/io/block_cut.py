"""Which field rows and columns make up one rank's block plus halo, and how (pure).

A rank at ``(i_lat, i_lon)`` of the domain grid owns rows ``lat.slice(i_lat)`` and columns
``lon.slice(i_lon)`` of an ``H x W`` field and asks for ``before``/``after`` more along each
dim. The halo exchange's 1-D plan (:func:`mpidp.ops.halo_plan.plan`) of each axis says where
every entry of that range comes from; here each plan becomes an index map into the field
(:class:`AxisCut`), so a reader fetches exactly those rows and columns and places them.

The padding is :func:`~mpidp.ops.block_halo.block_halo_exchange`'s: **latitude first** (its
boundary; under the polar kinds the rows beyond a pole take the columns half a circle away,
``(c + W/2) mod W``), **then longitude** on the latitude-extended field (its boundary,
``"circular"`` by default: the sphere wraps). A longitude boundary maps a column to a column
(or to zero) whatever the row, so entry ``(r, c)`` of the extended block is field entry
``(rows[r], cols[c] + W/2 if rolled[r])``, zero where either map says zero. Bands are the grid
``(P, 1)``: the column map is every column in order, read in one run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch

from mpidp.io._common import error
from mpidp.ops.geometry import HaloSpec
from mpidp.ops.halo_plan import Boundary, Piece
from mpidp.ops.halo_plan import plan as plan_for
from mpidp.runtime.grid import BlockSpec
from mpidp.runtime.manager import DistributedManager
from mpidp.runtime.partition import ShardSpec

__all__ = ["AxisCut", "Halo", "assemble", "axis_cut", "field_blocks", "manager_blocks", "runs"]

Halo = int | tuple[int, int] | HaloSpec


def manager_blocks(manager: DistributedManager, shape: tuple[int, int]) -> BlockSpec:
    """The manager's blocks of a field of ``shape``; on bands its partition of the rows
    (``manager.spec``) by every column, so a policy of per-rank weights (one per domain rank)
    cuts bands as it always did."""
    if manager.grid[1] == 1:
        return BlockSpec(manager.spec(shape[0]), ShardSpec.balanced(shape[1], 1))
    return manager.block_spec(shape)


def field_blocks(
    spec: ShardSpec | Sequence[int] | BlockSpec | None,
    manager: DistributedManager | None,
    shape: tuple[int, int],
    where: str,
) -> BlockSpec:
    """The blocks of a field of ``shape`` (H, W) that the ranks read: ``spec`` when given (a
    :class:`~mpidp.runtime.grid.BlockSpec`, or the rows' partition on bands), else the
    manager's (:meth:`~mpidp.DistributedManager.block_spec`: blocks when its grid cuts the
    longitude, bands otherwise). A spec that does not cut this field over the manager's grid
    raises a :class:`~mpidp.DataError` (every rank alike: the facts are agreed)."""
    h, w = shape
    p_lat, p_lon = (1, 1) if manager is None else manager.grid
    rank = 0 if manager is None else manager.domain_rank
    if spec is None:
        if manager is None:
            return BlockSpec(ShardSpec.balanced(h, 1), ShardSpec.balanced(w, 1))
        try:
            return manager_blocks(manager, shape)
        except Exception as err:
            raise error(rank, f"{where}: {err}", "use fewer domain ranks") from None
    if not isinstance(spec, BlockSpec):
        if p_lon > 1:
            raise error(
                rank,
                f"spec {list(spec)} partitions the rows only, but the domain grid "
                f"({p_lat}, {p_lon}) cuts the longitude too",
                "pass a BlockSpec (manager.block_spec((H, W))), or leave spec=None",
            )
        lat = spec if isinstance(spec, ShardSpec) else ShardSpec.from_sizes(spec)
        if lat.total != h or lat.parts != p_lat:
            raise error(
                rank,
                f"partition {list(lat.sizes)} cuts {lat.total} rows over {lat.parts} ranks "
                f"but {where} has {h} latitude rows and the domain group {p_lat} ranks",
                f"pass a spec of {p_lat} sizes summing to {h}",
            )
        spec = BlockSpec(lat, ShardSpec.balanced(w, 1))
    if spec.shape != (h, w) or spec.grid != (p_lat, p_lon):
        raise error(
            rank,
            f"partition {spec!r} cuts {spec.shape[0]} x {spec.shape[1]} over a "
            f"{spec.grid[0]} x {spec.grid[1]} grid, but {where} has {h} x {w} (lat x lon) "
            f"and the domain grid is {p_lat} x {p_lon}",
            f"pass a spec of {p_lat} row sizes summing to {h}"
            + (f" and {p_lon} column sizes summing to {w}" if p_lon > 1 else ""),
        )
    return spec


def widths(halo: Halo, parts: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(before, after)`` per rank of an axis of ``parts`` ranks."""
    if isinstance(halo, HaloSpec):
        return halo.before, halo.after
    if isinstance(halo, int):
        return (halo,) * parts, (halo,) * parts
    before, after = halo
    return (int(before),) * parts, (int(after),) * parts


@dataclasses.dataclass(frozen=True, eq=False)
class AxisCut:
    """One axis of a rank's block plus halo: the cut ``spec``, this rank's ``index`` along
    the axis, its ``halo`` widths, and per entry of the extended range the field index it
    comes from (``source``, -1: zero) and whether it is taken half a circle away along the
    other dim (``rolled``: rows beyond a pole)."""

    spec: ShardSpec
    index: int
    halo: tuple[int, int]
    source: np.ndarray
    rolled: np.ndarray

    @property
    def span(self) -> tuple[int, int]:
        """The global range ``[start - before, stop + after)`` of the extended entries."""
        return self.spec.start(self.index) - self.halo[0], self.spec.stop(self.index) + self.halo[1]

    @property
    def own(self) -> tuple[int, int]:
        """The global range this rank owns, ``[start, stop)``."""
        return self.spec.start(self.index), self.spec.stop(self.index)

    @property
    def plain(self) -> bool:
        """Whether the extended range is the owned one in order (no halo, nothing mirrored)."""
        lo, hi = self.own
        return len(self.source) == hi - lo and bool(np.array_equal(self.source, np.arange(lo, hi)))


def axis_cut(
    spec: ShardSpec,
    index: int,
    halo: Halo,
    boundary: Boundary,
    fail: Callable[[str, str], Exception],
    what: str,
) -> AxisCut:
    """The :class:`AxisCut` of rank ``index`` of an axis cut by ``spec``, extended by ``halo``
    (an int, a ``(before, after)`` pair or a :class:`~mpidp.HaloSpec` of per-rank widths) and
    filled beyond the edges by ``boundary``. ``fail(what, fix)`` makes the error raised for a
    halo that does not fit (``what`` names the axis in it)."""
    before, after = widths(halo, spec.parts)
    if len(before) != spec.parts or len(after) != spec.parts:
        raise fail(
            f"{what} halo {halo!r} has widths for {len(before)} ranks, not {spec.parts}",
            f"pass a HaloSpec with {spec.parts} widths",
        )
    try:
        pl = plan_for(spec.sizes, before, after, boundary, index)
    except Exception as err:
        raise fail(f"{what}: {err}", "use a smaller halo or another boundary") from None
    source = np.full(pl.length, -1, dtype=np.int64)
    rolled = np.zeros(pl.length, dtype=bool)
    pieces: list[Piece] = [*pl.local, *(p for _, p in pl.remote)]
    for p in pieces:
        first = spec.offsets[p.owner] + p.lo
        g = np.arange(first, first + p.rows)
        g = g[::-1] if p.flip else g
        source[p.at : p.at + p.span] = np.repeat(g, p.repeat) if p.repeat else g
        rolled[p.at : p.at + p.span] = p.roll
    return AxisCut(spec, index, (before[index], after[index]), source, rolled)


def runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """The sorted, merged runs ``[lo, hi)`` of the (non-negative) ``indices``."""
    out: list[tuple[int, int]] = []
    for i in np.unique(indices[indices >= 0]).tolist():
        if out and i == out[-1][1]:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _positions(found: Sequence[tuple[int, int]], n: int) -> np.ndarray:
    """Where each field index of ``found`` runs lies in their concatenation (-1: not read)."""
    pos = np.full(n, -1, dtype=np.int64)
    at = 0
    for lo, hi in found:
        pos[lo:hi] = np.arange(at, at + hi - lo)
        at += hi - lo
    return pos


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0]


def assemble(
    read: Callable[[int, int, int, int], torch.Tensor],
    rows: AxisCut,
    cols: AxisCut,
    shape: tuple[int, int],
) -> torch.Tensor:
    """The extended block ``(channels, rows, columns)`` of a field of ``shape``, placed by the
    index maps from reads of ``read(r0, r1, c0, c1)`` (``(channels, r1 - r0, c1 - c0)``).

    Rows are grouped by the columns they take (their own; under the polar kinds, those of
    the rows beyond a pole half a circle away): each group reads each run of its rows by each
    run of its columns once. On bands both take every column, so they are one group and no
    row is read twice. Exact: every entry is a copy of one read entry, or zero. The block
    alone (no halo) is returned as read."""
    if rows.plain and cols.plain:
        return read(*rows.own, *cols.own)
    w = shape[1]
    c_at = np.nonzero(cols.source >= 0)[0]
    own = cols.source[c_at]
    groups: dict[tuple[tuple[int, int], ...], list[tuple[np.ndarray, np.ndarray]]] = {}
    for rolled, c_src in ((False, own), (True, (own + w // 2) % w)):
        r_at = np.nonzero((rows.source >= 0) & (rows.rolled == rolled))[0]
        if len(r_at) and len(c_at):
            groups.setdefault(tuple(runs(c_src)), []).append((r_at, c_src))
    out: torch.Tensor | None = None
    for col_runs, members in groups.items():
        row_runs = runs(np.concatenate([rows.source[r_at] for r_at, _ in members]))
        data = _cat([_cat([read(*r, *c) for c in col_runs], 2) for r in row_runs], 1)
        if out is None:
            out = data.new_zeros((data.size(0), len(rows.source), len(cols.source)))
        r_pos, c_pos = _positions(row_runs, shape[0]), _positions(col_runs, w)
        for r_at, c_src in members:
            picked = data.index_select(1, torch.from_numpy(r_pos[rows.source[r_at]]))
            picked = picked.index_select(2, torch.from_numpy(c_pos[c_src]))
            out[:, torch.from_numpy(r_at)[:, None], torch.from_numpy(c_at)[None]] = picked
    if out is None:  # zeros only: an empty read gives the channels
        empty = read(0, 0, 0, 0)
        out = empty.new_zeros((empty.size(0), len(rows.source), len(cols.source)))
    return out
