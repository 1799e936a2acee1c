"""A dry run of a model's sharding by shape arithmetic, before any data moves.

The model runs once on a meta tensor of the global shape (no memory, no communication: every
domain-parallel layer takes its torch path), with hooks that record each spatial layer's input
and output extent along the sharded dim. From those, per layer: the rows every rank owns in and
out, the halo rows each rank fetches, and the problems that would stop (or silently distort) a
run at this domain size.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mpidp.errors import ConfigError
from mpidp.graph.module import Graph, GraphExchange, dry_graphs
from mpidp.layers import base
from mpidp.layers.registry import layer_for
from mpidp.parallel.convert import convert_to_domain_parallel
from mpidp.preflight.audit import OpRecorder, where_error
from mpidp.runtime.manager import DistributedManager, get_manager
from mpidp.runtime.partition import PartitionPolicy, ShardSpec

__all__ = ["LayerSharding", "ShardingReport", "validate_sharding_constraints"]


def _form(module: nn.Module) -> Any:
    """The band form registered for ``module``'s type when it is a spatial layer the dry run
    lists (its ``dry_run``; it also says what it reads: layers/base.DomainParallel)."""
    found = layer_for(type(module))
    return found[1] if found is not None and found[1].dry_run else None


def _whole_when_short(module: nn.Module) -> bool:
    """Whether an output of fewer rows than ranks is the whole result on every rank."""
    form = _form(module)
    return form is not None and form.whole_when_short


def _dims(module: nn.Module, shard_dim: int) -> tuple[int, int]:
    """The sharded dim of ``module``'s input and output (one more from the end for
    channels-last tokens, as its band form says)."""
    form = _form(module)
    if form is None:
        return shard_dim, shard_dim
    return (
        shard_dim - 1 if form.channels_last_in else shard_dim,
        shard_dim - 1 if form.channels_last_out else shard_dim,
    )


@dataclasses.dataclass(frozen=True)
class LayerSharding:
    """One spatial layer: its path and type, rows in and out per rank, halo widths per rank."""

    path: str
    kind: str
    rows_in: tuple[int, ...]
    rows_out: tuple[int, ...]
    halo_before: tuple[int, ...]
    halo_after: tuple[int, ...]
    #: what fills rows beyond the field (a :class:`~mpidp.Boundary` kind; "none": never read)
    boundary: str = "none"
    #: the layer's global input and output shapes in the dry run
    shape_in: tuple[int, ...] = ()
    shape_out: tuple[int, ...] = ()
    #: the sharded dim of the input and of the output (counted from the end)
    dim_in: int = -2
    dim_out: int = -2
    #: a spectral layer (rfft2 and irfft2 through mpidp.ops.fft): its W modes per rank
    modes: tuple[int, ...] = ()
    #: windowed attention: (window rows, shift) along the sharded dim
    window: tuple[int, ...] = ()
    #: the band form of the layer's module type when it prices its own transposes
    #: (layers/base.DomainParallel.transpose_bytes), None for torch's layers
    form: Any = dataclasses.field(default=None, compare=False, repr=False)

    def row_elements(self, which: str = "in") -> int:
        """Elements of one row along the sharded dim of the input (``"in"``) or output."""
        shape = self.shape_in if which == "in" else self.shape_out
        d = len(shape) + (self.dim_in if which == "in" else self.dim_out)
        return math.prod(n for i, n in enumerate(shape) if i != d)

    @property
    def halo_rows(self) -> int:
        """Rows fetched from other ranks or the boundary, summed over ranks."""
        return sum(
            max(0, b) + max(0, a) for b, a in zip(self.halo_before, self.halo_after, strict=True)
        )


@dataclasses.dataclass(frozen=True)
class ShardingReport:
    """What :func:`validate_sharding_constraints` found; ``ok`` when there are no problems."""

    parts: int
    layers: tuple[LayerSharding, ...]
    problems: tuple[str, ...]
    #: every halo exchange of the model's graphs in each rank's forward (mpidp.graph)
    graph_exchanges: tuple[GraphExchange, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        lines = [f"{'layer':<28}{'kind':<22}{'rows in':<22}{'rows out':<22}halo (before/after)"]
        for layer in self.layers:
            halo = ",".join(
                f"{b}/{a}" for b, a in zip(layer.halo_before, layer.halo_after, strict=True)
            )
            lines.append(
                f"{layer.path:<28}{layer.kind:<22}{_rows(layer.rows_in):<22}"
                f"{_rows(layer.rows_out):<22}{halo}"
            )
        lines += [f"problem: {p}" for p in self.problems] or ["no problems"]
        return "\n".join(lines)


def _rows(sizes: Sequence[int]) -> str:
    return ",".join(map(str, sizes))


def _layer(module: nn.Module) -> Any:
    """The band form registered for ``module``'s type (it answers the dry run's questions:
    mpidp.layers.base.DomainParallel), or None."""
    found = layer_for(type(module))
    return found[1] if found is not None else None


def _geometry(module: nn.Module, k: int) -> tuple[int, int, tuple[int, int], int] | None:
    """(kernel, stride, padding pair, dilation) along spatial axis ``k``, for window layers."""
    form = _layer(module)
    return form.geometry(module, k) if form is not None else None


def _window_halo(
    module: nn.Module, spec_in: ShardSpec, spec_out: ShardSpec, k: int, n_in: int, n_spatial: int
) -> tuple[tuple[int, ...], tuple[int, ...], str] | None:
    """(before, after, boundary) of the rows a layer fetches along spatial axis ``k``, for the
    layers whose domain-parallel forward fetches rows; None for the others."""
    form = _layer(module)
    if form is None:
        return None
    return form.halo_of(module, spec_in, spec_out, k, n_in, n_spatial)


def _meta_inputs(
    global_shape: Sequence[int] | None,
    example_inputs: Sequence[Any] | None,
    dtype: torch.dtype,
) -> list[Any]:
    """Meta tensors shaped like the inputs: ``example_inputs`` (tensors or shapes; anything
    else passed as it is) or one input of ``global_shape``."""
    if example_inputs is None:
        if global_shape is None:
            raise ConfigError("validate_sharding_constraints: pass global_shape or example_inputs")
        example_inputs = [tuple(global_shape)]
    out: list[Any] = []
    for item in example_inputs:
        if isinstance(item, torch.Tensor):
            out.append(torch.empty(item.shape, dtype=item.dtype, device="meta"))
        elif isinstance(item, Sequence) and all(isinstance(v, int) for v in item):
            out.append(torch.empty(tuple(item), dtype=dtype, device="meta"))
        else:
            out.append(item)
    return out


def _banded(module: nn.Module) -> bool:
    """A layer the band run replaces by its band arithmetic."""
    return isinstance(module, base.DomainParallel) or _form(module) is not None


def _leaf(module: nn.Module) -> bool:
    """A module whose ``forward`` the op audit does not look into: converted layers, torch's
    modules but its containers, and modules without children (the probe judges those)."""
    if _banded(module) or not any(True for _ in module.children()):
        return True
    containers = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
    return type(module).__module__.startswith("torch.") and not isinstance(module, containers)


def _sharded_like(x: Any, h: int, dim: int) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() >= 3 and x.shape[dim] == h


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, list | tuple):
        return [t for item in out for t in _tensors(item)]
    return []


def _band_layer(
    module: nn.Module,
    path: str,
    queue: list[tuple[torch.Size, torch.Size, torch.dtype]],
    rank: int,
    parts: int,
    partition: PartitionPolicy,
    shard_dim: int,
) -> Any:
    """A converted layer's forward in the band run: checks that it gets ``rank``'s rows of
    its global input and returns the rows of its global output that the layer gives it."""

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        g_in, g_out, dtype = queue.pop(0)
        dim_in, dim_out = _dims(module, shard_dim)
        d, e = len(g_in) + dim_in, len(g_out) + dim_out
        # fewer rows than ranks: a replicated input (after a global pool), whole on every rank
        replicated = g_in[d] < parts
        want = g_in[d] if replicated else partition.spec(g_in[d], parts).sizes[rank]
        got = args[0].shape[d]
        if got != want:
            raise _BandMismatch(
                f"{path} ({type(module).__name__}) gets {got} rows on rank {rank}; its "
                f"input of {g_in[d]} rows puts {want} on that rank"
            )
        rows = g_out[e]
        if not replicated and not (_whole_when_short(module) and rows < parts):
            rows = partition.derived(rows, parts).sizes[rank]
        shape = list(g_out)
        shape[e] = rows
        return torch.empty(shape, dtype=dtype, device="meta")

    return forward


def _band_runs(
    meta: nn.Module,
    inputs: list[Any],
    out_global: Any,
    calls: dict[nn.Module, list[tuple[torch.Size, torch.Size, torch.dtype]]],
    reference: list[list[tuple[int, ...]]],
    parts: int,
    partition: PartitionPolicy,
    shard_dim: int,
    graphs: dict[str, Graph],
    exchanges: list[GraphExchange],
) -> list[str]:
    """Every rank's forward on its band, in this process, on meta tensors: each converted
    layer replaced by the rows it gives that rank, each graph by that rank's shard of it (its
    halo exchanges logged in ``exchanges``), the model's own code run as it is. The
    first op that fails (with its line), an output that is not the rank's band, and the ops of
    the model's own code that mix rows of the sharded dim."""
    first = next((t for t in inputs if isinstance(t, torch.Tensor) and t.dim() >= 3), None)
    if first is None:
        return []
    h = first.shape[shard_dim]
    problems: list[str] = []
    findings: dict[str, str] = {}
    for rank in range(parts):
        try:
            spec = partition.spec(h, parts)
        except Exception:  # the global checks say why
            return problems
        queues = {m: list(v) for m, v in calls.items()}

        band = [
            torch.empty(
                (
                    *t.shape[: t.dim() + shard_dim],
                    spec.sizes[rank],
                    *t.shape[t.dim() + shard_dim + 1 :],
                ),
                dtype=t.dtype,
                device="meta",
            )
            if _sharded_like(t, h, shard_dim)
            else t
            for t in inputs
        ]
        recorder = OpRecorder(reference)
        names = {m: p for p, m in meta.named_modules()}
        for module in calls:
            module.forward = _band_layer(
                module, names.get(module, "?"), queues[module], rank, parts, partition, shard_dim
            )
        lo, hi = spec.offsets[rank], spec.offsets[rank] + spec.sizes[rank]
        at = f"rank {rank} (rows {lo}-{hi} of {h})"
        failure = None
        try:
            rows = functools.partial(partition.spec, parts=parts)
            with (
                base.torch_path(),
                dry_graphs(meta, graphs, rank, rows, exchanges),
                recorder.watching(meta, _leaf),
            ):
                out = meta(*band)
        except _BandMismatch as err:
            failure = f"{at}: {err}, from {where_error(err)}"
        except Exception as err:
            failure = (
                f"{at}: the model's forward fails on its band at {where_error(err)}: "
                f"{type(err).__name__}: {err}"
            )
        finally:
            for module in calls:
                del module.forward
        for finding in recorder.findings:
            findings.setdefault(finding.line, str(finding))
        if failure is None:
            failure = _output_band(out, out_global, at, rank, parts, partition, shard_dim)
        if failure is not None:  # the first rank that fails says it; the others would repeat
            problems.append(failure)
            break
    return problems + list(findings.values())


def _output_band(
    out: Any,
    out_global: Any,
    at: str,
    rank: int,
    parts: int,
    partition: PartitionPolicy,
    shard_dim: int,
) -> str | None:
    """Why the band run's result is not ``rank``'s band of the global run's, or None."""
    for got, want in zip(_tensors(out), _tensors(out_global), strict=False):
        if got.dim() != want.dim() or got.dim() < 3:
            continue
        e = want.dim() + shard_dim
        shape = list(want.shape)
        shape[e] = partition.derived(want.shape[e], parts).sizes[rank]
        if list(got.shape) != shape:
            return (
                f"{at}: the output is {tuple(got.shape)}, its band of the {tuple(want.shape)} "
                f"result is {tuple(shape)}: the model's own code works on global sizes"
            )
    return None


class _BandMismatch(Exception):
    pass


def validate_sharding_constraints(
    model: nn.Module,
    global_shape: Sequence[int] | None = None,
    manager: DistributedManager | None = None,
    *,
    parts: int | None = None,
    partition: PartitionPolicy | None = None,
    shard_dim: int = -2,
    example_inputs: Sequence[Any] | None = None,
) -> ShardingReport:
    """Check, by shape arithmetic, how ``model`` (serial or converted) shards an input of
    ``global_shape`` over ``parts`` domain ranks (default: the manager's domain size) cut by
    ``partition`` (default: the manager's policy). ``example_inputs`` instead: every input of a
    model whose ``forward`` takes several (tensors or shapes, global; 4-D and 5-D), also what
    the probe of unknown modules runs on. Local: no communication, no data."""
    if parts is None or partition is None:
        m = manager or get_manager()
        parts = parts if parts is not None else m.domain_world_size
        partition = partition if partition is not None else m.partition
    seen: list[tuple[str, nn.Module, torch.Size, torch.Size]] = []
    meta = copy.deepcopy(model).to("meta")
    first = next(iter(meta.parameters()), None)
    inputs = _meta_inputs(
        global_shape, example_inputs, first.dtype if first is not None else torch.float32
    )
    hooks = []
    calls: dict[nn.Module, list[tuple[torch.Size, torch.Size, torch.dtype]]] = {}
    for path, module in meta.named_modules():
        if _banded(module):

            def record(mod: nn.Module, args: tuple, out: Any, path: str = path) -> None:
                if isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
                    calls.setdefault(mod, []).append((args[0].shape, out.shape, out.dtype))
                    if _form(mod) is not None:
                        seen.append((path, mod, args[0].shape, out.shape))

            hooks.append(module.register_forward_hook(record))
    problems: list[str] = []
    try:  # what conversion would refuse (pure: nothing moves)
        convert_to_domain_parallel(copy.deepcopy(model), shard_dim=shard_dim, example_inputs=inputs)
    except ConfigError as err:
        problems.append(str(err))
    recorder = OpRecorder()
    exchanges: list[GraphExchange] = []
    out_global: Any = None
    with base.torch_path():
        try:
            with recorder.watching(meta, _leaf):
                out_global = meta(*inputs)
        except Exception as err:  # the serial model itself rejects the shapes
            shapes = ", ".join(str(tuple(t.shape)) for t in inputs if isinstance(t, torch.Tensor))
            problems.append(f"the model does not run on {shapes}: {err}")
        finally:
            for hook in hooks:
                hook.remove()
    if out_global is not None and parts > 1:
        graphs = {p: m for p, m in model.named_modules() if isinstance(m, Graph)}
        problems += _band_runs(
            meta,
            inputs,
            out_global,
            calls,
            recorder.calls,
            parts,
            partition,
            shard_dim,
            graphs,
            exchanges,
        )
    layers = []
    for path, module, shape_in, shape_out in seen:
        dim_in, dim_out = _dims(module, shard_dim)
        form = _form(module)
        d = len(shape_in) + dim_in
        h_in, h_out = shape_in[d], shape_out[len(shape_out) + dim_out]
        kind = type(module).__name__
        geo = _geometry(module, d - 2) if d >= 2 else None
        pointwise = geo is not None and geo[:3] == (1, 1, (0, 0)) and h_out == h_in
        try:
            spec_in = partition.spec(h_in, parts) if h_in >= parts else None
            if (_whole_when_short(module) and h_out < parts) or (h_in < parts and pointwise):
                # fewer output rows than ranks: the whole result, replicated on every rank
                layers.append(
                    LayerSharding(
                        path,
                        kind,
                        spec_in.sizes if spec_in is not None else (h_in,) * parts,
                        (h_out,) * parts,
                        (0,) * parts,
                        (0,) * parts,
                        "replicated",
                        tuple(shape_in),
                        tuple(shape_out),
                        dim_in,
                        dim_out,
                    )
                )
                continue
            spec_in = partition.spec(h_in, parts)
            spec_out = partition.derived(h_out, parts)
        except Exception as err:
            problems.append(f"{path} ({kind}): {err}")
            continue
        k = d - 2
        if geo is not None:
            mode = getattr(module, "padding_mode", getattr(module, "pole", "zeros"))
            if mode in ("reflect", "polar") and max(geo[2]) >= h_in:
                problems.append(f"{path} ({kind}): reflect padding {max(geo[2])} >= {h_in} rows")
            if getattr(module, "pole", "").startswith("polar") and shape_in[-1] % 2:
                problems.append(
                    f"{path} ({kind}): polar padding needs an even W, got {shape_in[-1]}"
                )
        n_spatial = len(shape_in) - 2
        halo = _window_halo(module, spec_in, spec_out, k, h_in, n_spatial) if k >= 0 else None
        before, after, boundary = halo or ((0,) * parts, (0,) * parts, "none")
        modes = form.modes_of(module, shape_in, parts, partition) if form is not None else ()
        window = form.window_of(module, d) if form is not None else ()
        layers.append(
            LayerSharding(
                path,
                kind,
                spec_in.sizes,
                spec_out.sizes,
                tuple(before),
                tuple(after),
                boundary,
                tuple(shape_in),
                tuple(shape_out),
                dim_in,
                dim_out,
                modes,
                window,
                form,
            )
        )
    return ShardingReport(parts, tuple(layers), tuple(problems), tuple(exchanges))
