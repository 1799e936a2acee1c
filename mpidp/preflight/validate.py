"""A dry run of a model's sharding before any data moves: its layers' rows and halos, and
what a run on bands would refuse.

Two passes, no communication, no data. The model runs once on meta tensors of the global shape
(every domain-parallel layer takes its torch path), with hooks that record each spatial
layer's input and output extent along the sharded dim; from those and the layer's band form
(its pre-flight class methods, mpidp.layers.base.DomainParallel), per layer: the rows every
rank owns in and out, the halo rows each rank fetches, and the problems of the shapes. Then
every rank's forward of the converted model runs in turn in this process, on meta
ShardedTensors over a simulated rank (:func:`mpidp.preflight.explain.simulate`): the engine
of a real run, so its first refusal is the real run's, and each graph's halo exchanges are
logged for ``mpidp plan``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import traceback
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mpidp.errors import ConfigError
from mpidp.graph.module import Graph, GraphExchange, logging_exchanges
from mpidp.layers import base
from mpidp.layers.registry import layer_for
from mpidp.parallel.convert import convert_to_domain_parallel, first_shapes, shapes_seen
from mpidp.preflight.explain import simulate
from mpidp.runtime.manager import DistributedManager, get_manager
from mpidp.runtime.partition import PartitionPolicy, ShardSpec

__all__ = ["LayerSharding", "ShardingReport", "validate_sharding_constraints"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_MPIDP_DIR = os.path.dirname(os.path.dirname(__file__))  # the package


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
    #: the points of the layer's window (a 3x3 conv: 9; 1 for layers without one)
    kernel: int = 1

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
    #: where the dry run could not look (an op that needs tensor values): not problems
    notes: tuple[str, ...] = ()

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
        lines += [f"note: {n}" for n in self.notes]
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


def _simulated(
    converted: nn.Module,
    inputs: list[Any],
    parts: int,
    partition: PartitionPolicy,
    shard_dim: int,
    exchanges: list[GraphExchange],
) -> tuple[list[str], list[str]]:
    """Every rank's forward of ``converted`` on meta ShardedTensors, in turn in this process
    (:func:`~mpidp.preflight.explain.simulate`, the engine of a real run): its first refusal
    (op, module path, fix), or the error the model's own code raises, and where the run
    stopped short (a call that needs tensor values: a note); each graph's halo exchanges
    logged in ``exchanges``."""
    if not any(isinstance(t, torch.Tensor) and t.dim() >= 1 - shard_dim for t in inputs):
        return [], []  # nothing to cut: the first check says why
    paths: dict[int, str] = {}

    def make() -> nn.Module:
        model = copy.deepcopy(converted)
        paths.update({id(g): p for p, g in model.named_modules() if isinstance(g, Graph)})
        return model

    try:
        with logging_exchanges(paths, exchanges):
            run = simulate(
                make, *inputs, parts=parts, dim=shard_dim, partition=partition, bands=True
            )
    except ConfigError as err:  # the input itself cannot be cut (the data's partition)
        return [f"the inputs cut along dim {shard_dim} over {parts} ranks: {err}"], []
    except Exception as err:  # the model's own code fails on bands
        failed = f"the model's forward fails on bands of {parts} ranks at {_where(err)}"
        return [f"{failed}: {type(err).__name__}: {err}"], []
    return [run.refused] if run.refused else [], [run.stopped] if run.stopped else []


def needs_values(err: BaseException) -> bool:
    """Whether ``err`` is a meta run's limit, not the model's: an op that needs tensor values
    (``.item()``, a data-dependent shape) or a tensor the model's code made on a device."""
    text = str(err)
    return isinstance(err, NotImplementedError) or (
        isinstance(err, RuntimeError) and ("meta" in text or "data-dependent" in text)
    )


def _values(err: BaseException) -> str:
    first = (str(err).splitlines() or [""])[0]
    return f"it needs tensor values or devices ({type(err).__name__} at {_where(err)}: {first})"


def _where(err: BaseException) -> str:
    """The innermost line of ``err``'s traceback outside torch and mpidp (the model's code)."""
    frames = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if not f.filename.startswith((_TORCH_DIR, _MPIDP_DIR))
    ]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} `{(f.line or '').strip()}`"


def validate_sharding_constraints(
    model: nn.Module,
    global_shape: Sequence[int] | None = None,
    manager: DistributedManager | None = None,
    *,
    parts: int | None = None,
    partition: PartitionPolicy | None = None,
    shard_dim: int = -2,
    example_inputs: Sequence[Any] | None = None,
    input_dim: int | None = None,
    simulate: bool = True,
) -> ShardingReport:
    """Check, by shape arithmetic, how ``model`` (serial or converted) shards an input of
    ``global_shape`` over ``parts`` domain ranks (default: the manager's domain size) cut by
    ``partition`` (default: the manager's policy). ``example_inputs`` instead: every input of a
    model whose ``forward`` takes several (tensors or shapes, global; 4-D and 5-D), also what
    the probe of unknown modules runs on. ``shard_dim`` is the layers' sharded dim (from the end
    of 4-D/5-D activations); ``input_dim`` the inputs' when it differs (channels-last inputs,
    as for :func:`~mpidp.convert_to_domain_parallel`). ``simulate=False``: the layer table
    alone, without the simulated ranks' run (no check of the model's own code: what prices a
    model at many rank counts, ``mpidp plan --scaling``). Local: no communication, no data."""
    report, _ = _validate(
        model, global_shape, manager, parts, partition, shard_dim, example_inputs, input_dim,
        simulate, saves=False,
    )  # fmt: skip
    return report


#: what the dry run's one serial forward logged for ``mpidp plan``'s activation memory, in
#: order: ``("in", path)`` and ``("out", path)`` as each module's call starts and ends, and
#: ``("save", storage, nbytes, floating, element_size, shape)`` for each tensor autograd saved
#: (parameters and buffers left out; the storage kept, so that one freed during the forward
#: cannot lend its key to another and the count does not depend on where storages land)
SavedLog = list[tuple[Any, ...]]


def _logging_saves(meta: nn.Module, log: SavedLog) -> tuple[list[Any], Any]:
    """Hooks on every module of ``meta`` and a saved-tensors context that fill ``log``."""
    hooks = []
    for path, module in meta.named_modules():
        hooks.append(module.register_forward_pre_hook(lambda *_, p=path: log.append(("in", p))))
        hooks.append(module.register_forward_hook(lambda *_, p=path: log.append(("out", p))))
    ours = {p.untyped_storage()._cdata for p in meta.parameters()}
    ours |= {b.untyped_storage()._cdata for b in meta.buffers()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in ours:  # the log holds the storage: its key is never reused
            floating, size = t.is_floating_point(), t.element_size()
            log.append(("save", storage, storage.nbytes(), floating, size, t.shape))
        return t

    return hooks, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _validate(
    model: nn.Module,
    global_shape: Sequence[int] | None,
    manager: DistributedManager | None,
    parts: int | None,
    partition: PartitionPolicy | None,
    shard_dim: int,
    example_inputs: Sequence[Any] | None,
    input_dim: int | None,
    simulate: bool,
    saves: bool,
) -> tuple[ShardingReport, SavedLog]:
    """:func:`validate_sharding_constraints`, and with ``saves`` what its serial forward saved
    for the backward pass (:data:`SavedLog`; ``mpidp plan`` prices it per rank): one meta
    forward serves the layer table, the conversion's shapes and the activation memory."""
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
    for path, module in meta.named_modules():
        if _banded(module) and _form(module) is not None:

            def record(mod: nn.Module, args: tuple, out: Any, path: str = path) -> None:
                if isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
                    seen.append((path, mod, args[0].shape, out.shape))

            hooks.append(module.register_forward_hook(record))
    first_seen, shape_hooks = first_shapes(meta)  # what the conversion needs: this forward
    hooks += shape_hooks
    log: SavedLog = []
    saving: Any = contextlib.nullcontext()
    if saves:
        save_hooks, saving = _logging_saves(meta, log)
        hooks += save_hooks
    problems: list[str] = []
    notes: list[str] = []
    runs = False
    with base.torch_path(), saving:
        try:
            meta(*inputs)
            runs = True
        except Exception as err:
            shapes = ", ".join(str(tuple(t.shape)) for t in inputs if isinstance(t, torch.Tensor))
            if needs_values(err):  # the real run gets past it
                runs = True
                notes.append(f"the dry run of the model on {shapes} stops where {_values(err)}")
            else:  # the serial model itself rejects the shapes
                problems.append(f"the model does not run on {shapes}: {err}")
        finally:
            for hook in hooks:
                hook.remove()
    converted = None
    try:  # what conversion would refuse (pure: nothing moves)
        twin = copy.deepcopy(model)
        with shapes_seen(twin, first_seen):
            converted = convert_to_domain_parallel(
                twin, shard_dim=shard_dim, example_inputs=inputs, input_dim=input_dim
            )
    except ConfigError as err:
        problems.insert(0, str(err))  # the conversion's refusal first, as it comes first
    exchanges: list[GraphExchange] = []
    if runs and converted is not None and simulate:  # refusals are the same at 1 rank
        if input_dim is None:  # the dim the converted model cuts its inputs along
            band = converted.__dict__.get("_mpidp_band")
            input_dim = band[1] if band is not None and isinstance(band[1], int) else shard_dim
        found, stopped = _simulated(converted, inputs, parts, partition, input_dim, exchanges)
        problems += found
        notes += stopped
    layers = []
    for path, module, shape_in, shape_out in seen:
        layer, found = axis_sharding(path, module, shape_in, shape_out, parts, partition, shard_dim)
        problems += found
        if layer is not None:
            layers.append(layer)
    report = ShardingReport(parts, tuple(layers), tuple(problems), tuple(exchanges), tuple(notes))
    return report, log


def axis_sharding(
    path: str,
    module: nn.Module,
    shape_in: Sequence[int],
    shape_out: Sequence[int],
    parts: int,
    partition: PartitionPolicy,
    shard_dim: int = -2,
    across: bool = False,
) -> tuple[LayerSharding | None, list[str]]:
    """One spatial layer of the dry run (global ``shape_in`` to ``shape_out``) cut over
    ``parts`` ranks along the sharded dim, or with ``across`` along the dim after it (the
    longitude of blocks, which every band rule cuts the same way; rows beyond a polar edge
    make the longitude a circle): its rows and halos per rank, and the problems of its
    shapes (the layer is None when it cannot be cut)."""
    problems: list[str] = []
    dim_in, dim_out = _dims(module, shard_dim)
    if across:
        dim_in, dim_out = dim_in + 1, dim_out + 1
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
            whole = LayerSharding(
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
            return whole, problems
        # a layer's input is a length the model derived (its first layer's, the model's
        # input, is cut by the policy itself: the simulated run checks that one)
        spec_in = partition.derived(h_in, parts)
        spec_out = partition.derived(h_out, parts)
    except Exception as err:
        problems.append(f"{path} ({kind}): {err}")
        return None, problems
    k = d - 2
    if geo is not None:
        mode = getattr(module, "padding_mode", getattr(module, "pole", "zeros"))
        if mode in ("reflect", "polar") and max(geo[2]) >= h_in:
            what = "columns" if across else "rows"
            problems.append(f"{path} ({kind}): reflect padding {max(geo[2])} >= {h_in} {what}")
        if not across and getattr(module, "pole", "").startswith("polar") and shape_in[-1] % 2:
            problems.append(f"{path} ({kind}): polar padding needs an even W, got {shape_in[-1]}")
    n_spatial = len(shape_in) - 2
    halo = _window_halo(module, spec_in, spec_out, k, h_in, n_spatial) if k >= 0 else None
    before, after, boundary = halo or ((0,) * parts, (0,) * parts, "none")
    if across and boundary.startswith("polar"):
        boundary = "circular"
    modes = form.modes_of(module, shape_in, parts, partition) if form and not across else ()
    window = form.window_of(module, d) if form is not None else ()
    geos = [_geometry(module, i) for i in range(n_spatial)]
    kernel = math.prod(g[0] for g in geos if g is not None)
    cut = LayerSharding(
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
        kernel,
    )
    return cut, problems
