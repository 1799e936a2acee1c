"""ShardedTensor vs converted layers: the U-Net training step, alternated in one process.

    python bench/sharded.py --json docs/bench/sharded.json

The WeatherUNet step of bench/unet.py (721 x 1440, float32, one thread per rank) at P = 2 and
4: "converted" is the converted model on a plain band, "sharded" the unchanged serial model
(the same weights) fed a ShardedTensor. Each job alternates the two, step by step, so both see
the same machine; the table gives the median step of each and their ratio, the tensors saved
for backward (bytes, unique storages, per rank), and the collectives one step sends (calls per
primitive, from a counted step after the warm-up). Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def worker(args: argparse.Namespace) -> None:
    import torch
    from mpi4py import MPI

    import mpidp
    from mpidp.models import WeatherUNet
    from mpidp.testing import count_traffic

    world = MPI.COMM_WORLD
    m = mpidp.init(domain_parallel_size=world.Get_size())
    h, w = args.grid
    spec = m.spec(h)
    rows = spec.sizes[m.domain_rank]
    torch.manual_seed(0)
    serial = WeatherUNet(4, 4, (h, w), width=8)
    converted = mpidp.convert_to_domain_parallel(WeatherUNet(4, 4, (h, w), width=8), m)
    converted.load_state_dict(serial.state_dict())
    x = torch.randn(1, 4, rows, w)
    y = torch.randn_like(x)
    lat_band = mpidp.latitude_weights(h, manager=m).float()
    lat_full = mpidp.latitude_weights(h, spec=[h]).float()
    xs, ys = (mpidp.ShardedTensor.from_local(t, dim=-2, spec=spec, manager=m) for t in (x, y))

    def converted_step() -> None:
        converted.zero_grad(set_to_none=True)
        out = converted(x)
        mpidp.global_mean((out - y).square(), lat_band, manager=m).backward()
        mpidp.sync_gradients(converted, m)

    def sharded_step() -> None:
        serial.zero_grad(set_to_none=True)
        out = serial(xs)
        ((out - ys).square() * lat_full).mean().backward()
        mpidp.sync_gradients(serial, m)

    steps = {"converted": converted_step, "sharded": sharded_step}
    times: dict[str, list[float]] = {k: [] for k in steps}
    calls, saved = {}, {}
    for name, step in steps.items():
        step()  # warm-up
        with count_traffic(m) as traffic:
            step()
        calls[name] = {k: v[0] for k, v in sorted(traffic.ops.items())}
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor, storages: dict[int, int] = storages) -> torch.Tensor:
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()
        saved[name] = world.allreduce(sum(storages.values()), op=MPI.MAX)
    for _ in range(args.steps):
        for name, step in steps.items():
            world.Barrier()
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    med = {k: world.allreduce(statistics.median(v), op=MPI.MAX) for k, v in times.items()}
    if world.Get_rank() == 0:
        row = {"ranks": world.Get_size(), "s": med, "saved_bytes": saved, "calls_per_step": calls}
        print(json.dumps(row))
    m.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--grid", type=int, nargs=2, default=[721, 1440])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from common import run_worker

    flags = ["--grid", *map(str, args.grid), "--steps", str(args.steps)]
    rows = [run_worker(__file__, ranks, flags) for ranks in (2, 4)]
    print(f"U-Net step {tuple(args.grid)}, float32, 1 thread per rank, alternated, median")
    print(f"{'P':>3} {'converted s':>12} {'sharded s':>10} {'ratio':>7} {'saved MB (both)':>16}")
    for r in rows:
        a, b = r["s"]["converted"], r["s"]["sharded"]
        mb = r["saved_bytes"]["converted"] / 2**20, r["saved_bytes"]["sharded"] / 2**20
        print(f"{r['ranks']:>3} {a:>12.3f} {b:>10.3f} {b / a:>7.3f} {mb[0]:>7.1f} {mb[1]:>7.1f}")
    for r in rows:
        for name, c in r["calls_per_step"].items():
            print(f"P = {r['ranks']} {name:<10} calls per step: {c}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
