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

Activation memory is what autograd saves for the backward pass on the rank: the model's forward
runs on meta tensors of the global shape with every saved tensor's storage counted once
(parameters left out), and each rank takes its share of each from the spatial layer it was
saved in, or the last one before it: its rows of that layer's input, halo rows included (a
converted layer saves the band it extended, a storage of its own), of its output, or, in a
spectral layer, its W modes (the spectra live in the transposed layout). bench/memory.py
measures the real bytes beside it: the U-Net to 0.05%, AFNO and Swin-style models to 5-11%.
"""

from __future__ import annotations

import copy
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
from mpidp.layers import base
from mpidp.ops.halo_plan import Boundary, plan
from mpidp.preflight.validate import (
    LayerSharding,
    ShardingReport,
    _meta_inputs,
    needs_values,
    validate_sharding_constraints,
)
from mpidp.runtime.partition import Balanced, PartitionPolicy, Weighted

__all__ = [
    "EXAMPLE_MODELS",
    "ModelPlan",
    "RankCost",
    "build_model",
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
        }

    def __str__(self) -> str:
        head = (
            f"mpidp plan: input {'x'.join(map(str, self.shape))} over {self.parts} domain ranks "
            f"({self.partition}), {self.itemsize}-byte values"
        )
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
        ranks = range(self.parts)
        layers = [f"{'layer':<24}{'kind':<18}{'boundary':<12}" + "".join(f"r{r:<6}" for r in ranks)]
        for layer in self.report.layers:
            cells = "".join(
                f"{max(b, 0)}+{max(a, 0)}".ljust(7)
                for b, a in zip(layer.halo_before, layer.halo_after, strict=True)
            )
            layers.append(f"{layer.path:<24.24}{layer.kind:<18.18}{layer.boundary:<12}{cells}")
        graphs = []
        for (path, route), found in _by_exchange(self.report.graph_exchanges).items():
            cells = "".join(f"{x.received}/{x.sent}".ljust(12) for x in found)
            graphs.append(f"{path:<24.24}{route:<8}{found[0].elements:<10}{cells}")
        if graphs:
            title = f"{'graph':<24}{'route':<8}{'per node':<10}" + "".join(
                f"r{r:<11}" for r in ranks
            )
            graphs = ["", "graph halo nodes in/out per exchange:", title, *graphs]
        problems = [f"problem: {p}" for p in self.report.problems] or ["no problems"]
        return "\n".join(
            [
                head,
                "",
                *per_rank,
                "",
                "halo rows per layer (before+after):",
                *layers,
                *graphs,
                "",
                *problems,
            ]
        )


def _by_exchange(exchanges: Sequence[GraphExchange]) -> dict[tuple[str, str], list[Any]]:
    """Each graph's exchanges, rank by rank (a graph used by several layers: its first use)."""
    out: dict[tuple[str, str], list[Any]] = {}
    for x in exchanges:
        found = out.setdefault((x.path, x.route), [])
        if all(y.rank != x.rank for y in found):
            found.append(x)
    return out


def _spatial_elements(shape: tuple[int, ...], d: int) -> int:
    """Elements of one row of ``shape`` along dim ``d`` (every other dim multiplied)."""
    out = 1
    for i, n in enumerate(shape):
        if i != d:
            out *= n
    return out


def _recv_send(layer: LayerSharding, rank: int) -> tuple[int, int]:
    """Rows this rank receives from and sends to other ranks in the layer's forward fetch."""
    if not any(layer.halo_before) and not any(layer.halo_after):
        return 0, 0
    p = plan(
        layer.rows_in,
        layer.halo_before,
        layer.halo_after,
        Boundary.of(layer.boundary, -1),
        rank,
    )
    return sum(hi - lo for _, lo, hi in p.recv), sum(hi - lo for _, lo, hi in p.send)


def _moved_bytes(layer: LayerSharding, rank: int, itemsize: int) -> int:
    """Bytes one rank sends (= receives, summed over a step) in a layer's transposes: a
    spectral layer's rfft2 and irfft2 all-to-alls (complex values; forward and backward), and
    a patch head's move of its pixel rows to the policy's cut."""
    return 0 if layer.form is None else layer.form.transpose_bytes(layer, rank, itemsize)


def _saved_bytes(
    model: nn.Module,
    inputs: list[Any],
    report: ShardingReport,
    parts: int,
    itemsize: int,
) -> tuple[list[int], int]:
    """What autograd saves for the backward pass on each rank, and on one process (the serial
    figure, from the same pass), in bytes: the model's forward
    on meta tensors of the global shape, every saved tensor's storage counted once (parameters
    left out), and each rank's share of it from the spatial layer it was saved in (or the last
    one before it): its rows of that layer's input, halo rows included (a converted layer saves
    the band it extended, a storage of its own), or of its output. bench/memory.py measures
    the real thing."""
    layers = {lay.path: lay for lay in report.layers}
    meta = copy.deepcopy(model).to("meta")
    first = next(iter(meta.parameters()), None)
    args = _meta_inputs(None, inputs, first.dtype if first is not None else torch.float32)
    lead = next((t for t in args if isinstance(t, torch.Tensor) and t.dim() >= 3), None)
    if lead is None or not report.layers:
        return [0] * parts, 0
    stack: list[LayerSharding] = []
    last: list[LayerSharding | None] = [None]
    hooks = []
    for path, module in meta.named_modules():
        if path in layers:
            lay = layers[path]
            hooks.append(module.register_forward_pre_hook(lambda *_, lay=lay: stack.append(lay)))

            def done(*_: Any, lay: LayerSharding = lay) -> None:
                stack.pop()
                last[0] = lay

            hooks.append(module.register_forward_hook(done))
    first_layer = report.layers[0]
    h0 = first_layer.shape_in[len(first_layer.shape_in) + first_layer.dim_in]
    ours = {p.untyped_storage()._cdata for p in meta.parameters()}
    ours |= {b.untyped_storage()._cdata for b in meta.buffers()}
    seen: set[Any] = set()
    serial_seen: set[Any] = set()
    totals = [0.0] * parts
    serial = [0]

    def share(lay: LayerSharding | None, t: torch.Tensor, inside: bool) -> tuple[list[float], bool]:
        if lay is None:  # before the first spatial layer: the input's rows
            rows = first_layer.rows_in if parts > 1 else (h0,)
            return [n / h0 for n in rows], False
        if inside and parts > 1 and lay.modes:
            # what a spectral layer saves is its spectra, in the transposed layout: this rank's
            # W modes of every row
            return [k / sum(lay.modes) for k in lay.modes], False
        d_in = len(lay.shape_in) + lay.dim_in
        h_in = lay.shape_in[d_in]
        at = t.dim() + lay.dim_in
        ends = zip(lay.halo_before, lay.halo_after, strict=True)
        pad = [max(0, b) + max(0, a) for b, a in ends]
        length = t.shape[at] if 0 <= at < t.dim() else -1
        # the layer's input, or (PeriodicConv2d) the input the serial layer padded itself with
        # the rows across the poles: each rank saves its rows and their halo
        padded = not lay.window and h_in < length <= h_in + 2 * max(pad)
        if inside and parts > 1 and (length == h_in or padded):
            return [(n + e) / length for n, e in zip(lay.rows_in, pad, strict=True)], any(pad)
        shares = lay.form.saved_shares(lay) if inside and parts > 1 and lay.form else None
        if shares is not None:
            return shares, False
        h_out = lay.shape_out[len(lay.shape_out) + lay.dim_out]
        rows_out = lay.rows_out if parts > 1 else (h_out,)
        return [min(n, h_out) / h_out for n in rows_out], False

    def pack(t: torch.Tensor) -> torch.Tensor:
        key: Any = t.untyped_storage()._cdata
        if key in ours:
            return t
        nbytes = t.untyped_storage().nbytes()
        if t.is_floating_point():
            nbytes = nbytes * itemsize // t.element_size()
        if key not in serial_seen:  # one process: every storage once, whole
            serial_seen.add(key)
            serial[0] += nbytes
        inside = bool(stack)
        lay = stack[-1] if inside else last[0]
        fractions, extended = share(lay, t, inside)
        if extended and lay is not None:  # the converted layer's own extended band
            key = (key, lay.path)
        if key in seen:
            return t
        seen.add(key)
        for r in range(parts):
            totals[r] += nbytes * fractions[r]
        return t

    try:
        with base.torch_path(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            meta(*args)
    except Exception as err:  # what was saved up to there (the report's notes say where)
        if not needs_values(err) and report.ok:
            raise
    finally:
        for hook in hooks:
            hook.remove()
    return [round(v) for v in totals], serial[0]


def plan_model(
    model: nn.Module,
    global_shape: Sequence[int],
    parts: int,
    *,
    partition: PartitionPolicy | None = None,
    dtype: torch.dtype = torch.float32,
    shard_dim: int = -2,
    extra_inputs: Sequence[Any] = (),
    progress: Callable[[str], None] | None = None,
    input_dim: int | None = None,
    simulate: bool = True,
) -> ModelPlan:
    """Price a domain-parallel run of ``model`` (serial or converted) on inputs of
    ``global_shape`` ((B, C, H, W) or (B, C, T, H, W)), plus ``extra_inputs`` for a forward
    that takes several (tensors or shapes), cut over ``parts`` ranks by ``partition`` (default
    balanced). ``progress`` is called with the name of each of its two stages as it begins
    (``mpidp plan`` shows them on big models); ``input_dim`` and ``simulate`` as for
    :func:`~mpidp.validate_sharding_constraints`. Local: no communication, no data."""
    policy = partition if partition is not None else Balanced()
    if progress is not None:
        progress("checking how each layer cuts")
    report = validate_sharding_constraints(
        model,
        parts=parts,
        partition=policy,
        shard_dim=shard_dim,
        example_inputs=[tuple(global_shape), *extra_inputs],
        input_dim=input_dim,
        simulate=simulate,
    )
    itemsize = torch.empty((), dtype=dtype).element_size()
    ranks = []
    inputs = [tuple(global_shape), *extra_inputs]
    if progress is not None:
        progress("counting the activation memory")
    saved, serial = _saved_bytes(model, inputs, report, parts, itemsize)
    for r in range(parts):
        recv = send = moved_all = 0
        for layer in report.layers:
            d_in = len(layer.shape_in) + layer.dim_in
            row_in = _spatial_elements(layer.shape_in, d_in) * itemsize
            rows_recv, rows_send = _recv_send(layer, r)
            # forward: receive rows_recv, send rows_send; backward: the adjoint, reversed
            recv += (rows_recv + rows_send) * row_in
            send += (rows_send + rows_recv) * row_in
            moved = _moved_bytes(layer, r, itemsize)
            recv += moved
            send += moved
            moved_all += moved
        graph = 0
        for x in report.graph_exchanges:
            if x.rank == r:
                graph += (x.sent + x.sent_back) * x.elements * itemsize
                recv += (x.received + x.received_back) * x.elements * itemsize
        send += graph
        if report.layers:
            rows = report.layers[0].rows_in[r]
        else:
            rows = policy.spec(global_shape[shard_dim], parts)[r]
        halo = tuple(
            max(0, lay.halo_before[r]) + max(0, lay.halo_after[r]) for lay in report.layers
        )
        ranks.append(RankCost(r, rows, halo, recv, send, saved[r], moved_all, graph))
    name = f"weighted {list(policy.weights)}" if isinstance(policy, Weighted) else "balanced"
    return ModelPlan(tuple(global_shape), parts, name, itemsize, report, tuple(ranks), serial)


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


def parse_partition(text: str, parts: int) -> PartitionPolicy:
    """``balanced`` or ``weighted:2,1,1,1`` (one weight per rank)."""
    if text == "balanced":
        return Balanced()
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
