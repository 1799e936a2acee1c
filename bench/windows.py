"""A Swin-style model's training step run unchanged on ShardedTensors: P ranks against one.

    python bench/windows.py --ranks 2 --json docs/bench/windows.json

Under ``mpiexec -n P`` (one thread per rank): rounds of the plain model on the whole grid
(rank 0 alone, the others wait in a barrier: P = 1 on one core) and the same model on every
rank's ShardedTensor band (batch 2: the windows fold the band into blocks of the batch; the
shifted blocks roll it; window-aligned cuts move the straddling rows), interleaved so that
the machine's slow spells hit both alike. Prints the speed-up and the bytes each rank sent
per step. Not a test: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def worker(args: argparse.Namespace) -> None:
    import torch
    from common import timed_round_robin
    from mpi4py import MPI

    import mpidp
    from mpidp.models import SwinBlock
    from mpidp.testing import count_traffic

    torch.manual_seed(0)
    world = MPI.COMM_WORLD
    m = mpidp.init(domain_parallel_size=world.Get_size())
    h, w = args.grid
    c = args.channels
    window = (args.window, args.window)
    model = torch.nn.Sequential(
        *[SwinBlock(c, args.heads, window, shift=i % 2 == 1) for i in range(args.depth)]
    )
    full = torch.randn(args.batch, h, w, c)
    target = torch.randn(args.batch, h, w, c)
    x = mpidp.shard(full, 1, m)
    y = mpidp.shard(target, 1, m)

    def serial() -> None:
        if world.Get_rank() == 0:
            model.zero_grad(set_to_none=True)
            (model(full) - target).square().mean().backward()

    def distributed() -> None:
        model.zero_grad(set_to_none=True)
        (model(x) - y).square().mean().backward()
        mpidp.sync_gradients(model, m)

    ms = timed_round_robin({"p1": serial, "pp": distributed}, world, args.steps)
    with count_traffic(m) as traffic:
        distributed()
    sent = world.allreduce(traffic.bytes, op=MPI.MAX)
    if world.Get_rank() == 0:
        row = {
            "ranks": world.Get_size(),
            "grid": [h, w],
            "batch": args.batch,
            "channels": c,
            "window": args.window,
            "depth": args.depth,
            "p1_s": ms["p1"] / 1e3,
            "p_s": ms["pp"] / 1e3,
            "speedup": ms["p1"] / ms["pp"],
            "max_bytes_sent_per_step": sent,
        }
        print(json.dumps(row))
    m.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--ranks", type=int, default=2, help="P, the domain ranks")
    parser.add_argument("--grid", type=int, nargs=2, default=[180, 360], help="H W")
    parser.add_argument("--batch", type=int, default=2, help="samples per step")
    parser.add_argument("--channels", type=int, default=32, help="token features")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--window", type=int, default=6, help="window rows and columns")
    parser.add_argument("--depth", type=int, default=2, help="blocks (every 2nd shifted)")
    parser.add_argument("--steps", type=int, default=5, help="timed rounds")
    parser.add_argument("--json", default=None, help="append the row to this JSON list")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from common import run_worker

    cli = ["--grid", *map(str, args.grid), "--batch", str(args.batch)]
    cli += ["--channels", str(args.channels), "--heads", str(args.heads)]
    cli += ["--window", str(args.window), "--depth", str(args.depth), "--steps", str(args.steps)]
    row = run_worker(__file__, args.ranks, cli)
    print(
        f"Swin-style step on ShardedTensors, grid {tuple(args.grid)}, batch {args.batch}, "
        f"{args.channels} features, windows {args.window}, depth {args.depth}: "
        f"P = {row['ranks']} {row['p_s']:.3f} s against P = 1 {row['p1_s']:.3f} s, speed-up "
        f"{row['speedup']:.2f}x; at most {row['max_bytes_sent_per_step'] / 1e6:.2f} MB sent "
        f"per rank per step"
    )
    if args.json:
        path = Path(args.json)
        rows = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps([*rows, row], indent=1) + "\n")


if __name__ == "__main__":
    main()
