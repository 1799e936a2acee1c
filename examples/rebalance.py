"""Research experiment: uneven costs per rank, measured while training, the bands rebalanced.

    mpiexec -n 2 python -m mpi4py examples/rebalance.py
    mpiexec -n 4 python -m mpi4py examples/rebalance.py --slow 0 --factor 3
    mpiexec -n 2 python -m mpi4py examples/rebalance.py --cost poles --factor 3 --rounds 3

All ranks form one domain group and train the example U-Net with SGD on one field. Each rank
also does a synthetic amount of work per step on its rows (a sleep): with --cost slow
(the default) --row-ms per row, --factor times more on rank --slow (a slow node); with
--cost poles every rank alike, but a row at latitude phi costs
row_ms * (1 + (factor - 1) * |sin phi|), rising toward the poles (a reduced grid, polar
filtering, a polar fold). The script trains --steps steps on the balanced cut under
mpidp.profile, asks mpidp.rebalance for the cut whose slowest rank is fastest from
the profile's measured prof.rank_seconds() (each rank's compute seconds per step: its
share of the model and its synthetic work; no formula), installs it with
manager.set_partition (parameters and optimizer state stay: they are replicated), and
trains --steps more; --rounds times. rebalance takes a rank's speed as its rows over its
seconds, one speed per rank: right for a slow node, an approximation when rows cost
differently (the rows a rank takes over cost what they cost where they come from), which the
next round corrects. It prints the median step time of each cut and the ideal: the model's
step without the synthetic work plus all the work shared so that every rank finishes
together (the total work over P when the ranks are equally fast). With --profile FILE.json
each phase's profile (compute, communication and waiting for the slowest peer, per rank) is
printed, written (FILE-balanced.json, FILE-round1.json, ...) and plotted beside it (PNG;
mpidp profile-report FILE-balanced.json redraws one). Rank 0 prints.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time

import torch

import mpidp
from mpidp.cli import HelpFormatter
from mpidp.models import WeatherUNet


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--grid", default="45x32", metavar="LATxLON", help="the field's grid")
    p.add_argument("--steps", type=int, default=6, metavar="N", help="steps per phase")
    p.add_argument("--row-ms", type=float, default=10.0, metavar="MS", help="work per row")
    p.add_argument("--cost", choices=("slow", "poles"), default="slow", help="the imbalance")
    p.add_argument("--factor", type=float, default=2.0, metavar="F", help="slow rank / pole row")
    p.add_argument("--slow", type=int, default=-1, metavar="RANK", help="the slow rank")
    p.add_argument("--rounds", type=int, default=1, metavar="K", help="rebalances in a row")
    p.add_argument(
        "--profile",
        default=None,
        metavar="FILE.json",
        help="print each phase's profile table, write FILE-<phase>.json and a plot beside it",
    )
    return p


def row_costs(args: argparse.Namespace, lat: int, p: int) -> list[list[float]]:
    """Seconds of synthetic work per row, for each rank (the same rows cost the same on
    every rank but the slow one)."""
    ms = args.row_ms / 1e3
    if args.cost == "poles":  # row i at latitude 90 - 180 (i + 1/2) / lat degrees
        sines = [abs(math.sin(math.radians(90 - 180 * (i + 0.5) / lat))) for i in range(lat)]
        return [[ms * (1 + (args.factor - 1) * s) for s in sines]] * p
    slow = args.slow % p
    return [[ms * (args.factor if r == slow else 1.0)] * lat for r in range(p)]


def ideal_work(costs: list[list[float]]) -> float:
    """Seconds at which every rank would finish the rows' work together (whole rows aside):
    a row costs ``costs[r][i] = a_r * c_i`` on rank r, so the work ``sum(c)`` shared over
    speeds ``1 / a_r``."""
    base = costs[0]
    factors = [cs[0] / base[0] for cs in costs]
    return sum(base) / sum(1 / a for a in factors)


def _phase(manager, model, opt, full, costs, steps, prof):
    """Median step seconds of ``steps`` steps on the current cut (each timed by ``prof``,
    when given); this rank sleeps its rows' synthetic work first."""
    h = full.size(-2)
    spec, me = manager.spec(h), manager.domain_rank
    x = full.narrow(-2, spec.start(me), spec[me])
    work = sum(costs[me][spec.start(me) : spec.stop(me)])
    lat = mpidp.latitude_weights(h, manager=manager)
    world = manager.transport()
    step_s = []
    for _ in range(steps):
        world.barrier()
        t0 = time.perf_counter()
        with prof.step() if prof is not None else contextlib.nullcontext():
            time.sleep(work)  # this rank's synthetic work on its rows
            opt.zero_grad()
            loss = mpidp.global_mean(model(x).square(), lat, manager=manager)
            loss.backward()
            mpidp.sync_gradients(model, manager)
            opt.step()
        world.barrier()
        step_s.append(time.perf_counter() - t0)
    return statistics.median(step_s)


def _report(prof, path, phase):
    """Print the phase's profile table and write its JSON and plot (rank 0)."""
    if path is None:
        return
    stem = path.removesuffix(".json")
    report = prof.to_json(f"{stem}-{phase}.json")
    if prof.manager.rank == 0:
        report.plot(f"{stem}-{phase}.png")
        print(f"{phase} cut: {report.table()}")


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = build_parser().parse_args(argv)
    lat, lon = (int(v) for v in args.grid.split("x"))
    manager = mpidp.init(domain_parallel_size=mpidp.DistributedManager.world_from_launcher())
    p = manager.domain_world_size
    torch.manual_seed(0)
    serial = WeatherUNet(3, 3, (lat, lon), width=4)
    mpidp.broadcast_parameters(serial, manager)
    model = mpidp.convert_to_domain_parallel(serial, manager)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    full = torch.randn(1, 3, lat, lon, generator=torch.Generator().manual_seed(1))
    costs = row_costs(args, lat, p)
    none = [[0.0] * lat] * p

    _phase(manager, model, opt, full, none, 2, None)  # warm-up
    model_s = _phase(manager, model, opt, full, none, args.steps, None)  # the model alone
    out = {"model_s": model_s, "ideal_s": model_s + ideal_work(costs)}
    cuts = []
    for k in range(args.rounds + 1):
        phase = "balanced" if k == 0 else f"round{k}"
        with mpidp.profile(manager) as prof:
            out[f"{phase}_s"] = _phase(manager, model, opt, full, costs, args.steps, prof)
        _report(prof, args.profile, phase)
        cuts.append((phase, manager.spec(lat).sizes, out[f"{phase}_s"]))
        if k < args.rounds:  # the measured compute seconds, the same list on every rank
            policy = mpidp.rebalance(manager, prof.rank_seconds(), rows=lat)
            manager.set_partition(policy, rows=lat)
    if manager.rank == 0:
        what = (
            f"rank {args.slow % p} {args.factor:g}x slower"
            if args.cost == "slow"
            else f"rows {args.factor:g}x costlier at the poles than at the equator"
        )
        print(
            f"rebalance: WeatherUNet on {lat} x {lon}, {p} domain ranks, {what} "
            f"({args.row_ms:g} ms per row), median of {args.steps} steps"
        )
        for phase, sizes, step in cuts:
            print(f"  {phase:8s} cut {list(sizes)}: {step * 1e3:8.1f} ms per step")
        last = cuts[-1][2]
        print(
            f"  ideal (model step {model_s * 1e3:.1f} ms + work shared evenly): "
            f"{out['ideal_s'] * 1e3:8.1f} ms; last / ideal = {last / out['ideal_s']:.3f}"
        )
    manager.shutdown()
    return out


if __name__ == "__main__":
    main()
