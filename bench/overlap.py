"""A conv stack's training step with the halo exchange hidden behind compute, and without.

    mpiexec -n 2 python -m mpi4py bench/overlap.py --json docs/bench/overlap.json
    mpiexec -n 2 python -m mpi4py bench/overlap.py --grid 1x2 --json docs/bench/overlap-1x2.json

A converted stack of ``--convs`` 3x3 convolutions (ReLU between) on a (1, C, H, W) float32
field in latitude bands (default 32 x 721 x 1440), or in the blocks of ``--grid`` (latitude x
longitude ranks, e.g. 1x2): forward, a local loss, backward. Every round
runs one step with ``manager.overlap`` off (the blocking halo) and one with it on (interior rows
computed while the halo rows travel, forward and backward; mpidp.ops.halo_overlap), in
alternating order, barrier-aligned, inside one ``mpidp.profile``. Per step and rank: wall
seconds, communication seconds (the profile's clock: every backend call, waits included) and,
with the overlap on, the seconds spent waiting for halo messages (``halo_wait_seconds``).
Reported: the median over the rounds of the slowest rank's step, and each arm's largest
per-rank halo wait as a share of its step. On this shared 2-core machine other jobs run too:
compare the two arms within one run only. Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from mpi4py import MPI
from torch import nn

import mpidp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--height", type=int, default=721)
    ap.add_argument("--width", type=int, default=1440)
    ap.add_argument("--channels", type=int, default=32)
    ap.add_argument("--convs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--grid", default=None, help="P_lat x P_lon, e.g. 1x2 (default: bands)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    world = MPI.COMM_WORLD
    grid = tuple(int(p) for p in args.grid.split("x")) if args.grid else world.Get_size()
    m = mpidp.init(domain_parallel_size=grid)
    torch.manual_seed(0)
    c = args.channels
    layers: list[nn.Module] = []
    for i in range(args.convs):
        layers += [nn.Conv2d(c, c, 3, padding=1)] + ([nn.ReLU()] if i < args.convs - 1 else [])
    model = mpidp.convert_to_domain_parallel(nn.Sequential(*layers), m)
    rows, cols = m.block_spec((args.height, args.width)).block_shape(m.domain_rank)
    band = torch.randn(1, c, rows, cols)

    prof = mpidp.profile(m)
    arms: dict[str, dict[str, list[float]]] = {
        arm: {"step": [], "comm": [], "halo_wait": []} for arm in ("blocking", "overlap")
    }

    def step(arm: str, keep: bool) -> None:
        m.overlap = arm == "overlap"
        for p in model.parameters():
            p.grad = None
        world.Barrier()
        with prof.step():
            y = model(band)
            y.square().mean().backward()
        if keep:
            for key, got in (
                ("step", prof.step_seconds),
                ("comm", prof.comm_seconds),
                ("halo_wait", prof.halo_wait_seconds),
            ):
                arms[arm][key].append(got[-1])

    t0 = time.perf_counter()
    with prof:
        for arm in arms:  # warm-up: buffers, plans, the conv kernels' first calls
            step(arm, False)
        for r in range(args.rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for arm in order:
                step(arm, True)
    m.overlap = False
    every = world.gather(arms, root=0)
    if world.Get_rank() != 0:
        return
    assert every is not None
    result: dict[str, object] = {
        "shape": [1, c, args.height, args.width],
        "convs": args.convs,
        "ranks": world.Get_size(),
        "grid": list(m.grid),
        "rounds": args.rounds,
        "seconds": round(time.perf_counter() - t0, 1),
        "per_rank": every,
    }
    for arm in arms:
        # per round: the slowest rank's step; each rank's halo wait as a share of its step
        steps = [max(r[arm]["step"][i] for r in every) for i in range(args.rounds)]
        shares = [
            max(r[arm]["halo_wait"][i] / r[arm]["step"][i] for r in every)
            for i in range(args.rounds)
        ]
        comm = [max(r[arm]["comm"][i] for r in every) for i in range(args.rounds)]
        result[arm] = {
            "step_s_median": statistics.median(steps),
            "comm_s_median": statistics.median(comm),
            "halo_wait_share_median": statistics.median(shares),
            "halo_wait_share_max": max(shares),
        }
    ratio = result["overlap"]["step_s_median"] / result["blocking"]["step_s_median"]  # type: ignore[index]
    result["overlap_over_blocking"] = ratio
    print(json.dumps({k: v for k, v in result.items() if k != "per_rank"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
