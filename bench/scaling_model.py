"""The scaling model (mpidp/preflight/scaling.py, ``mpidp plan --scaling``) against real steps on
this machine, and its predictions to 1024 ranks.

    python bench/scaling_model.py --json docs/bench/scaling_model.json \
        --plot docs/bench/scaling_model.png

1. This machine's network: one-way time of MPI messages between two ranks (ping-pong of 8 B
   for the latency ``alpha``, 4 MB for the bandwidth ``beta``), medians.
2. Real training steps of the example U-Net (converted, forward + backward + gradient sync,
   float32, one thread per rank), and its compute floor (the plain model on each rank's rows
   alone, no exchange), at P = 1, 2 and 4 (4 ranks on 2 cores: oversubscribed, so
   its measurement is not what the model predicts for 4 cores; reported as such).
3. The model's prediction for the same P from the measured serial step (P = 1), the measured
   network and the per-call cost of ``docs/bench/percall.json`` (its converted conv over
   torch's), with the error of each; then predictions to P = 1024 for this machine's network
   and the assumed cluster networks (``mpidp.preflight.scaling.NETWORKS``), on bands and on
   blocks (each P's block shape that moves the fewest halo bytes).
Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def pingpong() -> dict[str, float]:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
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
    from mpi4py import MPI

    import mpidp
    from mpidp.preflight.plan import build_model

    world = MPI.COMM_WORLD
    m = mpidp.init(domain_parallel_size=world.Get_size())
    grid = tuple(args.grid)
    torch.manual_seed(0)
    model = mpidp.convert_to_domain_parallel(build_model("unet", args.channels, grid), m)
    spec = m.spec(grid[0])
    x = torch.randn(1, args.channels, spec.sizes[m.domain_rank], grid[1])
    # the same network built for this rank's rows (its upsampling sizes are the grid's)
    plain = build_model("unet", args.channels, tuple(x.shape[-2:]))

    def converted() -> None:
        model.zero_grad(set_to_none=True)
        mpidp.global_mean(model(x).square(), manager=m).backward()
        mpidp.sync_gradients(model, m)

    def floor() -> None:  # the plain model on this rank's rows alone: no exchange at all
        plain.zero_grad(set_to_none=True)
        plain(x).square().mean().backward()

    out = {"ranks": world.Get_size()}
    for name, fn in (("step", converted), ("floor", floor)):
        times = []
        for _ in range(args.steps + 1):  # the first is a warm-up
            world.Barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = world.allreduce(statistics.median(times[1:]), op=MPI.MAX)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--grid", type=int, nargs=2, default=[181, 360])
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mode", choices=("pingpong", "step"), default="step")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from mpi4py import MPI

        out = pingpong() if args.mode == "pingpong" else step(args)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(json.dumps(out))
        return
    from common import run_worker

    from mpidp.preflight.plan import build_model
    from mpidp.preflight.scaling import NETWORKS, Network, as_dicts, predict_scaling, table

    # one rank per core polls while it waits (as an HPC job runs); 4 ranks on 2 cores sleep
    # instead (polling ranks would starve the ones that compute)
    os.environ["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "0"
    net = run_worker(__file__, 2, ["--mode", "pingpong"])
    here = Network("this machine", net["alpha"], net["beta"], "measured here, 2 ranks")
    cli = ["--grid", *map(str, args.grid), "--channels", str(args.channels)]
    cli += ["--steps", str(args.steps), "--mode", "step"]
    measured, floors = {}, {}
    for p in (1, 2, 4):
        os.environ["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1" if p > (os.cpu_count() or 1) else "0"
        got = run_worker(__file__, p, cli)
        measured[p], floors[p] = got["step"], got["floor"]
    percall = HERE.parent / "docs" / "bench" / "percall.json"
    per_call = json.loads(percall.read_text())["conv_over_us"] * 1e-6 if percall.exists() else 3e-4
    shape = (1, args.channels, *args.grid)
    model = build_model("unet", args.channels, tuple(args.grid))
    # the compute the model scales is the plain model's; what mpidp's front end adds to a step
    # whatever P is measured at P = 1 (the converted step minus the plain one)
    serial, fixed = floors[1], measured[1] - floors[1]
    kw = {"serial_step": serial, "per_call": per_call, "fixed": fixed}
    checked = predict_scaling(model, shape, [1, 2, 4], network=here, **kw)
    rows = []
    print(f"U-Net {shape}, float32: predicted against measured steps (this machine's network)")
    print(
        f"{'P':>3}{'measured ms':>13}{'predicted ms':>14}{'error':>8}"
        f"{'floor ms':>10}{'pred. compute':>15}{'error':>8}{'rest ms':>9}{'pred. rest':>12}"
    )
    for pt in checked:
        got, fl = measured[pt.parts], floors[pt.parts]
        err = (pt.step - got) / got
        rest, pred_rest = got - fl, pt.comm + pt.calls
        note = "  (4 ranks on 2 cores: oversubscribed)" if pt.parts > 2 else ""
        print(
            f"{pt.parts:>3}{got * 1e3:>13.1f}{pt.step * 1e3:>14.1f}{100 * err:>7.1f}%"
            f"{fl * 1e3:>10.1f}{pt.compute * 1e3:>15.1f}{100 * (pt.compute - fl) / fl:>7.1f}%"
            f"{rest * 1e3:>9.1f}{pred_rest * 1e3:>12.1f}{note}"
        )
        rows.append(
            {
                "parts": pt.parts,
                "measured": got,
                "predicted": pt.step,
                "error": err,
                "floor": fl,
                "predicted_compute": pt.compute,
                "rest": rest,
                "predicted_rest": pred_rest,
            }
        )
    parts = [2**k for k in range(11)]
    curves = {}
    for network in (here, *NETWORKS.values()):
        points = predict_scaling(model, shape, parts, network=network, **kw)
        blocks = predict_scaling(model, shape, parts, network=network, blocks=True, **kw)
        curves[network.name] = {
            "network": network.__dict__,
            "points": as_dicts(points),
            "blocks": as_dicts(blocks),
        }
        print()
        print(table(points, serial, network))
        print(table(blocks, serial, network, "blocks (the shape moving the fewest halo bytes)"))
    doc = {
        "shape": list(shape),
        "per_call": per_call,
        "fixed": fixed,
        "network_measured": net,
        "checked": rows,
        "curves": curves,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot:
        _plot(doc, args.plot)


def _plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (name, curve) in enumerate(doc["curves"].items()):
        color = f"C{i}"
        pts = curve["points"]
        ax.loglog(
            [p["parts"] for p in pts], [p["step"] * 1e3 for p in pts], marker=".", color=color,
            label=name,
        )  # fmt: skip
        pts = curve.get("blocks", [])
        ax.loglog(
            [p["parts"] for p in pts], [p["step"] * 1e3 for p in pts], ":", color=color,
            label=f"{name}, blocks" if pts else None,
        )  # fmt: skip
    got = doc["checked"]
    ax.loglog(
        [r["parts"] for r in got], [r["measured"] * 1e3 for r in got], "kx", label="measured here"
    )
    ax.set_xlabel("domain ranks P")
    ax.set_ylabel("step, ms (busiest rank)")
    ax.set_title(f"U-Net {doc['shape']}: predicted step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
