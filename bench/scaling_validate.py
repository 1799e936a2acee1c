"""``python bench/scaling_model.py --validate``: the scaling model's step time checked against
real steps on this machine in a way that survives a shared machine (P = 2 and 4 against P = 1
in the same job, interleaved), the converted layers' cost per call timed per kind, and the
call costs the last validation leaves for the predictions (:func:`published_call_costs`).

Split from ``bench/scaling_model.py``, which parses the command line and runs this module's
worker (:func:`validate_worker`) under ``mpiexec`` as its ``--mode validate``. Not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def interleaved(fns: dict[str, Any], comm: Any, rounds: int) -> dict[str, list[float]]:
    """Each of ``fns`` timed once a round (:func:`common.round_times`): per name, every round's
    time of the slowest rank (seconds), for :func:`~mpidp.preflight.scaling.excess` to pair
    round by round."""
    from common import round_times

    everyone = comm.allgather(round_times(fns, comm, rounds))
    return {name: [max(r[name][k] for r in everyone) for k in range(rounds)] for name in fns}


#: the layer kinds whose converted call is timed against torch's (the plan's kinds)
TIMED_KINDS = ("PeriodicConv2d", "GroupNorm", "Upsample", "Conv2d")


def call_costs(full: Any, xf: Any, m: Any, comm: Any, rounds: int) -> dict[str, float]:
    """The fixed cost of one call (one direction) of each converted layer kind of ``full``,
    on this job's bands: the first layer of each kind, converted alone, forward and backward
    on its band of its own input in the whole model (``xf``'s), against its torch module on
    the same band (an ``Upsample`` told the band's output size), interleaved
    (:func:`interleaved`); the :func:`~mpidp.preflight.scaling.excess` over the rounds, halved
    (forward and backward). Collective over ``comm``, the job's world (``m``'s domain)."""
    import copy

    import torch

    import mpidp
    from mpidp.preflight.scaling import excess

    firsts: dict[str, Any] = {}
    for mod in full.modules():
        firsts.setdefault(type(mod).__name__, mod)
    chosen = {k: firsts[k] for k in TIMED_KINDS if k in firsts}
    seen: dict[str, Any] = {}
    hooks = [
        mod.register_forward_pre_hook(lambda _, a, k=k: seen.setdefault(k, a[0].detach()))
        for k, mod in chosen.items()
    ]
    with torch.no_grad():
        full(xf)
    for h in hooks:
        h.remove()
    out = {}
    for kind, mod in chosen.items():
        whole = seen[kind]
        spec = m.spec(whole.size(-2))
        band = whole.narrow(-2, spec.start(m.domain_rank), spec.sizes[m.domain_rank])
        x = band.contiguous().requires_grad_()
        conv = mpidp.convert_to_domain_parallel(copy.deepcopy(mod), m)
        ref = copy.deepcopy(mod)
        if getattr(ref, "size", None) is not None:  # an Upsample to the whole field's size
            with torch.no_grad():
                ref.size = tuple(conv(x).shape[-2:])

        def timed(layer: Any, x: Any = x) -> Any:
            return lambda: layer(x).square().sum().backward()

        got = interleaved({"converted": timed(conv), "torch": timed(ref)}, comm, rounds)
        out[kind] = excess(got["converted"], got["torch"]) / 2
    return out


def validate_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Under ``mpiexec -n P``: this machine's network (ranks 0 and 1) and copy rate (rank 0),
    the converted layers' cost per call (:func:`call_costs`), then rounds of four steps of
    the U-Net, interleaved so that a slow spell of the machine hits them alike
    (:func:`interleaved`; the median round of the slowest rank): the plain model on the whole
    field on rank 0 alone (P = 1's compute, the others waiting in a barrier), the converted
    model there too (every layer's torch forward: P = 1's step), the converted model on every
    rank's band (the step predicted) and the plain model on each band alone (the compute
    floor). The fixed cost is the :func:`~mpidp.preflight.scaling.excess` of the second over
    the first, round by round."""
    import copy

    import torch
    from mpi4py import MPI
    from scaling_model import pingpong

    import mpidp
    from mpidp.layers.base import torch_path
    from mpidp.preflight.plan import build_model
    from mpidp.preflight.scaling import copy_bytes_per_second, excess

    world = MPI.COMM_WORLD
    rank, p = world.Get_rank(), world.Get_size()
    pair = world.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
    net = pingpong(pair) if rank < 2 else {}
    grid = tuple(args.grid)
    shape = (1, args.channels, *grid)
    torch.manual_seed(0)
    full = build_model("unet", args.channels, grid)
    rate = copy_bytes_per_second(full, shape, parts=p) if rank == 0 else 0.0
    world.Barrier()
    m = mpidp.init(domain_parallel_size=p)
    mpidp.broadcast_parameters(full, m)
    converted = mpidp.convert_to_domain_parallel(copy.deepcopy(full), m)
    spec = m.spec(grid[0])
    xf = torch.randn(shape)
    costs = call_costs(full, xf, m, world, 2 * args.steps + 1)
    x = xf.narrow(2, spec.start(m.domain_rank), spec.sizes[m.domain_rank]).contiguous()
    band = build_model("unet", args.channels, tuple(x.shape[-2:]))  # type: ignore[arg-type]

    def plain_p1() -> None:
        if rank == 0:
            full.zero_grad(set_to_none=True)
            full(xf).square().mean().backward()

    def mpidp_p1() -> None:
        if rank == 0:
            converted.zero_grad(set_to_none=True)
            with torch_path():
                converted(xf).square().mean().backward()

    def distributed() -> None:
        converted.zero_grad(set_to_none=True)
        mpidp.global_mean(converted(x).square(), manager=m).backward()
        mpidp.sync_gradients(converted, m)

    def floor() -> None:
        band.zero_grad(set_to_none=True)
        band(x).square().mean().backward()

    fns = {"plain_p1": plain_p1, "mpidp_p1": mpidp_p1, "step": distributed, "floor": floor}
    got = interleaved(fns, world, args.steps)
    out = {"ranks": p, "copy_rate": rate, **net, "call_costs": costs}
    out.update({k: statistics.median(v) for k, v in got.items()})
    out["fixed"] = excess(got["mpidp_p1"], got["plain_p1"])
    m.shutdown()
    return out


def validate(args: argparse.Namespace) -> dict[str, Any]:
    """``--validate``: ``--repeats`` jobs of each of P = 2 and 4 (:func:`validate_worker`),
    each P's step predicted from the same job's P = 1 figures (the plain step as the compute,
    the converted one's :func:`~mpidp.preflight.scaling.excess` over it as the front end's
    fixed cost), network, copy rate and layer call costs; P = 1's own prediction (the plain
    step and the fixed cost) against its converted step; the error of each run and the median
    of each P; a markdown table beside the JSON."""
    from common import run_worker

    from mpidp.preflight.plan import build_model
    from mpidp.preflight.scaling import Network, predict_scaling

    shape = (1, args.channels, *args.grid)
    model = build_model("unet", args.channels, tuple(args.grid))  # type: ignore[arg-type]
    cli = ["--grid", *map(str, args.grid), "--channels", str(args.channels)]
    cli += ["--steps", str(args.steps), "--mode", "validate"]
    cores = os.cpu_count() or 1
    runs = []
    for k in range(args.repeats):
        for p in (2, 4):
            # one rank per core polls while it waits (as an HPC job runs); more ranks than
            # cores sleep instead (polling ranks would starve the ones that compute)
            os.environ["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1" if p > cores else "0"
            got = run_worker(HERE / "scaling_model.py", p, cli)
            net = Network("this machine", got["alpha"], got["beta"], "measured in the job")
            one, pt = predict_scaling(
                model, shape, [1, p], serial_step=got["plain_p1"], network=net,
                per_call=got["call_costs"], fixed=got["fixed"], copy_rate=got["copy_rate"],
            )  # fmt: skip
            run = {"run": k + 1, "parts": p, "oversubscribed": p > cores, "measured": got,
                   "predicted": dataclasses.asdict(pt), "predicted_p1": one.step,
                   "error_p1": (one.step - got["mpidp_p1"]) / got["mpidp_p1"],
                   "error": (pt.step - got["step"]) / got["step"],
                   "compute_error": (pt.compute - got["floor"]) / got["floor"]}  # fmt: skip
            runs.append(run)
            print(json.dumps({k: run[k] for k in ("run", "parts", "error_p1", "error")}))
            if args.json:  # each run as it ends
                Path(args.json).write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    doc: dict[str, Any] = {"shape": list(shape), "steps": args.steps, "runs": runs}
    doc["median_error"] = {
        "1": statistics.median(r["error_p1"] for r in runs),
        **{str(p): statistics.median(r["error"] for r in runs if r["parts"] == p) for p in (2, 4)},
    }
    text = validation_table(doc)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        Path(args.json).with_suffix(".md").write_text(text + "\n")
    return doc


def validation_table(doc: dict[str, Any]) -> str:
    """The markdown table of :func:`validate`'s runs: P = 1 (the prediction's input: the
    plain step, and the converted one against its prediction), and each P's measured step
    against the predicted one and its terms, in ms; then each run's call costs per kind."""
    cells = ["run", "P", "P = 1: plain / converted / predicted", "step", "predicted", "error",
             "compute (floor)", "comm", "copies", "calls", "fixed"]  # fmt: skip
    lines = ["| " + " | ".join(cells) + " |", "|" + "---|" * 2 + "---:|" * (len(cells) - 2)]
    costs = []
    for r in doc["runs"]:
        got, pt = r["measured"], r["predicted"]
        p = f"{r['parts']}" + (" (oversubscribed)" if r["oversubscribed"] else "")
        row = [
            str(r["run"]), p,
            f"{got['plain_p1'] * 1e3:.1f} / {got['mpidp_p1'] * 1e3:.1f} / "
            f"{r['predicted_p1'] * 1e3:.1f} ({100 * r['error_p1']:+.1f}%)",
            f"{got['step'] * 1e3:.1f}", f"{pt['step'] * 1e3:.1f}", f"{100 * r['error']:+.1f}%",
            f"{pt['compute'] * 1e3:.1f} ({got['floor'] * 1e3:.1f}, "
            f"{100 * r['compute_error']:+.1f}%)",
            *(f"{pt[k] * 1e3:.2f}" for k in ("comm", "copies", "calls", "fixed")),
        ]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
        each = ", ".join(f"{k} {v * 1e6:.0f}" for k, v in got["call_costs"].items())
        costs.append(f"run {r['run']}, P = {r['parts']}: {each}")
    med = ", ".join(f"P = {p}: {100 * e:+.1f}%" for p, e in doc["median_error"].items())
    return "\n".join(
        [*lines, "", f"median error over the runs: {med}", "",
         "call costs (us a call, one direction, converted over torch on the job's bands):",
         *(f"- {c}" for c in costs)]
    )  # fmt: skip


def published_call_costs() -> float | dict[str, float]:
    """The call costs the check and the predictions price: per layer kind, the median over
    the P = 2 runs of the last ``--validate`` (``docs/bench/scaling_validate.json``), or
    where it has none, ``docs/bench/percall.json``'s converted conv for every layer."""
    found = HERE.parent / "docs" / "bench" / "scaling_validate.json"
    runs = json.loads(found.read_text()).get("runs", []) if found.exists() else []
    costs = [r["measured"].get("call_costs") for r in runs if r["parts"] == 2]
    costs = [c for c in costs if c]
    if costs:
        return {k: statistics.median(c.get(k, 0.0) for c in costs) for k in costs[0]}
    percall = HERE.parent / "docs" / "bench" / "percall.json"
    return json.loads(percall.read_text())["conv_over_us"] * 1e-6 if percall.exists() else 3e-4
