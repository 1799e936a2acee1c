"""Bands against blocks: halo bytes and time per rank for a stack of 3x3 convolutions on a
721 x 1440 x 32 field at 4 ranks (4 x 1 bands against 2 x 2 blocks), and the model of bytes
moved per rank from 16 to 1024 ranks (bands against the best block shape of each rank count).

    python bench/blocks_halo.py --json docs/bench/blocks.json --plot docs/bench/blocks.png

1. Measured, one ``mpiexec -n 4`` job per grid (the first job 4 x 1, the second 2 x 2), float32,
   one thread per rank: the halo exchange one 3x3 conv makes (``mpidp.halo_exchange`` of one
   row and one column with their corners, ``dim=(-2, -1)``: bands are the grid (4, 1), the same
   code), and a training step of the stack of converted convs called on the rank's block
   (``DomainParallelConv2d``; forward, backward, no optimizer);
   medians over rounds, slowest rank. On a 2-core machine 4 ranks are **oversubscribed**: the
   times are two ranks per core, not what 4 cores give; the bytes are exact either way.
2. Priced (``mpidp plan``'s pricing, :func:`mpidp.preflight.plan.plan_model`): the halo bytes
   each rank receives per training step at both grids, beside the measured exchange.
3. The model (:func:`mpidp.preflight.plan.compare_shapes`): for P = 16 to 1024, the halo bytes
   per training step of the busiest rank on bands (while the 721 rows last) and on the block
   shape that moves the fewest, for the conv stack and the example U-Net (``mpidp plan
   --model unet``, 6 channels: polar and periodic padding, so the polar fold is priced).
Not a test: times compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

SHAPE = (1, 32, 721, 1440)
DEPTH = 4  # 3x3 convs in the stack


def stack(channels: int, depth: int = DEPTH):  # type: ignore[no-untyped-def]
    from torch import nn

    return nn.Sequential(*[nn.Conv2d(channels, channels, 3, padding=1) for _ in range(depth)])


def worker(args: argparse.Namespace) -> dict[str, object]:
    import torch
    from mpi4py import MPI

    import mpidp
    from mpidp.layers.conv import DomainParallelConv2d

    world = MPI.COMM_WORLD
    grid = tuple(args.grid)
    m = mpidp.init(domain_parallel_size=grid)
    torch.manual_seed(0)
    # the converted convs called on the block (a converted container is band code on main)
    convs = [DomainParallelConv2d(SHAPE[1], SHAPE[1], 3, padding=1) for _ in range(DEPTH)]
    model = torch.nn.Sequential(*convs)
    spec = m.block_spec(SHAPE)
    rows, cols = spec.block_shape(m.domain_rank)
    x = torch.randn(*SHAPE[:2], rows, cols)

    def halo() -> torch.Tensor:
        return mpidp.halo_exchange(
            x, (1, 1), (1, 1), dim=(-2, -1), spec=spec, manager=m, boundary=("zeros", "zeros")
        )

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    out: dict[str, object] = {"grid": list(grid), "rows": rows, "cols": cols}
    for name, fn, repeats in (("halo", halo, args.repeats), ("step", step, args.steps)):
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            world.Barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = world.allreduce(statistics.median(times), op=MPI.MAX)
    ext = halo()
    out["halo_points"] = world.allreduce(ext.shape[-2] * ext.shape[-1] - rows * cols, op=MPI.MAX)
    return out


def model_curve(model, shape, parts):  # type: ignore[no-untyped-def]
    """Bands and the best blocks at each rank count: the busiest rank's halo bytes per step."""
    import torch

    from mpidp.preflight.plan import best_blocks, compare_shapes
    from mpidp.preflight.validate import validate_sharding_constraints
    from mpidp.runtime.partition import Balanced

    layers = validate_sharding_constraints(
        model, parts=1, partition=Balanced(), example_inputs=[shape], simulate=False
    ).layers
    rows = []
    for p in parts:
        shapes, _ = compare_shapes(model, layers, shape, p, Balanced(), torch.float32.itemsize)
        bands = next((c for c in shapes if c.grid[1] == 1), None)
        best = best_blocks(shapes)
        rows.append(
            {
                "parts": p,
                "bands": bands.busiest_bytes if bands else None,
                "blocks": best.busiest_bytes if best else None,
                "grid": list(best.grid) if best else None,
                "ratio": bands.busiest_bytes / best.busiest_bytes if bands and best else None,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--grid", type=int, nargs=2, default=[2, 2])
    parser.add_argument("--repeats", type=int, default=20, help="halo exchanges timed")
    parser.add_argument("--steps", type=int, default=5, help="training steps timed")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        from mpi4py import MPI

        out = worker(args)
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(json.dumps(out))
        return
    from common import run_worker

    from mpidp.preflight.plan import build_model, plan_model

    cores = os.cpu_count() or 1
    oversubscribed = 4 > cores
    # ranks beyond the cores sleep while they wait (polling ranks would starve the others)
    os.environ["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1" if oversubscribed else "0"
    cli = ["--repeats", str(args.repeats), "--steps", str(args.steps)]
    measured = [run_worker(__file__, 4, ["--grid", *g, *cli]) for g in (("4", "1"), ("2", "2"))]
    note = f"4 ranks on {cores} cores: oversubscribed" if oversubscribed else f"{cores} cores"
    print(f"3x3 conv stack ({DEPTH} convs) on {SHAPE}, float32, 4 ranks ({note})")
    print(
        f"{'grid':<7}{'block':>12}{'halo points':>13}{'halo MB/step':>14}{'halo ms':>9}"
        f"{'step ms':>9}"
    )
    for got in measured:
        grid = tuple(got["grid"])
        priced = plan_model(stack(SHAPE[1]), SHAPE, grid, simulate=False, compare=False)
        busiest = max(max(r.recv_bytes, r.send_bytes) for r in priced.ranks)
        got["priced_bytes"] = [r.recv_bytes for r in priced.ranks]
        got["priced_busiest"] = busiest
        block = f"{got['rows']}x{got['cols']}"
        print(
            f"{grid[0]}x{grid[1]:<5}{block:>12}{got['halo_points']:>13}{busiest / 1e6:>14.2f}"
            f"{got['halo'] * 1e3:>9.2f}{got['step'] * 1e3:>9.0f}"
        )
    parts = [2**k for k in range(4, 11)]
    models = {
        "conv stack": (stack(SHAPE[1]), SHAPE),
        "unet": (build_model("unet", 6, SHAPE[2:]), (1, 6, *SHAPE[2:])),
    }
    curves = {}
    for name, (model, shape) in models.items():
        curves[name] = {"shape": list(shape), "points": model_curve(model, shape, parts)}
        print(f"\n{name} {shape}: halo MB per training step, busiest rank")
        print(f"{'P':>6}{'bands':>10}{'best blocks':>13}{'grid':>9}{'bands/blocks':>14}")
        for row in curves[name]["points"]:
            bands = f"{row['bands'] / 1e6:.3f}" if row["bands"] is not None else "-"
            ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
            grid = "{}x{}".format(*row["grid"])
            print(f"{row['parts']:>6}{bands:>10}{row['blocks'] / 1e6:>13.3f}{grid:>9}{ratio:>14}")
    doc = {
        "shape": list(SHAPE),
        "depth": DEPTH,
        "cores": cores,
        "oversubscribed": oversubscribed,
        "measured": measured,
        "model": curves,
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
    for (name, curve), color in zip(doc["model"].items(), ("C0", "C1"), strict=False):
        pts = curve["points"]
        bands = [p for p in pts if p["bands"] is not None]
        ax.loglog(
            [p["parts"] for p in bands], [p["bands"] / 1e6 for p in bands], "--", marker="o",
            color=color, label=f"{name}: bands",
        )  # fmt: skip
        ax.loglog(
            [p["parts"] for p in pts], [p["blocks"] / 1e6 for p in pts], "-", marker="s",
            color=color, label=f"{name}: best blocks",
        )  # fmt: skip
    ax.set_xlabel("domain ranks P")
    ax.set_ylabel("halo MB per training step (busiest rank)")
    ax.set_title("721 x 1440: bands against the best block shape")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
