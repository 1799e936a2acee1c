"""U-Net training step benchmark: time per step and peak memory per rank at P = 1, 2, 4.

    python bench/unet.py --json docs/bench/unet.json            # launches the three runs

One forward + backward (+ gradient sync) of mpidp.models.WeatherUNet on a latitude-weighted
loss, float32, one thread per rank (OMP_NUM_THREADS=1: P ranks use P cores). The driver starts
``mpiexec -n P`` for P = 1, 2, 4 in turn and prints one table. At P = 1 it also times the plain
torch model (mpidp's own overhead); at P = 2 and 4, the plain model on each rank's rows alone
with no exchange ("band": the compute floor of that many ranks on this machine). Peak memory
is the rise of each rank's peak resident set over its resident set before the first step
(activations, gradients, buffers), the largest over ranks. Not a test.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import time
from pathlib import Path

GRID = (721, 1440)


def _rss_kb() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def worker(args: argparse.Namespace) -> None:
    import torch
    from mpi4py import MPI

    import mpidp
    from mpidp.models import WeatherUNet

    torch.manual_seed(0)
    world = MPI.COMM_WORLD
    m = mpidp.init(domain_parallel_size=world.Get_size())
    h, w = args.grid
    spec = m.spec(h)
    rows = spec.sizes[m.domain_rank]
    # "band": the plain model on this rank's rows alone, no exchange (the compute floor)
    grid = (rows, w) if args.mode == "band" else (h, w)
    model = WeatherUNet(args.channels, args.channels, grid, width=args.width)
    mpidp.broadcast_parameters(model, m)
    if args.mode == "mpidp":
        model = mpidp.convert_to_domain_parallel(model, m)
    x = torch.randn(1, args.channels, rows, w)
    y = torch.randn_like(x)
    lat = mpidp.latitude_weights(h, manager=m).float()
    if args.mode == "sharded":  # the serial model, fed ShardedTensors; plain (H, 1) weights
        x = mpidp.ShardedTensor.from_local(x, dim=-2, spec=spec, manager=m)
        y = mpidp.ShardedTensor.from_local(y, dim=-2, spec=spec, manager=m)
        lat = mpidp.latitude_weights(h, spec=[h]).float()

    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = model(x)
        if args.mode == "sharded":
            ((out - y).square() * lat).mean().backward()
            mpidp.sync_gradients(model, m)
        elif args.mode == "mpidp":
            loss = mpidp.global_mean((out - y).square(), lat, manager=m)
            loss.backward()
            mpidp.sync_gradients(model, m)
        else:
            ((out - y).square() * lat).mean().backward()

    base = _rss_kb()
    step()  # warm-up (and the first allocation of everything)
    times = []
    for _ in range(args.steps):
        world.Barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    med = world.allreduce(statistics.median(times), op=MPI.MAX)
    peak = world.allreduce(peak_mb, op=MPI.MAX)
    calls = {}
    if args.mode in ("mpidp", "sharded"):  # what one step sends, per primitive: calls
        from mpidp.testing import count_traffic

        with count_traffic(m) as traffic:
            step()
        calls = {k: v[0] for k, v in sorted(traffic.ops.items())}
    if world.Get_rank() == 0:
        row = {"ranks": world.Get_size(), "mode": args.mode, "s": med, "peak_mb": peak}
        print(json.dumps({**row, "calls_per_step": calls}))
    m.shutdown()


def interleaved(args: argparse.Namespace) -> None:
    """Under ``mpiexec -n P``: rounds of the plain model on the whole grid (rank 0 alone, the
    others wait in a barrier: P = 1 on one core), the converted model on every rank, and the
    plain model on each rank's band (the floor), interleaved so that the machine's slow
    spells hit all three alike. Prints the speed-up of P ranks over one, and the floor's."""
    import torch
    from common import timed_round_robin
    from mpi4py import MPI

    import mpidp
    from mpidp.layers.base import torch_path
    from mpidp.models import WeatherUNet

    torch.manual_seed(0)
    world = MPI.COMM_WORLD
    m = mpidp.init(domain_parallel_size=world.Get_size())
    h, w = args.grid
    rows = m.spec(h).sizes[m.domain_rank]
    full = WeatherUNet(args.channels, args.channels, (h, w), width=args.width)
    mpidp.broadcast_parameters(full, m)
    converted = mpidp.convert_to_domain_parallel(copy.deepcopy(full), m)
    band = WeatherUNet(args.channels, args.channels, (rows, w), width=args.width)
    xf, yf = torch.randn(1, args.channels, h, w), torch.randn(1, args.channels, h, w)
    x = xf.narrow(2, m.spec(h).start(m.domain_rank), rows).contiguous()
    y = yf.narrow(2, m.spec(h).start(m.domain_rank), rows).contiguous()
    lat_full = mpidp.latitude_weights(h, spec=[h]).float()
    lat = mpidp.latitude_weights(h, manager=m).float()

    def serial() -> None:
        if world.Get_rank() == 0:
            full.zero_grad(set_to_none=True)
            ((full(xf) - yf).square() * lat_full).mean().backward()

    def serial_converted() -> None:  # mpidp at P = 1: every layer runs its torch forward
        if world.Get_rank() == 0:
            converted.zero_grad(set_to_none=True)
            with torch_path():
                ((converted(xf) - yf).square() * lat_full).mean().backward()

    def distributed() -> None:
        converted.zero_grad(set_to_none=True)
        mpidp.global_mean((converted(x) - y).square(), lat, manager=m).backward()
        mpidp.sync_gradients(converted, m)

    def floor() -> None:
        band.zero_grad(set_to_none=True)
        ((band(x) - y).square() * lat).mean().backward()

    ms = timed_round_robin(
        {"torch": serial, "mpidp_p1": serial_converted, "mpidp": distributed, "band": floor},
        world,
        args.steps,
    )
    if world.Get_rank() == 0:
        row = {"ranks": world.Get_size(), **{f"{k}_s": v / 1e3 for k, v in ms.items()}}
        one = min(ms["torch"], ms["mpidp_p1"])  # the faster of the two at P = 1
        row["speedup"] = one / ms["mpidp"]
        row["floor_speedup"] = one / ms["band"]
        print(json.dumps(row))
    m.shutdown()


def driver(args: argparse.Namespace) -> None:
    from common import run_worker

    common = ["--grid", *map(str, args.grid), "--channels", str(args.channels)]
    common += ["--width", str(args.width), "--steps", str(args.steps)]
    runs = [(1, "torch"), (1, "mpidp"), (2, "mpidp"), (2, "band"), (4, "mpidp"), (4, "band")]
    rows = [run_worker(__file__, ranks, ["--mode", mode, *common]) for ranks, mode in runs]
    torch_1 = rows[0]
    mpidp_1 = rows[1]
    print(
        f"U-Net step, grid {tuple(args.grid)}, {args.channels} channels, width {args.width}, "
        f"float32, 1 thread per rank, median of {args.steps} steps"
    )
    print(
        f"{'P':>3} {'model':<8}{'s/step':>9}{'speed-up':>10}{'peak MB/rank':>14}{'mem ratio':>11}"
    )
    for r in rows:
        r["speedup_vs_p1"] = mpidp_1["s"] / r["s"]
        r["memory_ratio_vs_p1"] = r["peak_mb"] / mpidp_1["peak_mb"]
        print(
            f"{r['ranks']:>3} {r['mode']:<8}{r['s']:>9.3f}{r['speedup_vs_p1']:>10.2f}"
            f"{r['peak_mb']:>14.0f}{r['memory_ratio_vs_p1']:>11.2f}"
        )
    print(f"mpidp overhead at P = 1: {100 * (mpidp_1['s'] / torch_1['s'] - 1):+.1f}% time")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--grid", type=int, nargs=2, default=list(GRID))
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument(
        "--interleaved",
        type=int,
        default=0,
        metavar="P",
        help="P ranks against one in the same job, interleaved (see interleaved())",
    )
    parser.add_argument("--mode", choices=["torch", "mpidp", "band", "sharded"], default="mpidp")
    args = parser.parse_args()
    if args.interleaved and not args.worker:
        from common import run_worker

        cli = ["--interleaved", str(args.interleaved), "--grid", *map(str, args.grid)]
        cli += ["--channels", str(args.channels), "--width", str(args.width)]
        row = run_worker(__file__, args.interleaved, [*cli, "--steps", str(args.steps)])
        print(json.dumps(row))
        if args.json:
            Path(args.json).write_text(json.dumps(row, indent=1))
    elif args.interleaved:
        interleaved(args)
    else:
        worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
