"""Research experiment: one slow rank, its cost measured, the bands rebalanced while training.

    mpiexec -n 2 python -m mpi4py examples/rebalance.py
    mpiexec -n 4 python -m mpi4py examples/rebalance.py --slow 0 --factor 3

All ranks form one domain group and train the example U-Net with SGD on one field. Each rank
also does a synthetic amount of work per step proportional to its rows (a sleep of
--row-ms per row), --factor times more on rank --slow: a slow node, or rows that
cost more. The script trains --steps steps on the balanced cut, measures each rank's work
seconds, asks mpidp.rebalance for the cut whose slowest rank is fastest, installs it
with manager.set_partition (the optimizer state and parameters stay: they are
replicated), and trains --steps more. It prints the median step time before and after,
and the ideal: the model's step without the synthetic work plus the work of all rows shared
in proportion to the ranks' speeds (the total work over P when they are equal).
With --profile FILE.json, mpidp.profile splits each phase's steps per rank into compute,
communication and waiting for the slowest peer: tables printed, JSON and plots written
(mpidp profile-report FILE-balanced.json redraws them). Rank 0 prints.
"""

from __future__ import annotations

import argparse
import contextlib
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
    p.add_argument("--factor", type=float, default=2.0, metavar="F", help="the slow rank's")
    p.add_argument("--slow", type=int, default=-1, metavar="RANK", help="the slow rank")
    p.add_argument(
        "--profile",
        default=None,
        metavar="FILE.json",
        help="profile both phases with mpidp.profile, print the tables, write FILE.json per "
        "phase (FILE-balanced.json, FILE-rebalanced.json) and their plots beside them (PNG)",
    )
    return p


def _phase(manager, model, opt, full, work_per_row, steps, prof=None):
    """Median step seconds and this rank's median work seconds of ``steps`` steps (each
    step timed by ``prof`` too when given)."""
    h = full.size(-2)
    spec, me = manager.spec(h), manager.domain_rank
    x = full.narrow(-2, spec.start(me), spec[me])
    lat = mpidp.latitude_weights(h, manager=manager)
    world = manager.transport()
    step_s, work_s = [], []
    for _ in range(steps):
        world.barrier()
        with prof.step() if prof is not None else contextlib.nullcontext():
            t0 = time.perf_counter()
            time.sleep(work_per_row * spec[me])  # this rank's synthetic work on its rows
            t1 = time.perf_counter()
            opt.zero_grad()
            loss = mpidp.global_mean(model(x).square(), lat, manager=manager)
            loss.backward()
            mpidp.sync_gradients(model, manager)
            opt.step()
        world.barrier()
        step_s.append(time.perf_counter() - t0)
        work_s.append(t1 - t0)
    return statistics.median(step_s), statistics.median(work_s)


def _report(prof, path, phase):
    """Print the phase's profile table, write its JSON and plot (rank 0), start afresh."""
    if prof is None:
        return
    stem = path.removesuffix(".json")
    report = prof.to_json(f"{stem}-{phase}.json")
    if prof.manager.rank == 0:
        report.plot(f"{stem}-{phase}.png")
        print(f"{phase} cut: {report.table()}")
    prof.reset()


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = build_parser().parse_args(argv)
    lat, lon = (int(v) for v in args.grid.split("x"))
    manager = mpidp.init(domain_parallel_size=mpidp.DistributedManager.world_from_launcher())
    p, me = manager.domain_world_size, manager.domain_rank
    slow = args.slow % p
    torch.manual_seed(0)
    serial = WeatherUNet(3, 3, (lat, lon), width=4)
    mpidp.broadcast_parameters(serial, manager)
    model = mpidp.convert_to_domain_parallel(serial, manager)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    full = torch.randn(1, 3, lat, lon, generator=torch.Generator().manual_seed(1))
    per_row = args.row_ms / 1e3 * (args.factor if me == slow else 1.0)

    _phase(manager, model, opt, full, 0.0, 2)  # warm-up
    model_s, _ = _phase(manager, model, opt, full, 0.0, args.steps)  # the model alone
    before = manager.spec(lat)
    prof = mpidp.profile(manager) if args.profile else None
    with prof or contextlib.nullcontext():
        balanced_s, work = _phase(manager, model, opt, full, per_row, args.steps, prof)
    _report(prof, args.profile, "balanced")
    seconds = manager.transport().all_gather_object(work)
    manager.set_partition(mpidp.rebalance(manager, seconds, rows=lat), rows=lat)
    after = manager.spec(lat)
    with prof or contextlib.nullcontext():
        rebalanced_s, _ = _phase(manager, model, opt, full, per_row, args.steps, prof)
    _report(prof, args.profile, "rebalanced")
    # the time at which every rank would finish its work together (whole rows aside): the
    # rows over the summed speeds (a rank's speed: its rows over its work seconds)
    speed = sum(n / s for n, s in zip(before.sizes, seconds, strict=True))
    ideal = model_s + lat / speed
    out = {
        "model_s": model_s,
        "balanced_s": balanced_s,
        "rebalanced_s": rebalanced_s,
        "ideal_s": ideal,
    }
    if manager.rank == 0:
        print(
            f"rebalance: WeatherUNet on {lat} x {lon}, {p} domain ranks, rank {slow} "
            f"{args.factor:g}x slower ({args.row_ms:g} ms per row), median of {args.steps} steps"
        )
        print(f"  balanced cut   {list(before.sizes)}: {balanced_s * 1e3:8.1f} ms per step")
        print(f"  rebalanced cut {list(after.sizes)}: {rebalanced_s * 1e3:8.1f} ms per step")
        print(
            f"  ideal (model step {model_s * 1e3:.1f} ms + work / P): {ideal * 1e3:8.1f} ms; "
            f"rebalanced / ideal = {rebalanced_s / ideal:.3f}"
        )
    manager.shutdown()
    return out


if __name__ == "__main__":
    main()
