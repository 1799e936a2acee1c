"""How a model will scale: step time, communication time and memory per rank at P = 1-1024,
predicted from the priced dry run (:func:`~mpidp.preflight.plan.plan_model`: rows, halo rows,
bytes per rank), the model's serial step time on the machine, and a latency/bandwidth model
of the network. ``mpidp plan --scaling`` prints it; ``bench/scaling_model.py`` measures this
machine's parameters and checks the predictions against real steps.

For each P, the busiest rank's step is

- **compute**: the serial step times that rank's share of the work, a layer's share being the
  rows it computes (its output rows, and the input rows it reads: band plus halo) over the
  layer's rows, weighted by the layer's share of the serial multiply-adds (convolutions: output
  elements x input channels x kernel area; other layers: output elements);
- **communication**: every message it sends or receives costs the latency ``alpha`` plus its
  bytes over the bandwidth ``beta``: the halo exchanges of each layer, forward and backward
  (one message per neighbour that holds needed rows), the transposes of spectral layers
  ((P - 1) messages; on blocks the pencil transposes along the longitude row, (P_lon - 1)),
  the statistics of each norm layer (an all-reduce: 2 log2 P latencies, forward and backward)
  and the gradient all-reduce of the parameters (ring: 2 (P - 1) / P of their bytes, 2 log2 P
  latencies);
- **copies**: the bytes a band step copies that a serial step does not, over this machine's
  copy rate (``copy_rate``, measured by :func:`copy_bytes_per_second`), when P > 1: each layer that
  fetches a halo copies the rank's input with its halo into one tensor in the forward (the
  concatenation of band and halo rows, or columns) and the gradient of as many bytes back to
  the band in the backward; each transpose packs what it sends and unpacks what it receives;
  the gradient sync packs the gradients into one buffer and back. These grow with the band's
  bytes and the number of layers, not with the multiply-adds;
- **calls**: the fixed cost of a converted layer's call over torch's, forward and backward,
  when P > 1: ``per_call`` seconds for every spatial layer, or a mapping from a layer's kind
  (its class name in the plan: ``PeriodicConv2d``, ``GroupNorm``, ...) to that kind's cost,
  kinds it does not name costing nothing (``bench/scaling_model.py`` measures one per kind:
  a converted layer's forward and backward on its band minus its torch module's, the halo
  exchange's, the statistics' collectives' and the layer's Python; a norm's costs as much as
  a conv's, a 1x1 conv nothing, so one figure for every layer misprices both);
- **fixed**: what the front end adds to a step whatever P (``fixed``: the converted model's
  step at P = 1 minus the plain model's, measured by ``bench/scaling_model.py``: ShardedTensor
  dispatch of the model's own code, the loss's and the gradients' reductions).

A measured cost enters as :func:`excess`: the median of per-round differences of interleaved
timings, floored at 0, so a noisy sitting cannot make a term (or a step) negative; the model
floors ``fixed`` and every call cost at 0 too.

On blocks (``predict_scaling(..., blocks=True)``: each P's block shape that moves the fewest
bytes, halos and transposes) a layer's share is its rows times its columns, and its halo
messages are those of the latitude fetch, the polar fold and the longitude fetch (corners ride
on the last).

Nothing overlaps in the model (mpidp's exchanges block on CPU): the sum is the step. Memory per
rank: parameters and gradients (and ``optimizer_states`` copies of the parameters) plus the
fullest rank's saved activations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mpidp.preflight.grids import axis_exchange, best_blocks, compare_shapes, fold_cut, fold_rows
from mpidp.preflight.plan import plan_model
from mpidp.preflight.validate import LayerSharding, validate_sharding_constraints
from mpidp.runtime.partition import Balanced, PartitionPolicy

__all__ = [
    "NETWORKS",
    "Network",
    "ScalingPoint",
    "copy_bytes_per_second",
    "excess",
    "predict_scaling",
    "serial_step_seconds",
]


@dataclasses.dataclass(frozen=True)
class Network:
    """A latency/bandwidth model of point-to-point messages: a message of ``n`` bytes takes
    ``alpha + n / beta`` seconds."""

    name: str
    alpha: float  #: seconds per message
    beta: float  #: bytes per second
    source: str = "assumed"  #: "measured here" or where the figures come from

    def seconds(self, messages: float, nbytes: float) -> float:
        return messages * self.alpha + nbytes / self.beta


#: Networks to price a cluster with (not measured here). Bandwidths are the vendors' link rates
#: one way (or a little under, for what MPI achieves); latencies are assumed typical one-way
#: figures of a small message, not measured.
NETWORKS = {
    "infiniband-hdr": Network(
        "infiniband-hdr", 2e-6, 2.0e10, "HDR 200 Gb/s (25 GB/s) a port; latency assumed"
    ),
    "infiniband-ndr": Network(
        "infiniband-ndr", 2e-6, 5.0e10,
        "NDR 400 Gb/s (50 GB/s) a port, ConnectX-7 (H100 clusters); latency assumed",
    ),
    "nvlink-h100": Network(
        "nvlink-h100", 5e-6, 4.5e11,
        "NVLink 4 in one H100 node: 900 GB/s both ways a GPU (NVIDIA's H100 datasheet), "
        "450 one way; latency assumed",
    ),
    "slingshot": Network(
        "slingshot", 2.5e-6, 2.0e10, "Slingshot-11 200 Gb/s (25 GB/s); latency assumed"
    ),
    "ethernet-25g": Network("ethernet-25g", 2e-5, 2.5e9, "25 GbE, TCP; latency assumed"),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ScalingPoint:
    """The busiest rank's predicted step at ``parts`` ranks (seconds) and memory (bytes)."""

    parts: int
    step: float
    compute: float
    comm: float
    calls: float
    memory: int
    rows: int  #: the busiest rank's input rows
    #: ``(P_lat, P_lon)``: bands are ``(parts, 1)``
    grid: tuple[int, int] = (1, 1)
    cols: int = 0  #: the busiest rank's input columns
    activations: int = 0  #: of ``memory``: the busiest rank's saved activations (bytes)
    messages: float = 0.0  #: the busiest rank's messages in a step (``comm``'s latencies)
    comm_bytes: float = 0.0  #: and the bytes over the bandwidth
    copies: float = 0.0  #: seconds of copies a serial step does not make (of ``step``)
    copy_bytes: float = 0.0  #: and their bytes
    fixed: float = 0.0  #: what the front end adds to the step whatever P (of ``step``)

    def on(self, network: Network) -> ScalingPoint:
        """The same rank's step priced on another ``network`` (its messages and bytes are
        the grid's; the rank stays the one that was busiest)."""
        comm = network.seconds(self.messages, self.comm_bytes)
        return dataclasses.replace(self, step=self.step - self.comm + comm, comm=comm)

    @property
    def comm_fraction(self) -> float:
        return self.comm / self.step if self.step else 0.0


def serial_step_seconds(
    model: nn.Module,
    global_shape: Sequence[int],
    repeats: int = 3,
    dtype: torch.dtype = torch.float32,
) -> float:
    """The median time of one forward and backward of ``model`` on a random input of
    ``global_shape`` in this process (the compute a prediction scales). Local."""
    import time

    model = model.to(dtype)
    x = torch.randn(tuple(global_shape), dtype=dtype)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model(x).float().square().mean().backward()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


def excess(over: Sequence[float], base: Sequence[float]) -> float:
    """What ``over`` costs more than ``base``, from timings taken in interleaved rounds
    (``over[k]`` and ``base[k]`` in round ``k``): the median of the per-round differences, so a
    slow spell of the machine that hits one round cancels in it, floored at 0 (two noisy
    figures of nearly the same cost can differ either way; a cost is never negative). 0 for no
    rounds. Local."""
    if len(over) != len(base):
        raise ValueError(f"excess: {len(over)} rounds against {len(base)}; pair them")
    diffs = sorted(a - b for a, b in zip(over, base, strict=True))
    if not diffs:
        return 0.0
    mid = len(diffs) // 2
    median = diffs[mid] if len(diffs) % 2 else (diffs[mid - 1] + diffs[mid]) / 2
    return max(median, 0.0)


def _call_seconds(lat: Sequence[LayerSharding], per_call: float | Mapping[str, float]) -> float:
    """One direction's fixed cost of the converted layers' calls (see the module doc)."""
    if isinstance(per_call, Mapping):
        return sum(max(per_call.get(lay.kind, 0.0), 0.0) for lay in lat)
    return len(lat) * max(per_call, 0.0)


def copy_bytes_per_second(
    model: nn.Module,
    global_shape: Sequence[int],
    parts: int = 2,
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
) -> float:
    """Bytes per second this process copies as ``model``'s band step does at ``parts`` bands
    (the copies' sizes are its busiest rank's: each layer's band with its halo), the
    ``copy_rate`` of :func:`predict_scaling`. The slope of the time against the bytes of a
    ``torch.cat`` of a band with one halo row on each side and of the ``narrow`` of its
    interior made contiguous (the backward's copy), fitted over up to six of those sizes, so
    the fixed cost of a call stays out of it (that is ``per_call``). Each time is this
    thread's CPU time, the fastest of ``repeats``: a copy the system preempts on a shared
    machine is not slowed by it. Local."""
    import time

    priced = plan_model(model, global_shape, parts, dtype=dtype, simulate=False, compare=False)
    lat, lon = priced.report.layers, priced.across
    busiest = max(range(priced.parts), key=lambda r: priced.ranks[r].rows)
    i, j = divmod(busiest, priced.grid[1])
    sizes = {_halo_input_bytes(a, b, i, j, priced.itemsize) for a, b in zip(lat, lon, strict=True)}
    chosen = sorted(max(n, 4096) for n in sizes if n) or [1 << 20]
    if len(chosen) > 6:  # six sizes spread over the range, its ends kept
        chosen = [chosen[round(k * (len(chosen) - 1) / 5)] for k in range(6)]
    if len(chosen) == 1:  # a second size to fit the slope against
        chosen.append(4 * chosen[0])
    xs, ys = [], []
    for nbytes in chosen:
        width = 256
        rows = max(nbytes // (4 * width), 3)
        band = torch.randn(1, 1, rows - 2, width)
        edge = torch.randn(1, 1, 1, width)
        best = math.inf
        for _ in range(repeats + 1):
            t0 = time.thread_time()
            halo = torch.cat([edge, band, edge], dim=-2)
            halo.narrow(-2, 1, rows - 2).contiguous()
            best = min(best, time.thread_time() - t0)
        xs.append(float(2 * band.nbytes + 2 * edge.nbytes))  # the bytes written, as priced
        ys.append(best)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    if slope <= 0:  # timer noise over sizes too close together: the largest copy's own rate
        slope = ys[-1] / xs[-1]
    return 1.0 / slope


def _work(layer: LayerSharding) -> float:
    """The layer's multiply-adds, roughly: a windowed layer's output elements x input channels
    x window points, any other layer's output elements."""
    out = math.prod(layer.shape_out)
    if layer.kernel > 1 or "Conv" in layer.kind:
        return float(out * layer.shape_in[1] * layer.kernel)
    return float(out)


def _point(
    model: nn.Module,
    global_shape: Sequence[int],
    grid: tuple[int, int],
    serial_step: float,
    network: Network,
    per_call: float | Mapping[str, float],
    partition: PartitionPolicy,
    dtype: torch.dtype,
    optimizer_states: int,
    fixed: float,
    rate: float,
) -> ScalingPoint:
    priced = plan_model(
        model, global_shape, grid, partition=partition, dtype=dtype, simulate=False,
        compare=False,
    )  # fmt: skip
    itemsize = priced.itemsize
    lat, lon = priced.report.layers, priced.across
    parts = priced.parts
    total = sum(_work(lay) for lay in lat) or 1.0
    params = sum(p.numel() for p in model.parameters()) * itemsize
    log_p = math.ceil(math.log2(parts)) if parts > 1 else 0
    norms = sum(1 for lay in lat if "Norm" in lay.kind)
    # each layer's messages at every index of each axis, and of the polar fold's columns
    rows = [axis_exchange(a) for a in lat]
    cols = [axis_exchange(b) for b in lon]
    folds = [
        axis_exchange(fold_cut(b)) if grid[1] > 1 and any(fold_rows(a, i) for i in range(grid[0]))
        else None
        for a, b in zip(lat, lon, strict=True)
    ]  # fmt: skip
    best: ScalingPoint | None = None
    for r in range(parts):
        i, j = divmod(r, grid[1])
        share = 0.0
        messages = 0
        copied = 0
        for n, (a, b) in enumerate(zip(lat, lon, strict=True)):
            # the rows and columns of the layer's output this rank computes
            share += _work(a) * _fraction(a, i) * _fraction(b, j)
            copied += 2 * _halo_input_bytes(a, b, i, j, itemsize)  # forward, and backward
            got = rows[n][i][2] + cols[n][j][2]
            sent = rows[n][i][3] + cols[n][j][3]
            fold = folds[n]
            if fold is not None and fold_rows(a, i):  # the polar fold's column messages
                got, sent = got + fold[j][2], sent + fold[j][3]
            messages += 2 * max(got, sent)  # forward, and the adjoint in the backward
            if a.modes:  # the spectral transposes: an all-to-all each way, twice (on blocks
                # after the pencil transpose along the longitude row)
                messages += 4 * (parts - 1) + 4 * (grid[1] - 1)
        compute = serial_step * share / total
        cost = priced.ranks[r]
        nbytes = float(max(cost.send_bytes, cost.recv_bytes))
        messages += 4 * log_p * norms  # the norms' statistics: forward and backward
        if parts > 1:  # the gradient all-reduce (ring)
            messages += 2 * log_p
            nbytes += 2 * (parts - 1) / parts * params
        comm = network.seconds(messages, nbytes)
        calls = 2 * _call_seconds(lat, per_call) if parts > 1 else 0.0
        # the transposes' packing and unpacking, the gradient sync's buffer in and out
        copied += 2 * cost.transpose_bytes + 2 * params
        copied = copied if parts > 1 else 0
        copies = copied / rate
        memory = (2 + optimizer_states) * params + cost.activation_bytes
        step = compute + comm + copies + calls + fixed
        point = ScalingPoint(
            parts, step, compute, comm, calls, memory, cost.rows, grid, cost.cols,
            cost.activation_bytes, messages, nbytes, copies, float(copied), fixed,
        )  # fmt: skip
        if best is None or point.step > best.step:
            best = point
    assert best is not None
    return best


def _halo_input_bytes(lat: LayerSharding, lon: LayerSharding, i: int, j: int, itemsize: int) -> int:
    """The bytes of block ``(i, j)``'s input to a layer with its halo rows and columns, the
    tensor the converted layer builds by copying (0 where the layer fetches no halo there).
    Only a cut axis is fetched: along an axis of one rank the layer pads as torch does. The
    block is the layer's window, ``rows + before + after``: a negative width drops rows of the
    band (a strided layer whose output rows lie past its input band reads a window away
    from it: before -126, after 128 is 3 rows, not 129)."""

    def window(cut: LayerSharding, k: int) -> tuple[int, bool]:
        own = cut.rows_in[k]
        if len(cut.rows_in) == 1:
            return own, False
        before, after = cut.halo_before[k], cut.halo_after[k]
        return max(0, own + before + after), before > 0 or after > 0

    (rows, fetch_rows), (cols, fetch_cols) = window(lat, i), window(lon, j)
    if not (fetch_rows or fetch_cols):
        return 0
    h = lat.shape_in[len(lat.shape_in) + lat.dim_in]
    w = lon.shape_in[len(lon.shape_in) + lon.dim_in]
    point = math.prod(lat.shape_in) // max(h * w, 1)  # the values of one point
    return rows * cols * point * itemsize


def _fraction(cut: LayerSharding, k: int) -> float:
    """The share of the layer's output rows (columns) that index ``k`` of its axis computes
    (all of them where the layer's result is whole on every rank)."""
    n_out = cut.shape_out[len(cut.shape_out) + cut.dim_out]
    own = cut.rows_out[k] if cut.boundary != "replicated" else n_out
    return own / max(n_out, 1)


def predict_scaling(
    model: nn.Module,
    global_shape: Sequence[int],
    parts: Sequence[int | tuple[int, int]],
    *,
    serial_step: float,
    network: Network,
    per_call: float | Mapping[str, float] = 3e-4,
    partition: PartitionPolicy | None = None,
    dtype: torch.dtype = torch.float32,
    optimizer_states: int = 2,
    fixed: float = 0.0,
    blocks: bool = False,
    copy_rate: float = math.inf,
) -> list[ScalingPoint]:
    """The predicted step of ``model`` on inputs of ``global_shape`` at each rank count in
    ``parts`` (those the grid can be cut into), its busiest rank's: on bands, or with
    ``blocks`` on the block shape of each rank count (``P_lon > 1``) whose busiest rank moves
    the fewest bytes (:func:`~mpidp.preflight.plan.best_blocks`); an entry ``(P_lat, P_lon)``
    prices that grid itself. ``serial_step``:
    seconds of one forward and backward on one process (:func:`serial_step_seconds`);
    ``per_call``: seconds a converted layer's call costs over torch's (``bench/percall.py``'s
    conv figure), or a mapping from layer kind to its cost (unnamed kinds cost nothing);
    ``optimizer_states``: copies of the parameters the optimizer keeps (Adam: 2); ``fixed``:
    seconds the front end adds to every step (floored at 0, as every call cost);
    ``copy_rate``: bytes per second
    of the copies a band step makes that a serial one does not (:func:`copy_bytes_per_second`;
    the default prices none). See the module doc. Local."""
    policy = partition if partition is not None else Balanced()
    fixed = max(fixed, 0.0)  # a measured difference of two noisy figures: never negative
    itemsize = torch.empty((), dtype=dtype).element_size()
    layers: tuple[LayerSharding, ...] = ()
    if blocks:  # the layers' shapes, to find each rank count's best block shape
        shape = [tuple(global_shape)]
        layers = validate_sharding_constraints(
            model, parts=1, partition=policy, example_inputs=shape, simulate=False
        ).layers
    out = []
    for p in parts:
        if isinstance(p, tuple):
            grid = p
        elif blocks:
            found = best_blocks(compare_shapes(model, layers, global_shape, p, policy, itemsize)[0])
            if found is None:  # one rank, or no block shape cuts the grid
                continue
            grid = found.grid
        else:
            try:
                policy.spec(global_shape[-2], p)
            except Exception:  # more ranks than the grid has rows
                continue
            grid = (p, 1)
        out.append(
            _point(model, global_shape, grid, serial_step, network, per_call, policy, dtype,
                   optimizer_states, fixed, copy_rate)
        )  # fmt: skip
    return out


def table(
    points: Sequence[ScalingPoint],
    serial_step: float,
    network: Network,
    title: str = "bands",
    copy_rate: float = math.inf,
) -> str:
    """The rows ``mpidp plan --scaling`` prints (``title``: the kind of cut they price;
    ``copy_rate``: the one they were priced with)."""
    rate = f"{copy_rate / 1e9:.2f} GB/s" if math.isfinite(copy_rate) else "not priced"
    lines = [
        f"scaling model, {title}: serial step {serial_step * 1e3:.1f} ms; network "
        f"{network.name} (alpha {network.alpha * 1e6:.1f} us, beta {network.beta / 1e9:.2f} "
        f"GB/s, {network.source}); copies {rate}; the busiest rank, no overlap",
        f"{'P':>6}{'grid':>10}{'rows':>6}{'cols':>6}{'step ms':>10}{'compute':>10}{'comm':>9}"
        f"{'copies':>9}{'calls':>9}{'fixed':>8}{'comm %':>8}{'speed-up':>10}{'efficiency':>12}"
        f"{'memory MB':>11}",
    ]
    for pt in points:
        speedup = serial_step / pt.step if pt.step else 0.0
        grid = f"{pt.grid[0]}x{pt.grid[1]}"
        lines.append(
            f"{pt.parts:>6}{grid:>10}{pt.rows:>6}{pt.cols:>6}{pt.step * 1e3:>10.1f}"
            f"{pt.compute * 1e3:>10.1f}{pt.comm * 1e3:>9.2f}{pt.copies * 1e3:>9.2f}"
            f"{pt.calls * 1e3:>9.2f}{pt.fixed * 1e3:>8.2f}"
            f"{100 * pt.comm_fraction:>8.1f}"
            f"{speedup:>10.2f}{speedup / pt.parts:>12.2f}{pt.memory / 1e6:>11.1f}"
        )
    return "\n".join(lines)


def as_dicts(points: Sequence[ScalingPoint]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(p) for p in points]
