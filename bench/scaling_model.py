"""The scaling model (mpidp/preflight/scaling.py, ``mpidp plan --scaling``) against real steps on
this machine, on bands and on blocks, and its predictions to 1024 ranks.

    python bench/scaling_model.py --validate --json docs/bench/scaling_validate.json
    python bench/scaling_model.py --json docs/bench/scaling_model.json    # bands and blocks
    python bench/scaling_model.py --given 1.3934 0.009919 1.0006e-6 1.2366e10 \
        --json docs/bench/scaling_published.json --plot docs/bench/scaling_model.png

``--validate`` is the check of the step time that survives a shared machine: P = 2 and 4
(oversubscribed on 2 cores) against P = 1 in the same job, interleaved, the converted layers'
cost per call timed per kind in the same job (``bench/scaling_validate.py``, whose workers
this script starts).
Without it:

1. This machine's network: one-way time of MPI messages between two ranks (ping-pong of 8 B
   for the latency ``alpha``, 4 MB for the bandwidth ``beta``), medians.
2. Real training steps of the example U-Net (converted, forward + backward + gradient sync,
   float32, one thread per rank) on each domain of ``--domains`` (bands ``N``, blocks
   ``LATxLON``; default 1, 2, 1x2, 4, 2x2): the step, the time in mpidp's communication
   (``mpidp.profile``: transfers and waiting for the peer), the saved activations
   (``bench/memory.py``'s count) and the compute floor (the plain model on each rank's
   rows and columns alone, no exchange), each the busiest rank's median. 4 ranks on 2 cores
   are oversubscribed: their measurement is not what the model predicts for 4 cores
   (reported as such).
3. The model's prediction for the same grids from the P = 1 figures alone (the plain step as
   the compute, the converted step minus it as the front end's fixed cost), the measured
   network, this machine's copy rate (``copy_bytes_per_second``, at the copies' sizes) and
   the call costs per layer kind of the last ``--validate`` (``published_call_costs``; without
   one, ``docs/bench/percall.json``'s converted conv over torch's for every layer), with the
   error of each; then, with ``--publish``, predictions to P = 1024 at
   721 x 1440 and 1801 x 3600 on bands and on each P's best blocks, for this machine's
   network and two GPU cluster presets (``mpidp.preflight.scaling.NETWORKS``), from a serial
   step timed here at 721 x 1440 (1801 x 3600: scaled by the points, the U-Net's work).
   ``--given SERIAL FIXED ALPHA BETA`` publishes only, from figures of an earlier quiet
   sitting (a loaded machine inflates all four), with the copy rate measured now at
   721 x 1440's sizes (the fastest of several copies: the load barely moves it) or given
   (``--copy-rate``).
Not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def pingpong(comm: Any = None) -> dict[str, float]:
    """alpha and beta between ranks 0 and 1 of ``comm`` (the world's when None), which has
    two ranks."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    rank = comm.Get_rank()
    out = {}
    for name, nbytes, repeats in (("small", 8, 2000), ("large", 4 << 20, 40)):
        buf = np.zeros(nbytes, dtype=np.uint8)
        samples = []
        for _ in range(5):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(repeats):
                if rank == 0:
                    comm.Send(buf, dest=1)
                    comm.Recv(buf, source=1)
                else:
                    comm.Recv(buf, source=0)
                    comm.Send(buf, dest=0)
            samples.append((time.perf_counter() - t0) / (2 * repeats))
        out[name] = statistics.median(samples)
    alpha = out["small"]
    return {"alpha": alpha, "beta": (4 << 20) / max(out["large"] - alpha, 1e-9)}


def step(args: argparse.Namespace) -> dict[str, float]:
    import torch
    from memory import saved_bytes
    from mpi4py import MPI

    import mpidp
    from mpidp.preflight.plan import build_model
    from mpidp.runtime.grid import parse_domain

    world = MPI.COMM_WORLD
    m = mpidp.init(domain_parallel_size=parse_domain(args.domain))
    grid = tuple(args.grid)
    torch.manual_seed(0)
    model = mpidp.convert_to_domain_parallel(build_model("unet", args.channels, grid), m)
    i, j = m.grid_coords
    rows, cols = m.partition.spec(grid[0], m.grid[0]), m.partition.spec(grid[1], m.grid[1])
    full = torch.randn(1, args.channels, *grid)
    x = full[..., rows.slice(i), cols.slice(j)].contiguous()
    # the same network built for this rank's block (its upsampling sizes are the block's)
    plain = build_model("unet", args.channels, tuple(x.shape[-2:]))
    prof = mpidp.profile(m)

    def loss(out: torch.Tensor) -> torch.Tensor:
        return mpidp.global_mean(out.square(), manager=m)

    def converted() -> None:
        model.zero_grad(set_to_none=True)
        with prof.step():
            loss(model(x)).backward()
            mpidp.sync_gradients(model, m)

    def floor() -> None:  # the plain model on this rank's block alone: no exchange at all
        plain.zero_grad(set_to_none=True)
        plain(x).square().mean().backward()

    out: dict[str, float] = {"ranks": world.Get_size()}
    with prof:
        for name, fn in (("step", converted), ("floor", floor)):
            times = []
            for _ in range(args.steps + 1):  # the first is a warm-up
                world.Barrier()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out[name] = world.allreduce(statistics.median(times[1:]), op=MPI.MAX)
    comm = statistics.median(prof.comm_seconds[1:]) if m.domain_world_size > 1 else 0.0
    out["comm"] = world.allreduce(comm, op=MPI.MAX)
    model.zero_grad(set_to_none=True)
    saved = saved_bytes(model, lambda: model(x), loss)[0]
    out["saved"] = world.allreduce(saved, op=MPI.MAX)
    return out


#: the domains measured by default: P = 1, 2 (bands, 1 x 2 blocks), 4 (bands, 2 x 2 blocks)
DOMAINS = ("1", "2", "1x2", "4", "2x2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--grid", type=int, nargs=2, default=[181, 360])
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--domains", nargs="+", default=list(DOMAINS))
    parser.add_argument(
        "--publish", action="store_true", help="predict 721 x 1440 and 1801 x 3600 to P = 1024"
    )
    parser.add_argument(
        "--given",
        type=float,
        nargs=4,
        metavar=("SERIAL", "FIXED", "ALPHA", "BETA"),
        default=None,
        help="publish only, from figures measured before (a quiet sitting): the serial step "
        "at 721 x 1440, the fixed cost per step (s), this machine's alpha (s), beta (B/s)",
    )
    parser.add_argument(
        "--validate",
        action="store_true",
        help="the 15%% check: P = 2 and 4 against P = 1 in one job (bench/scaling_validate.py)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="with --validate: jobs of each P")
    parser.add_argument(
        "--copy-rate", type=float, default=None, help="bytes/s of copies (default: measured)"
    )
    parser.add_argument("--mode", choices=("pingpong", "step", "validate"), default="step")
    parser.add_argument("--domain", default="1", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    from scaling_validate import published_call_costs, validate, validate_worker

    if args.worker:
        from mpi4py import MPI

        workers = {"pingpong": lambda _: pingpong(), "step": step, "validate": validate_worker}
        out = workers[args.mode](args)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(json.dumps(out))
        return
    from common import run_worker

    from mpidp.preflight.plan import build_model
    from mpidp.preflight.scaling import Network, copy_bytes_per_second
    from mpidp.runtime.grid import parse_domain

    per_call = published_call_costs()
    if args.validate:
        validate(args)
        return
    if args.given is not None:
        serial, fixed, alpha, beta = args.given
        quiet = Network("this machine", alpha, beta, "measured here, a quiet sitting")
        doc = {"given": args.given, "per_call": per_call}
        doc["published"] = publish(args.channels, quiet, per_call, fixed, serial, args.copy_rate)
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        if args.plot:
            _plot(doc, args.plot)
        return
    # one rank per core polls while it waits (as an HPC job runs); 4 ranks on 2 cores sleep
    # instead (polling ranks would starve the ones that compute)
    os.environ["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "0"
    net = run_worker(__file__, 2, ["--mode", "pingpong"])
    here = Network("this machine", net["alpha"], net["beta"], "measured here, 2 ranks")
    cli = ["--grid", *map(str, args.grid), "--channels", str(args.channels)]
    cli += ["--steps", str(args.steps), "--mode", "step"]
    measured = {}
    for domain in dict.fromkeys(["1", *args.domains]):
        parsed = parse_domain(domain)
        grid = (parsed, 1) if isinstance(parsed, int) else parsed
        p = grid[0] * grid[1]
        os.environ["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1" if p > (os.cpu_count() or 1) else "0"
        measured[grid] = run_worker(__file__, p, [*cli, "--domain", domain])
    shape = (1, args.channels, *args.grid)
    one = measured[(1, 1)]
    # the compute the model scales is the plain model's; what mpidp's front end adds to a step
    # whatever P is measured at P = 1 (the converted step minus the plain one)
    kw = {"serial_step": one["floor"], "per_call": per_call, "fixed": one["step"] - one["floor"]}
    kw["copy_rate"] = args.copy_rate or copy_bytes_per_second(
        build_model("unet", args.channels, tuple(args.grid)),  # type: ignore[arg-type]
        shape,
    )
    doc = {
        "shape": list(shape),
        "per_call": per_call,
        "fixed": kw["fixed"],
        "network_measured": net,
        "checked": check(shape, measured, here, kw),
    }
    if args.json:  # written now, and again with the predictions (they take minutes)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.publish:
        doc["published"] = publish(args.channels, here, per_call, kw["fixed"], None, args.copy_rate)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot and args.publish:
        _plot(doc, args.plot)


def check(
    shape: tuple[int, ...], measured: dict, network: Any, kw: dict[str, float]
) -> list[dict[str, Any]]:
    """The model's step, communication and activations against the measured ones, with the
    error of each; printed, and returned as rows."""
    from mpidp.preflight.plan import build_model
    from mpidp.preflight.scaling import predict_scaling

    model = build_model("unet", shape[1], tuple(shape[2:]))  # type: ignore[arg-type]
    points = predict_scaling(model, shape, list(measured), network=network, **kw)
    print(f"U-Net {shape}, float32: predicted against measured, the busiest rank")
    head = ["grid", "step ms", "pred.", "error", "comm ms", "pred.", "rest ms", "pred.",
            "floor ms", "pred.", "error", "act. MB", "pred.", "error"]  # fmt: skip
    print("".join(f"{h:>10}" for h in head))
    rows = []
    for pt in points:
        got = measured[pt.grid]
        row = {
            "grid": list(pt.grid),
            "parts": pt.parts,
            "oversubscribed": pt.parts > (os.cpu_count() or 1),
            "measured": got["step"],
            "predicted": pt.step,
            "error": (pt.step - got["step"]) / got["step"],
            "comm": got["comm"],
            "predicted_comm": pt.comm,
            "rest": got["step"] - got["floor"],
            "predicted_rest": pt.step - pt.compute,
            "floor": got["floor"],
            "predicted_compute": pt.compute,
            "compute_error": (pt.compute - got["floor"]) / got["floor"],
            "saved": got["saved"],
            "predicted_saved": pt.activations,
            "saved_error": (pt.activations - got["saved"]) / max(got["saved"], 1),
        }
        rows.append(row)
        cells = [
            f"{pt.grid[0]}x{pt.grid[1]}",
            *(f"{row[k] * 1e3:.1f}" for k in ("measured", "predicted")),
            f"{100 * row['error']:+.1f}%",
            *(f"{row[k] * 1e3:.1f}" for k in ("comm", "predicted_comm", "rest", "predicted_rest")),
            *(f"{row[k] * 1e3:.1f}" for k in ("floor", "predicted_compute")),
            f"{100 * row['compute_error']:+.1f}%",
            *(f"{row[k] / 1e6:.2f}" for k in ("saved", "predicted_saved")),
            f"{100 * row['saved_error']:+.1f}%",
        ]
        note = "  (oversubscribed)" if row["oversubscribed"] else ""
        print("".join(f"{c:>10}" for c in cells) + note)
    return rows


#: the grids the published predictions price (the issue's 0.25 and 0.1 degree grids)
PUBLISHED = ((721, 1440), (1801, 3600))
#: the cluster networks they are priced for besides this machine's (GPU clusters)
PRESETS = ("infiniband-ndr", "nvlink-h100")


def publish(
    channels: int,
    here: Any,
    per_call: float | dict[str, float],
    fixed: float,
    serial: float | None = None,
    rate: float | None = None,
) -> dict[str, Any]:
    """Predictions to P = 1024 on bands and on each P's best blocks, for every network, at
    the published grids; the serial step at the first (``serial``, or timed here), scaled
    by the points at the others; the copy rate (``rate``, or measured here at the first's
    copies at P = 2: the largest, so the rate of main memory, not of the caches that the
    copies of many ranks fit in)."""
    from mpidp.preflight.plan import build_model
    from mpidp.preflight.scaling import (
        NETWORKS,
        as_dicts,
        copy_bytes_per_second,
        predict_scaling,
        serial_step_seconds,
        table,
    )

    parts = [2**k for k in range(11)]
    out: dict[str, Any] = {}
    base = None
    for grid in PUBLISHED:
        shape = (1, channels, *grid)
        model = build_model("unet", channels, grid)
        if base is None:
            first = serial if serial is not None else serial_step_seconds(model, shape, repeats=2)
            base = (first, grid[0] * grid[1])
            rate = rate or copy_bytes_per_second(model, shape)
            print(f"copy rate {rate / 1e9:.2f} GB/s")
        step = base[0] * grid[0] * grid[1] / base[1]
        kw = {"serial_step": step, "per_call": per_call, "fixed": fixed, "copy_rate": rate}
        curves = {}
        # priced once, on this machine's network; the presets re-price the same ranks' messages
        # and bytes (ScalingPoint.on)
        bands0 = predict_scaling(model, shape, parts, network=here, **kw)
        blocks0 = predict_scaling(model, shape, parts, network=here, blocks=True, **kw)
        for network in (here, *(NETWORKS[n] for n in PRESETS)):
            bands = [pt.on(network) for pt in bands0]
            blocks = [pt.on(network) for pt in blocks0]
            curves[network.name] = {
                "network": dataclasses.asdict(network),
                "points": as_dicts(bands),
                "blocks": as_dicts(blocks),
            }
            print()
            print(table(bands, step, network, f"{grid[0]} x {grid[1]}, bands", rate))
            print(table(blocks, step, network, f"{grid[0]} x {grid[1]}, best blocks", rate))
        out[f"{grid[0]}x{grid[1]}"] = {"shape": list(shape), "serial_step": step,
                                       "copy_rate": rate, "curves": curves}  # fmt: skip
    return out


def _plot(doc: dict, path: str) -> None:
    """One panel per published grid: the busiest rank's step against P, bands solid and the
    best blocks dotted, one colour per network; the measured steps on the first panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grids = doc["published"]
    fig, axes = plt.subplots(1, len(grids), figsize=(6.0 * len(grids), 4.4), squeeze=False)
    for ax, (name, found) in zip(axes[0], grids.items(), strict=True):
        for i, (net, curve) in enumerate(found["curves"].items()):
            for kind, style in (("points", "-"), ("blocks", ":")):
                pts = curve[kind]
                ax.loglog(
                    [p["parts"] for p in pts], [p["step"] * 1e3 for p in pts], style,
                    marker="." if kind == "points" else None, color=f"C{i}",
                    label=f"{net}, {'bands' if kind == 'points' else 'best blocks'}",
                )  # fmt: skip
        ax.set_xlabel("domain ranks P")
        ax.set_ylabel("step, ms (busiest rank)")
        ax.set_title(f"U-Net {name}: predicted step")
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
