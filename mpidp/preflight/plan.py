"""What a domain-parallel run of a model costs each rank, computed before anything is submitted.

:func:`plan_model` runs the dry run of :func:`~mpidp.validate_sharding_constraints` (shape
arithmetic on a meta tensor: no memory, no communication) and prices it: per rank, the rows it
owns, the halo rows every layer fetches, the bytes its halo exchanges move in one training
step and the activation memory its bands hold. ``mpidp plan`` prints it.

Bytes come from the halo exchange's own plan (:func:`mpidp.ops.halo_plan.plan`), so they count
exactly the rows that come from other ranks (rows filled by a zero boundary cost nothing; rows
across a pole or a periodic edge count when another rank owns them). A training step moves
them twice: the forward fetch and its adjoint in the backward pass. Spectral layers (an AFNO
filter, an FNO spectral convolution) add their two transposes (rfft2's all-to-all and
irfft2's), each twice per step; a patch head adds the boundary rows it moves to the policy's
cut. Normalisation layers add one small all-reduce each (a few numbers per channel group), not
counted.

Blocks (``parts=(P_lat, P_lon)``) are priced per axis from each layer's own halo geometry
(:func:`~mpidp.preflight.validate.axis_sharding`: the rule of the dry run, along the latitude
over ``P_lat`` ranks and along the longitude over ``P_lon``), as mpidp.ops.block_halo moves
them: the latitude rows, as wide as the block; the rows beyond a pole, whose columns come from
half a circle away (the polar fold); then the longitude columns, as tall as the latitude-
extended block, which carry the corners. Bands are the grid ``(P, 1)``: the same pricing, no
columns move. The dry run's simulated ranks check the latitude cut. Transposes on blocks are
priced by each layer's form as its block code moves them (``block_transpose_bytes``): a
spectral layer's pencil transpose along the longitude row (each rank given its sub-cut of the
block's rows, every column) then the band all-to-all over the whole domain group, each way in
rfft2 and irfft2; windows and patch heads along the latitude column on the block's columns,
then along the longitude row. Graphs are priced on bands only (a plan of blocks for a model
with them is refused). Every plan also prices the bytes (halos and transposes) of every grid
of as many ranks (:func:`compare_shapes`) and says whether bands or blocks move the fewest.

Activation memory is what autograd saves for the backward pass on the rank: the model's forward
runs on meta tensors of the global shape with every saved tensor's storage counted once
(parameters left out), and each rank takes its share of each from the spatial layer it was
saved in, or the last one before it: its rows of that layer's input, halo rows included (a
converted layer saves the band it extended, a storage of its own), of its output, or, in a
spectral layer, its W modes (the spectra live in the transposed layout); on blocks, the product
of its shares along both axes. bench/memory.py
measures the real bytes beside it: the U-Net to 0.05%, AFNO and Swin-style models to 5-11%.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mpidp.errors import ConfigError
from mpidp.graph.module import GraphExchange
from mpidp.preflight.grids import (
    ShapeCost,
    _cut,
    _halo_bytes,
    best_blocks,
    block_shapes,
    compare_shapes,
    transpose_bytes,
)
from mpidp.preflight.validate import (
    LayerSharding,
    SavedLog,
    ShardingReport,
    _meta_inputs,
    _validate,
)
from mpidp.runtime.grid import grid_shape
from mpidp.runtime.partition import Balanced, PartitionPolicy, Weighted

__all__ = [
    "EXAMPLE_MODELS",
    "ModelPlan",
    "RankCost",
    "ShapeCost",
    "best_blocks",
    "block_shapes",
    "build_model",
    "compare_shapes",
    "parse_partition",
    "plan_model",
]


def _example(name: str) -> Callable[[int, tuple[int, int]], nn.Module]:
    """The factory of example model ``name``, found in :mod:`mpidp.models` when it is called
    (the library does not import the examples)."""

    def build(channels: int, grid: tuple[int, int]) -> nn.Module:
        examples = importlib.import_module("mpidp.models.examples").EXAMPLES
        return examples[name](channels, grid)

    return build


#: Model names ``mpidp plan --model`` knows: factories of ``(channels, grid)`` (each builds the
#: example network of :mod:`mpidp.models` its name says).
EXAMPLE_MODELS: dict[str, Callable[[int, tuple[int, int]], nn.Module]] = {
    name: _example(name) for name in ("unet", "resblock", "patch", "afno", "fno", "swin", "graph")
}


@dataclasses.dataclass(frozen=True)
class RankCost:
    """One rank's share: rows owned (of the input), halo rows per layer (fetched beyond the
    band, before + after), halo bytes received and sent per training step, activation bytes."""

    rank: int
    rows: int
    halo_rows: tuple[int, ...]
    recv_bytes: int
    send_bytes: int
    activation_bytes: int
    #: of ``send_bytes``: what the all-to-alls of spectral layers, windowed attention and
    #: patch heads send
    transpose_bytes: int = 0
    #: of ``send_bytes``: what this rank hands to the halo exchanges of graphs (mpidp.graph;
    #: an all-gather counts this rank's part once, its reduce-scatter backward every node)
    graph_bytes: int = 0
    #: columns owned (of the input: all of them on bands), and halo columns per layer
    cols: int = 0
    halo_cols: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """The priced dry run; ``str()`` gives the tables ``mpidp plan`` prints."""

    shape: tuple[int, ...]
    parts: int
    partition: str
    itemsize: int
    report: ShardingReport
    ranks: tuple[RankCost, ...]
    serial_activation_bytes: int
    #: ``(P_lat, P_lon)``: bands are ``(parts, 1)``; rank ``i_lat * P_lon + i_lon``
    grid: tuple[int, int] = (1, 1)
    #: the spatial layers cut along the longitude (``report.layers``: along the latitude)
    across: tuple[LayerSharding, ...] = ()
    #: the bytes (halos and transposes) of every grid of ``parts`` ranks (:func:`compare_shapes`)
    shapes: tuple[ShapeCost, ...] = ()
    #: why a grid of ``parts`` ranks could not be priced
    unpriced: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "parts": self.parts,
            "partition": self.partition,
            "itemsize": self.itemsize,
            "problems": list(self.report.problems),
            "layers": [
                {
                    "path": layer.path,
                    "kind": layer.kind,
                    "boundary": layer.boundary,
                    "rows_in": list(layer.rows_in),
                    "rows_out": list(layer.rows_out),
                    "halo_before": list(layer.halo_before),
                    "halo_after": list(layer.halo_after),
                }
                for layer in self.report.layers
            ],
            "ranks": [dataclasses.asdict(r) for r in self.ranks],
            "serial_activation_bytes": self.serial_activation_bytes,
            "grid": list(self.grid),
            "columns": [
                {
                    "path": layer.path,
                    "cols_in": list(layer.rows_in),
                    "halo_before": list(layer.halo_before),
                    "halo_after": list(layer.halo_after),
                }
                for layer in self.across
            ],
            "shapes": [dataclasses.asdict(c) for c in self.shapes],
            "unpriced": list(self.unpriced),
        }

    def __str__(self) -> str:
        p_lat, p_lon = self.grid
        blocks = p_lon > 1
        cut = f"{p_lat} x {p_lon} = " if blocks else ""
        what = f"blocks of latitude x longitude, {self.partition}" if blocks else self.partition
        head = (
            f"mpidp plan: input {'x'.join(map(str, self.shape))} over {cut}{self.parts} domain "
            f"ranks ({what}), {self.itemsize}-byte values"
        )
        if blocks:
            per_rank = [
                f"{'rank':<6}{'block':>9}{'rows':>6}{'cols':>6}{'halo rows':>11}"
                f"{'halo cols':>11}{'comm MB/step in':>17}{'comm MB/step out':>18}"
                f"{'activations MB':>16}"
            ]
            for r in self.ranks:
                at = "{},{}".format(*divmod(r.rank, p_lon))
                per_rank.append(
                    f"{r.rank:<6}{at:>9}{r.rows:>6}{r.cols:>6}{sum(r.halo_rows):>11}"
                    f"{sum(r.halo_cols):>11}{r.recv_bytes / 1e6:>17.3f}"
                    f"{r.send_bytes / 1e6:>18.3f}{r.activation_bytes / 1e6:>16.2f}"
                )
        else:
            per_rank = [
                f"{'rank':<6}{'rows':>6}{'halo rows':>11}{'comm MB/step in':>17}"
                f"{'comm MB/step out':>18}{'of it transposes':>18}{'of it graphs':>14}"
                f"{'activations MB':>16}"
            ]
            for r in self.ranks:
                per_rank.append(
                    f"{r.rank:<6}{r.rows:>6}{sum(r.halo_rows):>11}{r.recv_bytes / 1e6:>17.3f}"
                    f"{r.send_bytes / 1e6:>18.3f}{r.transpose_bytes / 1e6:>18.3f}"
                    f"{r.graph_bytes / 1e6:>14.3f}{r.activation_bytes / 1e6:>16.2f}"
                )
        most = max(r.activation_bytes for r in self.ranks)
        per_rank.append(
            f"serial activations {self.serial_activation_bytes / 1e6:.2f} MB; the fullest rank "
            f"holds {most / max(self.serial_activation_bytes, 1):.3f} of them"
        )
        if blocks:
            layers = [
                *_halo_table("halo rows per layer (before+after), by latitude index i",
                             self.report.layers, "i"),
                "",
                *_halo_table("halo columns per layer (before+after), by longitude index j",
                             self.across, "j"),
            ]  # fmt: skip
        else:
            layers = _halo_table("halo rows per layer (before+after)", self.report.layers, "r")
        graphs = []
        for (path, route), found in _by_exchange(self.report.graph_exchanges).items():
            cells = "".join(f"{x.received}/{x.sent}".ljust(12) for x in found)
            graphs.append(f"{path:<24.24}{route:<8}{found[0].elements:<10}{cells}")
        if graphs:
            title = f"{'graph':<24}{'route':<8}{'per node':<10}" + "".join(
                f"r{r:<11}" for r in range(self.parts)
            )
            graphs = ["", "graph halo nodes in/out per exchange:", title, *graphs]
        problems = [f"problem: {p}" for p in self.report.problems] or ["no problems"]
        return "\n".join(
            [head, "", *per_rank, "", *layers, *graphs, *self._shapes_text(), "", *problems]
        )

    def _shapes_text(self) -> list[str]:
        """The bytes (halos and transposes) of bands and of every block shape of as many
        ranks, and which moves the fewest."""
        if not self.shapes and not self.unpriced:
            return []
        lines = [
            "",
            f"bands or blocks for {self.parts} ranks: MB moved per training step (halos and "
            f"transposes)",
            f"{'grid':<16}{'busiest rank':>14}{'mean rank':>11}",
        ]
        for c in self.shapes:
            name = f"{c.grid[0]} x {c.grid[1]}" + (" (bands)" if c.grid[1] == 1 else "")
            lines.append(f"{name:<16}{c.busiest_bytes / 1e6:>14.3f}{c.mean_bytes / 1e6:>11.3f}")
        lines += [f"not priced: {why}" for why in self.unpriced]
        bands = next((c for c in self.shapes if c.grid[1] == 1), None)
        best = best_blocks(self.shapes)
        if best is not None:
            shape = f"{best.grid[0]} x {best.grid[1]}"
            if bands is None:
                lines.append(f"bands cannot cut this grid over {self.parts} ranks; the best "
                             f"blocks are {shape}")  # fmt: skip
            elif best.busiest_bytes < bands.busiest_bytes:
                ratio = bands.busiest_bytes / max(best.busiest_bytes, 1)
                lines.append(
                    f"blocks {shape} move the fewest bytes: "
                    f"{best.busiest_bytes / 1e6:.3f} MB per step on the busiest rank, "
                    f"{ratio:.2f}x fewer than bands ({self.parts} x 1)"
                )
            elif best.busiest_bytes == bands.busiest_bytes:  # no ratio of equals (0 and 0)
                lines.append(
                    f"bands ({self.parts} x 1) and the best blocks, {shape}, move as many "
                    f"bytes: {bands.busiest_bytes / 1e6:.3f} MB per step on the busiest rank"
                )
            else:
                more = (
                    f"{best.busiest_bytes / bands.busiest_bytes:.2f}x more"
                    if bands.busiest_bytes
                    else f"{best.busiest_bytes / 1e6:.3f} MB"
                )
                lines.append(
                    f"bands ({self.parts} x 1) move the fewest bytes: "
                    f"{bands.busiest_bytes / 1e6:.3f} MB per step on the busiest rank; the best "
                    f"blocks, {shape}, move {more}"
                )
        return lines


def _halo_table(title: str, layers: Sequence[LayerSharding], index: str) -> list[str]:
    """Each layer's halo (before+after) at each rank ``index`` of its axis."""
    n = len(layers[0].rows_in) if layers else 0
    out = [f"{title}:", f"{'layer':<24}{'kind':<18}{'boundary':<12}"]
    out[1] += "".join(f"{index}{r:<6}" for r in range(n))
    for layer in layers:
        cells = "".join(
            f"{max(b, 0)}+{max(a, 0)}".ljust(7)
            for b, a in zip(layer.halo_before, layer.halo_after, strict=True)
        )
        out.append(f"{layer.path:<24.24}{layer.kind:<18.18}{layer.boundary:<12}{cells}")
    return out


def _by_exchange(exchanges: Sequence[GraphExchange]) -> dict[tuple[str, str], list[Any]]:
    """Each graph's exchanges, rank by rank (a graph used by several layers: its first use)."""
    out: dict[tuple[str, str], list[Any]] = {}
    for x in exchanges:
        found = out.setdefault((x.path, x.route), [])
        if all(y.rank != x.rank for y in found):
            found.append(x)
    return out


def _axis_share(
    lay: LayerSharding | None,
    first: LayerSharding,
    shape: torch.Size,
    inside: bool,
    parts: int,
) -> tuple[list[float], bool]:
    """Each rank's share, along one axis of the grid, of a tensor of ``shape`` autograd saved inside
    spatial layer ``lay`` (or after it; None: before the first, ``first``), and whether the
    rank saves its rows extended by their halo (a storage of the layer's own)."""
    if parts == 1:
        return [1.0], False
    d0 = len(first.shape_in) + first.dim_in
    if lay is None:  # before the first spatial layer: the input's rows
        return [n / first.shape_in[d0] for n in first.rows_in], False
    if inside and lay.modes:
        # what a spectral layer saves is its spectra, in the transposed layout: this rank's
        # W modes of every row
        return [k / sum(lay.modes) for k in lay.modes], False
    d_in = len(lay.shape_in) + lay.dim_in
    h_in = lay.shape_in[d_in]
    at = len(shape) + lay.dim_in
    ends = zip(lay.halo_before, lay.halo_after, strict=True)
    pad = [max(0, b) + max(0, a) for b, a in ends]
    length = shape[at] if 0 <= at < len(shape) else -1
    # the layer's input, or (PeriodicConv2d) the input the serial layer padded itself with
    # the rows across the poles: each rank saves its rows and their halo
    padded = not lay.window and h_in < length <= h_in + 2 * max(pad)
    if inside and (length == h_in or padded):
        # the rows a rank's window spans: its band grown by its halos, or shrunk by a negative
        # one (a strided layer's window can start past the band, or be empty)
        spans = zip(lay.rows_in, lay.halo_before, lay.halo_after, strict=True)
        return [max(0, n + b + a) / length for n, b, a in spans], any(pad)
    shares = lay.form.saved_shares(lay) if inside and lay.form else None
    if shares is not None:
        return shares, False
    h_out = lay.shape_out[len(lay.shape_out) + lay.dim_out]
    return [min(n, h_out) / h_out for n in lay.rows_out], False


def _saved_bytes(
    log: SavedLog,
    inputs: list[Any],
    cut: tuple[tuple[LayerSharding, ...], tuple[LayerSharding, ...]],
    grid: tuple[int, int],
    itemsize: int,
) -> tuple[list[int], int]:
    """What autograd saves for the backward pass on each rank of the ``grid`` (row-major),
    and on one process (the serial figure, from the same pass), in bytes: from the dry run's
    forward on meta tensors of the global shape (``log``: every saved tensor and the module
    calls around it), every saved storage counted once (parameters left out), and each rank's
    share of it from the spatial layer it was saved in (or the last one before it), along each
    axis of the grid (``cut``: the layers cut along the latitude and along the longitude): its
    rows (columns) of that layer's input, halo included (a converted layer saves the block it
    extended, a storage of its own), or of its output. bench/memory.py measures the real
    thing."""
    lat, lon = cut
    parts = grid[0] * grid[1]
    by_path = {a.path: (a, b) for a, b in zip(lat, lon, strict=True)}
    args = _meta_inputs(None, inputs, torch.float32)
    lead = next((t for t in args if isinstance(t, torch.Tensor) and t.dim() >= 3), None)
    if lead is None or not lat:
        return [0] * parts, 0
    stack: list[str] = []  # the cut layers running, innermost last
    last: str | None = None  # the last cut layer that ended
    seen: set[Any] = set()
    serial_seen: set[Any] = set()
    totals = [0.0] * parts
    serial = 0
    for event in log:
        if event[0] == "in":
            if event[1] in by_path:
                stack.append(event[1])
            continue
        if event[0] == "out":
            if event[1] in by_path:
                stack.pop()
                last = event[1]
            continue
        _, storage, nbytes, floating, element_size, shape = event
        key: Any = storage._cdata
        if floating:
            nbytes = nbytes * itemsize // element_size
        if key not in serial_seen:  # one process: every storage once, whole
            serial_seen.add(key)
            serial += nbytes
        inside = bool(stack)
        path = stack[-1] if inside else last
        a, b = by_path[path] if path is not None else (None, None)
        rows, ext_rows = _axis_share(a, lat[0], shape, inside, grid[0])
        cols, ext_cols = _axis_share(b, lon[0], shape, inside, grid[1])
        if (ext_rows or ext_cols) and path is not None:  # the layer's own extended block
            key = (key, path)
        if key in seen:
            continue
        seen.add(key)
        for i, share_i in enumerate(rows):
            for j, share_j in enumerate(cols):
                totals[i * grid[1] + j] += nbytes * share_i * share_j
    return [round(v) for v in totals], serial


def plan_model(
    model: nn.Module,
    global_shape: Sequence[int],
    parts: int | tuple[int, int],
    *,
    partition: PartitionPolicy | None = None,
    dtype: torch.dtype = torch.float32,
    shard_dim: int = -2,
    extra_inputs: Sequence[Any] = (),
    progress: Callable[[str], None] | None = None,
    input_dim: int | None = None,
    simulate: bool = True,
    compare: bool = True,
) -> ModelPlan:
    """Price a domain-parallel run of ``model`` (serial or converted) on inputs of
    ``global_shape`` ((B, C, H, W) or (B, C, T, H, W)), plus ``extra_inputs`` for a forward
    that takes several (tensors or shapes), cut over ``parts`` ranks by ``partition`` (default
    balanced): an int P (latitude bands, the grid ``(P, 1)``) or a ``(P_lat, P_lon)`` pair
    (blocks, rank ``i_lat * P_lon + i_lon``; the latitude cut is the one the dry run checks,
    the longitude cut is priced from each layer's halo geometry along it). ``compare``: also
    price the bytes (halos and transposes) of every other grid of as many ranks
    (:func:`compare_shapes`).
    ``progress`` is called with the name of each of its stages as it begins (``mpidp plan``
    shows them on big models); ``input_dim`` and ``simulate`` as for
    :func:`~mpidp.validate_sharding_constraints`. Local: no communication, no data."""
    grid = grid_shape(parts, 0, 0)  # 0: no world to divide
    count = grid[0] * grid[1]
    policy = partition if partition is not None else Balanced()
    if progress is not None:
        progress("checking how each layer cuts")
    report, saves = _validate(
        model, None, None, grid[0], policy, shard_dim, [tuple(global_shape), *extra_inputs],
        input_dim, simulate, saves=True,
    )  # fmt: skip
    itemsize = torch.empty((), dtype=dtype).element_size()
    refused = None
    if report.graph_exchanges:
        refused = "the model's graphs exchange nodes, not priced on blocks; price its bands"
    if grid[1] > 1 and refused:
        raise ConfigError(f"pricing {grid[0]} x {grid[1]} blocks: {refused}")
    lat, lon, problems = _cut(model, report.layers, grid, policy, shard_dim)
    if grid[1] > 1:  # a run refuses band code on blocks: say which layers, priced all the same
        problems += [
            f"{a.path} ({a.kind}): its converted form {a.form.__name__} runs on bands only "
            f"today (a grid that cuts the longitude is refused); priced as blocks would move it"
            for a in lat
            if a.form is not None and not a.form.on_blocks
        ]
    report = dataclasses.replace(report, layers=lat, problems=(*report.problems, *problems))
    inputs = [tuple(global_shape), *extra_inputs]
    if progress is not None:
        progress("counting the activation memory")
    saved, serial = _saved_bytes(saves, inputs, (lat, lon), grid, itemsize)
    recv, send = _halo_bytes(lat, lon, grid, itemsize)
    transposes = transpose_bytes(lat, lon, grid, itemsize, policy)
    ranks = []
    w_dim = len(global_shape) + shard_dim + 1
    for d in range(count):
        i, j = divmod(d, grid[1])
        moved = transposes[d]
        graph = got = 0
        for x in report.graph_exchanges:
            if x.rank == i:
                graph += (x.sent + x.sent_back) * x.elements * itemsize
                got += (x.received + x.received_back) * x.elements * itemsize
        rows = lat[0].rows_in[i] if lat else policy.spec(global_shape[shard_dim], grid[0])[i]
        if lon:
            cols = lon[0].rows_in[j]
        elif grid[1] == 1:  # bands: every column (a per-rank policy has no 1-rank form)
            cols = global_shape[w_dim]
        else:
            cols = policy.spec(global_shape[w_dim], grid[1])[j]
        halo = tuple(max(0, a.halo_before[i]) + max(0, a.halo_after[i]) for a in lat)
        halo_cols = tuple(max(0, b.halo_before[j]) + max(0, b.halo_after[j]) for b in lon)
        ranks.append(
            RankCost(
                d, rows, halo, recv[d] + moved + got, send[d] + moved + graph, saved[d],
                moved, graph, cols, halo_cols,
            )
        )  # fmt: skip
    name = f"weighted {list(policy.weights)}" if isinstance(policy, Weighted) else "balanced"
    shapes: list[ShapeCost] = []
    why: list[str] = []
    if compare and count > 1 and refused:
        why = [refused]
    elif compare and count > 1 and not isinstance(policy, Balanced):
        why = [f"other grids: grids are compared under balanced cuts only (this one is {name})"]
    elif compare and count > 1:
        shapes, why = compare_shapes(
            model, report.layers, global_shape, count, policy, itemsize, shard_dim
        )
    return ModelPlan(
        tuple(global_shape), count, name, itemsize, report, tuple(ranks), serial,
        grid, lon, tuple(shapes), tuple(why),
    )  # fmt: skip


def build_model(name: str, channels: int, grid: tuple[int, int]) -> nn.Module:
    """An example model by name (:data:`EXAMPLE_MODELS`), or ``module:factory`` (a Python path
    to a callable returning a module; called with whichever of ``in_channels``,
    ``out_channels``, ``channels`` and ``grid`` it accepts)."""
    if name in EXAMPLE_MODELS:
        try:
            return EXAMPLE_MODELS[name](channels, grid)
        except ValueError as err:  # a grid the example cannot take (patches that do not fit)
            rows, cols = (n - n % 8 for n in grid)
            raise ConfigError(
                f"model {name!r} cannot be built for a {grid[0]} x {grid[1]} grid with "
                f"{channels} channels: {err}; pass a grid it takes (the patch models cut it "
                f"into 4- or 8-point patches: {rows}x{cols} drops the rows and columns past "
                f"a multiple of 8, as ERA5's 721 rows become 720 without the south pole row), "
                f"or another model (unet and fno take any grid)"
            ) from err
    if ":" not in name:
        raise ConfigError(
            f"model {name!r}: use one of {', '.join(EXAMPLE_MODELS)} or 'module:factory'"
        )
    module_name, attr = name.split(":", 1)
    try:
        factory = importlib.import_module(module_name)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"model {name!r}: cannot import it ({err}); check the path") from err
    offered = {"in_channels": channels, "out_channels": channels, "channels": channels}
    offered["grid"] = grid  # type: ignore[assignment]
    try:
        params = inspect.signature(factory).parameters  # type: ignore[arg-type]
        kwargs = {k: v for k, v in offered.items() if k in params}
    except (TypeError, ValueError):
        kwargs = {}
    model = factory(**kwargs)  # type: ignore[operator]
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model {name!r} returned {type(model).__name__}, not a torch module")
    return model


def parse_partition(text: str, parts: int | tuple[int, int]) -> PartitionPolicy:
    """``balanced`` or ``weighted:2,1,1,1`` (one weight per rank of bands; blocks, a
    ``(P_lat, P_lon)`` pair, are cut balanced)."""
    if text == "balanced":
        return Balanced()
    if not isinstance(parts, int):
        raise ConfigError(
            f"partition {text!r} on {parts[0]} x {parts[1]} blocks: weights are one per rank of "
            f"latitude bands; blocks are priced balanced"
        )
    if text.startswith("weighted:"):
        try:
            weights = [float(w) for w in text.split(":", 1)[1].split(",")]
        except ValueError as err:
            raise ConfigError(f"partition {text!r}: weights must be numbers") from err
        if len(weights) != parts:
            raise ConfigError(
                f"partition {text!r}: {len(weights)} weights for {parts} ranks; give one per rank"
            )
        return Weighted(tuple(weights))
    raise ConfigError(f"partition {text!r}: use 'balanced' or 'weighted:w0,w1,...'")


def to_json(result: ModelPlan) -> str:
    return json.dumps(result.as_dict(), indent=1)
