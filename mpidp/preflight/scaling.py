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
  ((P - 1) messages), the statistics of each norm layer (an all-reduce: 2 log2 P latencies,
  forward and backward) and the gradient all-reduce of the parameters (ring: 2 (P - 1) / P of
  their bytes, 2 log2 P latencies);
- **calls**: the fixed cost of a converted layer's call over torch's (``per_call``, measured by
  ``bench/percall.py``) for each spatial layer, forward and backward, when P > 1;
- **fixed**: what the front end adds to a step whatever P (``fixed``: the converted model's
  step at P = 1 minus the plain model's, measured by ``bench/scaling_model.py``: ShardedTensor
  dispatch of the model's own code, the loss's and the gradients' reductions).

Nothing overlaps in the model (mpidp's exchanges block on CPU): the sum is the step. Memory per
rank: parameters and gradients (and ``optimizer_states`` copies of the parameters) plus the
fullest rank's saved activations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mpidp.ops.halo_plan import Boundary, plan
from mpidp.preflight.plan import plan_model
from mpidp.preflight.validate import LayerSharding
from mpidp.runtime.partition import Balanced, PartitionPolicy

__all__ = ["NETWORKS", "Network", "ScalingPoint", "predict_scaling", "serial_step_seconds"]


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


#: Networks to price a cluster with (assumed figures, not measured here: typical one-way MPI
#: latency and achievable bandwidth of each interconnect between nodes).
NETWORKS = {
    "infiniband-hdr": Network("infiniband-hdr", 2e-6, 2.0e10, "HDR 200 Gb/s, typical MPI"),
    "slingshot": Network("slingshot", 2.5e-6, 2.0e10, "Slingshot-11 200 Gb/s, typical MPI"),
    "ethernet-25g": Network("ethernet-25g", 2e-5, 2.5e9, "25 GbE, TCP"),
}


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


def _work(layer: LayerSharding) -> float:
    """The layer's multiply-adds, roughly: a windowed layer's output elements x input channels
    x window points, any other layer's output elements."""
    out = math.prod(layer.shape_out)
    if layer.kernel > 1 or "Conv" in layer.kind:
        return float(out * layer.shape_in[1] * layer.kernel)
    return float(out)


def _messages(layer: LayerSharding, rank: int) -> tuple[int, int, int, int]:
    """(messages received, sent; rows received, sent) by ``rank`` in the layer's halo fetch."""
    if not any(layer.halo_before) and not any(layer.halo_after):
        return 0, 0, 0, 0
    p = plan(
        layer.rows_in, layer.halo_before, layer.halo_after, Boundary.of(layer.boundary, -1), rank
    )
    srcs = {src for src, _, _ in p.recv}
    dsts = {dst for dst, _, _ in p.send}
    rows_in = sum(hi - lo for _, lo, hi in p.recv)
    rows_out = sum(hi - lo for _, lo, hi in p.send)
    return len(srcs), len(dsts), rows_in, rows_out


def _point(
    model: nn.Module,
    global_shape: Sequence[int],
    parts: int,
    serial_step: float,
    network: Network,
    per_call: float,
    partition: PartitionPolicy,
    dtype: torch.dtype,
    optimizer_states: int,
    fixed: float,
) -> ScalingPoint:
    priced = plan_model(
        model, global_shape, parts, partition=partition, dtype=dtype, simulate=False
    )
    itemsize = priced.itemsize
    layers = priced.report.layers
    total = sum(_work(lay) for lay in layers) or 1.0
    params = sum(p.numel() for p in model.parameters()) * itemsize
    log_p = math.ceil(math.log2(parts)) if parts > 1 else 0
    norms = sum(1 for lay in layers if "Norm" in lay.kind)
    best: ScalingPoint | None = None
    for r in range(parts):
        share = 0.0
        for lay in layers:
            h_out = lay.shape_out[len(lay.shape_out) + lay.dim_out]
            rows = lay.rows_out[r] if lay.boundary != "replicated" else h_out
            share += _work(lay) * rows / max(h_out, 1)
        compute = serial_step * share / total
        messages = 0
        for lay in layers:
            got, sent, _, _ = _messages(lay, r)
            messages += 2 * max(got, sent)  # forward, and the adjoint in the backward
            if lay.modes:  # the spectral transposes: an all-to-all each way, twice
                messages += 4 * (parts - 1)
        cost = priced.ranks[r]
        nbytes = max(cost.send_bytes, cost.recv_bytes)
        comm = network.seconds(messages, nbytes)
        comm += network.seconds(4 * log_p * norms, 0)  # statistics: forward and backward
        if parts > 1:  # the gradient all-reduce (ring)
            comm += network.seconds(2 * log_p, 2 * (parts - 1) / parts * params)
        calls = 2 * len(layers) * per_call if parts > 1 else 0.0
        memory = (2 + optimizer_states) * params + cost.activation_bytes
        step = compute + comm + calls + fixed
        point = ScalingPoint(parts, step, compute, comm, calls, memory, cost.rows)
        if best is None or point.step > best.step:
            best = point
    assert best is not None
    return best


def predict_scaling(
    model: nn.Module,
    global_shape: Sequence[int],
    parts: Sequence[int],
    *,
    serial_step: float,
    network: Network,
    per_call: float = 3e-4,
    partition: PartitionPolicy | None = None,
    dtype: torch.dtype = torch.float32,
    optimizer_states: int = 2,
    fixed: float = 0.0,
) -> list[ScalingPoint]:
    """The predicted step of ``model`` on inputs of ``global_shape`` at each rank count in
    ``parts`` (those the grid can be cut into), its busiest rank's. ``serial_step``: seconds
    of one forward and backward on one process (:func:`serial_step_seconds`); ``per_call``:
    seconds a converted layer's call costs over torch's (``bench/percall.py``'s conv figure);
    ``optimizer_states``: copies of the parameters the optimizer keeps (Adam: 2); ``fixed``:
    seconds the front end adds to every step (see the module doc). Local."""
    policy = partition if partition is not None else Balanced()
    out = []
    for p in parts:
        try:
            policy.spec(global_shape[-2], p)
        except Exception:  # more ranks than the grid has rows
            continue
        out.append(
            _point(model, global_shape, p, serial_step, network, per_call, policy, dtype,
                   optimizer_states, fixed)
        )  # fmt: skip
    return out


def table(points: Sequence[ScalingPoint], serial_step: float, network: Network) -> str:
    """The rows ``mpidp plan --scaling`` prints."""
    lines = [
        f"scaling model: serial step {serial_step * 1e3:.1f} ms; network {network.name} "
        f"(alpha {network.alpha * 1e6:.1f} us, beta {network.beta / 1e9:.2f} GB/s, "
        f"{network.source}); the busiest rank, no overlap",
        f"{'P':>6}{'rows':>7}{'step ms':>10}{'compute':>10}{'comm':>9}{'calls':>9}{'fixed':>8}"
        f"{'comm %':>8}{'speed-up':>10}{'efficiency':>12}{'memory MB':>11}",
    ]
    for pt in points:
        speedup = serial_step / pt.step if pt.step else 0.0
        lines.append(
            f"{pt.parts:>6}{pt.rows:>7}{pt.step * 1e3:>10.1f}{pt.compute * 1e3:>10.1f}"
            f"{pt.comm * 1e3:>9.2f}{pt.calls * 1e3:>9.2f}"
            f"{(pt.step - pt.compute - pt.comm - pt.calls) * 1e3:>8.2f}"
            f"{100 * pt.comm_fraction:>8.1f}"
            f"{speedup:>10.2f}{speedup / pt.parts:>12.2f}{pt.memory / 1e6:>11.1f}"
        )
    return "\n".join(lines)


def as_dicts(points: Sequence[ScalingPoint]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(p) for p in points]
