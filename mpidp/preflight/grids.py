"""The bytes a model moves on latitude x longitude blocks (its halos, per axis from each
layer's halo geometry, and its transposes), and the comparison of every grid of a number of
ranks (what ``mpidp plan`` and
``mpidp plan --scaling`` price on blocks; :mod:`mpidp.preflight.plan` documents the rules).

Blocks move their halos as mpidp.ops.block_halo does: the latitude rows, as wide as the block;
the rows beyond a pole, whose columns come from half a circle away (the polar fold); then the
longitude columns, as tall as the latitude-extended block, which carry the corners. Bands are
the grid ``(P, 1)``: the same arithmetic, no columns move. Each axis's rows come from the halo
exchange's own pieces and messages (mpidp.ops.halo_plan), each rank's asked for once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from torch import nn

from mpidp.errors import ConfigError
from mpidp.ops.halo_plan import Boundary, _check_widths, _messages, _pieces
from mpidp.preflight.validate import LayerSharding, axis_sharding
from mpidp.runtime.partition import Balanced, PartitionPolicy, ShardSpec

#: its public names are :mod:`mpidp.preflight.plan`'s (documented there)
__all__: list[str] = []


def axis_exchange(layer: LayerSharding) -> list[tuple[int, int, int, int]]:
    """Every rank of a layer's axis in its forward fetch: (rows received from other ranks,
    rows sent to them, messages received, messages sent), from the halo exchange's own pieces
    and messages (mpidp.ops.halo_plan), each rank's asked for once (the exchange's per-rank
    plan asks for every rank's: quadratic in the ranks, too slow to price 1024)."""
    n = len(layer.rows_in)
    if not any(layer.halo_before) and not any(layer.halo_after):
        return [(0, 0, 0, 0)] * n
    spec = ShardSpec(layer.rows_in)
    bound = Boundary.of(layer.boundary, -1)
    _check_widths(spec, layer.halo_before, layer.halo_after, bound)
    rows_in, rows_out = [0] * n, [0] * n
    got: list[set[int]] = [set() for _ in range(n)]
    to: list[set[int]] = [set() for _ in range(n)]
    for r in range(n):
        s = spec.offsets[r]
        pieces, _ = _pieces(
            spec, s - layer.halo_before[r], s + spec.sizes[r] + layer.halo_after[r], bound
        )
        for q, lo, hi in _messages([p for p in pieces if p.owner != r]):
            rows_in[r] += hi - lo
            rows_out[q] += hi - lo
            got[r].add(q)
            to[q].add(r)
    return [(rows_in[r], rows_out[r], len(got[r]), len(to[r])) for r in range(n)]


def _moved_bytes(
    lat: LayerSharding,
    lon: LayerSharding,
    i: int,
    j: int,
    itemsize: int,
    partition: PartitionPolicy,
) -> int:
    """Bytes block ``(i, j)`` sends (= receives, summed over a step) in a layer's transposes
    (``lat``, ``lon``: the layer cut along each axis; bands: ``lon`` is one rank's): a spectral
    layer's rfft2 and irfft2 all-to-alls (complex values; on blocks the pencil transposes
    along the longitude row too), windowed attention's fetch of straddling windows, a patch
    head's move of its pixel rows (and columns) to the policy's cut; forward and backward
    (the layer's form prices them: ``block_transpose_bytes``)."""
    if lat.form is None:
        return 0
    return int(lat.form.block_transpose_bytes(lat, lon, i, j, itemsize, partition))


def transpose_bytes(
    lat: Sequence[LayerSharding],
    lon: Sequence[LayerSharding],
    grid: tuple[int, int],
    itemsize: int,
    partition: PartitionPolicy,
) -> list[int]:
    """Bytes each rank of the ``grid`` (row-major) sends in one training step in the
    transposes of the layers cut along both axes (:func:`_moved_bytes`)."""
    return [
        sum(_moved_bytes(a, b, *divmod(d, grid[1]), itemsize, partition)
            for a, b in zip(lat, lon, strict=True))
        for d in range(grid[0] * grid[1])
    ]  # fmt: skip


def block_shapes(parts: int) -> list[tuple[int, int]]:
    """Every ``(P_lat, P_lon)`` grid of ``parts`` ranks, bands ``(parts, 1)`` first."""
    return [(parts // n, n) for n in range(1, parts + 1) if parts % n == 0]


def _cut(
    model: nn.Module,
    layers: Sequence[LayerSharding],
    grid: tuple[int, int],
    partition: PartitionPolicy,
    shard_dim: int,
) -> tuple[tuple[LayerSharding, ...], tuple[LayerSharding, ...], list[str]]:
    """The dry run's spatial ``layers`` cut along the latitude over ``grid[0]`` ranks and
    along the longitude over ``grid[1]`` (:func:`~mpidp.preflight.validate.axis_sharding` per
    axis, from each layer's own halo geometry), and the problems of either cut."""
    lat: list[LayerSharding] = []
    lon: list[LayerSharding] = []
    problems: list[str] = []
    for layer in layers:
        module = model.get_submodule(layer.path)
        cuts: list[LayerSharding | None] = []
        for parts, across in ((grid[0], False), (grid[1], True)):
            if not across and len(layer.rows_in) == parts:  # the dry run's own cut
                cuts.append(layer)
                continue
            policy = partition if parts > 1 else Balanced()  # one rank: the whole axis
            found, why = axis_sharding(
                layer.path, module, layer.shape_in, layer.shape_out, parts, policy,
                shard_dim, across,
            )  # fmt: skip
            problems += [f"{p} (along the {'longitude' if across else 'latitude'})" for p in why]
            cuts.append(found)
        if cuts[0] is not None and cuts[1] is not None:
            lat.append(cuts[0])
            lon.append(cuts[1])
    return tuple(lat), tuple(lon), problems


def fold_rows(lat: LayerSharding, i: int) -> int:
    """Rows beyond a polar edge that latitude index ``i`` fetches in a layer (on blocks they
    take the columns half a circle away: mpidp.ops.block_halo, step 2, the polar fold)."""
    bound = Boundary.of(lat.boundary, -1)
    low, high = bound.low.startswith("polar"), bound.high.startswith("polar")
    if not (low or high):
        return 0
    h = lat.shape_in[len(lat.shape_in) + lat.dim_in]
    start = sum(lat.rows_in[:i])
    lo, hi = start - lat.halo_before[i], start + lat.rows_in[i] + lat.halo_after[i]
    return (max(0, min(hi, 0) - lo) if low else 0) + (max(0, hi - max(lo, h)) if high else 0)


def fold_cut(lon: LayerSharding) -> LayerSharding:
    """The polar fold's column exchange of a layer cut along the longitude: each column takes
    the one half a circle away, from the block of its longitude row that owns it."""
    n, w = len(lon.rows_in), lon.shape_in[len(lon.shape_in) + lon.dim_in]
    return dataclasses.replace(
        lon, halo_before=(w // 2,) * n, halo_after=(-(w // 2),) * n, boundary="circular"
    )


def _halo_bytes(
    lat: Sequence[LayerSharding], lon: Sequence[LayerSharding], grid: tuple[int, int], itemsize: int
) -> tuple[list[int], list[int]]:
    """Bytes each rank of the ``grid`` (row-major) receives and sends in one training step in
    the halo exchanges of the layers cut along both axes (``lat``, ``lon``): the latitude
    rows (as wide as the block), the polar fold's rows, then the longitude columns as tall as
    the latitude-extended block (which brings the corners); forward, and the adjoint in the
    backward pass (each rank receives what it sent and sends what it received)."""
    p_lat, p_lon = grid
    moved = [0] * (p_lat * p_lon)
    sent = [0] * (p_lat * p_lon)
    for a, b in zip(lat, lon, strict=True):
        d = len(a.shape_in) + a.dim_in
        point = math.prod(a.shape_in) // (a.shape_in[d] * a.shape_in[d + 1]) * itemsize
        rows = axis_exchange(a)
        cols = axis_exchange(b)
        fold = [fold_rows(a, i) if p_lon > 1 else 0 for i in range(p_lat)]
        folded = axis_exchange(fold_cut(b)) if any(fold) else [(0, 0, 0, 0)] * p_lon
        for i in range(p_lat):
            tall = max(0, a.rows_in[i] + a.halo_before[i] + a.halo_after[i])
            for j in range(p_lon):
                recv = rows[i][0] * b.rows_in[j] + cols[j][0] * tall + fold[i] * folded[j][0]
                send = rows[i][1] * b.rows_in[j] + cols[j][1] * tall + fold[i] * folded[j][1]
                moved[i * p_lon + j] += (recv + send) * point
                sent[i * p_lon + j] += (recv + send) * point
    return moved, sent


@dataclasses.dataclass(frozen=True)
class ShapeCost:
    """The bytes one grid of the same ranks moves in its halos and transposes: per training
    step, its busiest rank's (the larger of what it receives and sends) and the mean over
    ranks."""

    grid: tuple[int, int]
    busiest_bytes: int
    mean_bytes: float


def compare_shapes(
    model: nn.Module,
    layers: Sequence[LayerSharding],
    global_shape: Sequence[int],
    parts: int,
    partition: PartitionPolicy,
    itemsize: int,
    shard_dim: int = -2,
) -> tuple[list[ShapeCost], list[str]]:
    """The bytes ``model`` moves (the dry run's spatial ``layers``, on inputs of
    ``global_shape``) on every grid of ``parts`` ranks (:func:`block_shapes`), and why a grid
    cannot be priced (the input's rows or columns cannot be cut over it: the data's own
    partition refuses empty parts). The bytes are the halos' and the transposes'. Local."""
    found, why = [], []
    extents = (global_shape[shard_dim], global_shape[shard_dim + 1])
    for grid in block_shapes(parts):
        problems = []
        for n, p, what in ((extents[0], grid[0], "rows"), (extents[1], grid[1], "columns")):
            try:
                partition.spec(n, p)
            except ConfigError as err:
                problems.append(f"the input's {n} {what} over {p} ranks: {err}")
        if not problems:
            lat, lon, problems = _cut(model, layers, grid, partition, shard_dim)
        if problems:
            why.append(f"{grid[0]} x {grid[1]}: {problems[0]}")
            continue
        recv, send = _halo_bytes(lat, lon, grid, itemsize)
        moved = transpose_bytes(lat, lon, grid, itemsize, partition)
        per_rank = [max(r, s) + t for r, s, t in zip(recv, send, moved, strict=True)]
        found.append(ShapeCost(grid, max(per_rank), sum(per_rank) / len(per_rank)))
    return found, why


def best_blocks(shapes: Sequence[ShapeCost]) -> ShapeCost | None:
    """The block shape (``P_lon > 1``) whose busiest rank moves the fewest bytes (of
    equals, the one with fewer longitude ranks), or None when there is none."""
    blocks = [c for c in shapes if c.grid[1] > 1]
    return min(blocks, key=lambda c: (c.busiest_bytes, c.grid[1])) if blocks else None
