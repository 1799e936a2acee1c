"""What a model will do on ShardedTensor bands, found before the job is queued.

:func:`explain` runs the model's forward once on meta ShardedTensors (shapes and dtypes, no
storage, no values) through the same handlers and layers as a real run, over the real domain
group: collectives move shapes only (:class:`~mpidp.comm.meta.MetaTransport`) and count the
bytes the real ones would send. It records, for every outermost torch call and converted layer
on a band, the module path it ran in, the layout of its result (a band along which dim, its
rows per rank, blocks merged before it; a partial sum; Replicated; whole) and the bytes each
rank sends for it, then stops at the first call that would be refused, with its message (the
op, the module path and the fix) -- the same on every rank, as in a real run.

``mpidp explain --model module:factory --shape 1x3x721x1440 -n 4`` prints it (it starts the
ranks itself under the MPI of this environment when it is not launched by one). The backward
pass sends the adjoints of the same messages: as many bytes again. A call that needs the
values of a tensor (``.item()``, ``.tolist()`` of a meta tensor, data-dependent shapes) ends
the explanation there and says so: the real run gets past it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from mpidp.comm.meta import MetaTransport, SoloTransport
from mpidp.errors import MpidpError
from mpidp.runtime.manager import DistributedManager, get_manager, simulating
from mpidp.runtime.partition import Balanced, PartitionPolicy, known_spec
from mpidp.sharded.dispatch import WATCHERS, name_of
from mpidp.sharded.partial import PartialSum
from mpidp.sharded.tensor import Replicated, ShardedTensor, shard
from mpidp.sharded.where import module_path

__all__ = ["Explanation", "SimulatedManager", "Step", "explain", "simulate"]


@dataclasses.dataclass
class Step:
    """Consecutive calls of one op in one module with the same result layout."""

    path: str  #: module path from the model (``decoder.up2 (Conv2d)``), "" for its forward
    op: str  #: the torch function or converted layer
    layout: str  #: the result's layout
    calls: int  #: how many such calls in a row
    sent: list[int]  #: bytes each rank sends for them, by rank


@dataclasses.dataclass
class Explanation:
    """The model's forward on bands, as every rank ran it (see the module doc)."""

    model: str
    shapes: list[tuple[int, ...]]
    dim: int
    ranks: int
    input_rows: tuple[int, ...]
    steps: list[Step]
    refused: str | None  #: the first refusal's message (op, module path, fix), or None
    stopped: str | None  #: a call that needs tensor values (no refusal known past it)
    output: str  #: the output's layout, "" when the forward did not finish

    @property
    def sent(self) -> list[int]:
        """Bytes each rank sends in the forward pass."""
        return [sum(s.sent[r] for s in self.steps) for r in range(self.ranks)]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self) | {"sent_per_rank": self.sent}, indent=2)

    def __str__(self) -> str:
        rows = [("module path", "op", "calls", "result layout", "sent (max rank)")]
        for s in self.steps:
            path = s.path or "(forward)"
            rows.append((path, s.op, str(s.calls), s.layout, _bytes(max(s.sent))))
        widths = [min(max(len(r[i]) for r in rows), 60) for i in range(5)]
        lines = [
            f"mpidp explain: {self.model} on {' and '.join(map(str, self.shapes))}, "
            f"{self.ranks} ranks; input rows along dim {self.dim} by rank: "
            f"{list(self.input_rows)}",
            "",
        ]
        for i, r in enumerate(rows):
            lines.append("  ".join(c[:60].ljust(w) for c, w in zip(r, widths, strict=True)))
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append("")
        per_rank = ", ".join(_bytes(b) for b in self.sent)
        lines.append(
            f"forward: each rank sends {per_rank} (the backward pass sends the same again)"
        )
        if self.refused:
            lines.append(f"REFUSED at the first op without a band form:\n  {self.refused}")
        elif self.stopped:
            lines.append(f"stopped (not refused): {self.stopped}")
        else:
            lines.append(f"every op has a band form; the output: {self.output}")
        return "\n".join(lines)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _layout(out: Any) -> str:
    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if not tensors:
        return type(out).__name__
    t = tensors[0]
    if isinstance(t, ShardedTensor):
        blocks = f", {t.blocks} blocks" if t.blocks > 1 else ""
        text = f"band dim {t.shard_dim} of {tuple(t.shape)}{blocks}: {list(t.spec.sizes)}"
    elif isinstance(t, PartialSum):
        text = f"partial sum {tuple(t.shape)} (summed when used)"
    elif isinstance(t, Replicated):
        text = f"replicated {tuple(t.shape)}"
    else:
        text = f"whole {tuple(t.shape)}"
    return text + (f" (+{len(tensors) - 1} more)" if len(tensors) > 1 else "")


class _Watcher:
    """Records every outermost call on a band (mpidp.sharded.dispatch.observed)."""

    def __init__(self, traffic: Any) -> None:
        self.traffic = traffic
        self.busy = False
        self.steps: list[tuple[str, str, str, int]] = []

    def observe(self, what: Any, args: Any, kwargs: Any, run: Callable[[], Any]) -> Any:
        before = self.traffic.bytes
        op = type(what).__name__ if isinstance(what, nn.Module) else name_of(what)
        path = module_path()
        self.busy = True
        try:
            out = run()
        finally:
            self.busy = False
        self.steps.append((path, op, _layout(out), self.traffic.bytes - before))
        return out


def _meta_input(x: Any, dtype: torch.dtype) -> Any:
    """A meta tensor shaped like ``x`` (a tensor, or a shape of ``dtype``); anything else (a
    flag, a lead time) as it is."""
    if isinstance(x, torch.Tensor):
        return torch.empty(tuple(x.shape), dtype=x.dtype, device="meta")
    if isinstance(x, Sequence) and all(isinstance(v, int) for v in x):
        return torch.empty(tuple(x), dtype=dtype, device="meta")
    return x


def _meta(model: nn.Module) -> nn.Module:
    """The model with its parameters and buffers on the meta device, but for integer ones
    (an edge list: indexing reads them)."""
    return model._apply(lambda t: t if _index_like(t) else t.to("meta"))


def _index_like(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def explain(
    model: nn.Module,
    *inputs: torch.Tensor | Sequence[int] | Any,
    dim: int = -2,
    manager: DistributedManager | None = None,
    dtype: torch.dtype = torch.float32,
    bands: bool = False,
) -> Explanation:
    """Run ``model`` once on meta ShardedTensors (the inputs cut along ``dim`` as a converted
    model cuts them: the first, and every other with at least ``1 - dim`` dims; inputs
    given as shapes or tensors, only their shapes and dtypes used) and say what each op did
    (see the module doc). With ``bands``, ``model`` is a converted one and is given this
    rank's rows as plain tensors, as in a real run (a model whose ``forward`` is written for
    bands keeps them). The model's floating-point weights move to the meta device (pass a
    copy to keep them). Collective over the domain group; the same result on every rank."""
    from mpidp.testing import count_traffic

    m = manager if manager is not None else get_manager()
    metas = [_meta_input(x, dtype) for x in inputs]
    model = _meta(model)
    refused = stopped = None
    output = ""
    with count_traffic(m) as traffic:
        watcher = _Watcher(traffic)
        # every input of the first one's rank or more is a band, as a converted model cuts
        # them (mpidp.convert_to_domain_parallel)
        back = dim - metas[0].dim() if dim >= 0 else dim  # counted from the end
        band = shard(metas[0], back, m)
        band.requires_grad_()
        args = [band] + [
            shard(t, back, m) if isinstance(t, torch.Tensor) and t.dim() >= 1 - back else t
            for t in metas[1:]
        ]
        declared = contextlib.ExitStack()
        if bands:  # what a converted model is given: each rank's rows as plain tensors, their
            # partitions declared (a simulated rank cannot learn them from the others)
            for a in args:
                if isinstance(a, ShardedTensor):
                    declared.enter_context(known_spec(a.local, a.shard_dim, a.spec))
            args = [a.local if isinstance(a, ShardedTensor) else a for a in args]
        WATCHERS.append(watcher)
        try:
            with declared:
                output = _layout(model(*args))
        except MpidpError as err:
            refused = str(err)
        except (NotImplementedError, RuntimeError) as err:
            first = (str(err).splitlines() or [""])[0]
            stopped = (
                f"{watcher.steps[-1][1] if watcher.steps else 'the first call'} was the last "
                f"call explained; the next needs tensor values, which a meta run does not "
                f"have ({type(err).__name__}: {first[:200]})"
            )
        finally:
            WATCHERS.remove(watcher)
    everyone = m.transport(None, "cpu").all_gather_object([s[3] for s in watcher.steps])
    steps: list[Step] = []
    for i, (path, op, layout, _) in enumerate(watcher.steps):
        sent = [mine[i] if i < len(mine) else 0 for mine in everyone]
        last = steps[-1] if steps else None
        if last is not None and (last.path, last.op, last.layout) == (path, op, layout):
            last.calls += 1
            last.sent = [a + b for a, b in zip(last.sent, sent, strict=True)]
        else:
            steps.append(Step(path, op, layout, 1, sent))
    return Explanation(
        model=type(model).__name__,
        shapes=[tuple(t.shape) for t in metas if isinstance(t, torch.Tensor)],
        dim=dim % metas[0].dim(),
        ranks=m.domain_world_size,
        input_rows=tuple(band.spec.sizes),
        steps=steps,
        refused=refused,
        stopped=stopped,
        output=output,
    )


class SimulatedManager(DistributedManager):
    """Rank ``rank`` of a domain group of ``parts`` ranks cut by ``partition``, simulated in
    this process: nothing is launched, collectives answer with shapes (a
    :class:`~mpidp.comm.meta.MetaTransport` over a :class:`~mpidp.comm.meta.SoloTransport`) and
    every agreement as a consistent run does. What :func:`simulate` runs each rank on."""

    def __init__(self, rank: int, parts: int, partition: PartitionPolicy | None = None) -> None:
        # no DistributedManager.__init__: there is no launch to read and no group to join
        self.rank = self.domain_rank = rank
        self.world_size = self.domain_world_size = parts
        self.dp_rank, self.dp_world_size = 0, 1
        self.partition = partition if partition is not None else Balanced()
        self.shard_dim = -2
        self.gradients = "shares"
        self.device = torch.device("cpu")
        self.domain_ranks = tuple(range(parts))
        self.domain_group = self.data_parallel_group = None  # type: ignore[assignment]
        self._transports = {}
        self._simulated = MetaTransport(SoloTransport(rank, parts))

    def transport(self, group: Any = None, device: str | torch.device | None = None) -> Any:
        return self._simulated

    def shutdown(self, sync: bool = True) -> None:
        return None

    def __repr__(self) -> str:
        return f"SimulatedManager(rank {self.rank} of {self.domain_world_size})"


def simulate(
    make_model: Callable[[], nn.Module],
    *inputs: torch.Tensor | Sequence[int] | Any,
    parts: int,
    dim: int = -2,
    partition: PartitionPolicy | None = None,
    dtype: torch.dtype = torch.float32,
    bands: bool = False,
) -> Explanation:
    """:func:`explain` for ``parts`` ranks without launching them: each rank's forward runs in
    turn in this process, on its meta band, over a :class:`SimulatedManager` (a fresh model
    from ``make_model`` each, as each rank builds its own). The same explanation a job of
    ``parts`` ranks gives (the bytes each rank sends, the layouts, the first refusal);
    ``bands`` as for :func:`explain`. Local."""
    runs = []
    for r in range(parts):
        manager = SimulatedManager(r, parts, partition)
        with simulating(manager):  # layers that look up the default manager see this rank
            model = make_model()
            runs.append(explain(model, *inputs, dim=dim, manager=manager, dtype=dtype, bands=bands))
    first = runs[0]
    steps = [
        Step(
            s.path,
            s.op,
            s.layout,
            s.calls,
            [run.steps[i].sent[r] if i < len(run.steps) else 0 for r, run in enumerate(runs)],
        )
        for i, s in enumerate(first.steps)
    ]
    refused = next((run.refused for run in runs if run.refused), None)
    stopped = next((run.stopped for run in runs if run.stopped), None)
    return dataclasses.replace(first, steps=steps, refused=refused, stopped=stopped)
