"""What mpidp.profile costs (issue 48): a training step with and without it, interleaved in
one run, and one small collective with and without the timing wrapper.

    mpiexec -n 2 python -m mpi4py bench/profiling.py

The step: the example U-Net (WeatherUNet width 4, float32) on 45 x 32 rows cut in bands,
forward, backward, sync_gradients, SGD; steps alternate profiled / plain so that load on a
shared machine hits both alike. The call: a 1 KB all_reduce through the manager's transport
(the worst case: the wrapper's two clock reads against the cheapest call). Rank 0 prints
medians. Not a test: compare within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mpidp
from mpidp.models import WeatherUNet


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30, help="steps of each kind")
    p.add_argument("--calls", type=int, default=2000, help="all_reduce calls of each kind")
    args = p.parse_args()
    m = mpidp.init(domain_parallel_size=mpidp.DistributedManager.world_from_launcher())
    lat, lon = 45, 32
    torch.manual_seed(0)
    model = mpidp.convert_to_domain_parallel(WeatherUNet(3, 3, (lat, lon), width=4), m)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    spec = m.spec(lat)
    x = torch.randn(1, 3, lat, lon).narrow(-2, spec.start(m.domain_rank), spec[m.domain_rank])
    w = mpidp.latitude_weights(lat, manager=m)

    def step() -> None:
        opt.zero_grad()
        mpidp.global_mean(model(x).square(), w, manager=m).backward()
        mpidp.sync_gradients(model, m)
        opt.step()

    world = m.transport()
    plain: list[float] = []
    prof = mpidp.profile(m)
    for k in range(2 * args.steps + 4):
        on = k % 2 == 1
        world.barrier()
        t0 = time.perf_counter()
        if on:
            with prof, prof.step():
                step()
        else:
            step()
        if k >= 4:  # warm-up
            (prof.step_seconds if on else plain).append(time.perf_counter() - t0)
        elif on:
            prof.reset()
    del prof.step_seconds[: len(prof.step_seconds) - args.steps]
    del prof.comm_seconds[: len(prof.comm_seconds) - args.steps]
    profiled = prof.step_seconds
    per_step = prof.clock.calls / (args.steps + 2)  # the profiled steps, warm-up included
    small = torch.ones(128, dtype=torch.float64)
    calls = {}
    for name in ("plain", "timed") * 3:
        with prof if name == "timed" else contextlib_null():
            t = m.transport()
            world.barrier()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                t.all_reduce(small, "sum")
            calls[name] = (time.perf_counter() - t0) / args.calls
    summary = prof.summary()
    call_cost, step_cost = _added_costs(m)
    if m.rank == 0:
        a, b = statistics.median(plain), statistics.median(profiled)
        print(f"profile overhead, {m.domain_world_size} ranks, medians of {args.steps} steps")
        print(f"  U-Net step plain    {a * 1e3:8.2f} ms")
        print(f"  U-Net step profiled {b * 1e3:8.2f} ms  ({(b - a) / a * 100:+.2f}%)")
        print(
            f"  1 KB all_reduce plain {calls['plain'] * 1e6:.1f} us, timed "
            f"{calls['timed'] * 1e6:.1f} us ({(calls['timed'] - calls['plain']) * 1e6:+.2f} us)"
        )
        print(f"  communication calls per profiled step: {per_step:.0f}")
        added = per_step * call_cost + step_cost
        print(
            f"  added CPU time, measured alone: {call_cost * 1e6:.2f} us per call, "
            f"{step_cost * 1e6:.2f} us per prof.step(): {added * 1e6:.1f} us per step = "
            f"{added / a * 100:.3f}% of the plain step"
        )
        print(summary)
    m.shutdown()


def _added_costs(m: mpidp.DistributedManager, n: int = 100_000) -> tuple[float, float]:
    """What the profile adds, without the noise of a shared machine's communication: the
    timing wrapper around a call that does nothing, and an empty ``prof.step()`` (medians of
    5 rounds of ``n``)."""
    from mpidp.comm.timing import CommClock, TimingTransport

    wrapper = TimingTransport(m.transport(), CommClock())
    noop = lambda: None  # noqa: E731
    bare, timed, steps = [], [], []
    prof = mpidp.profile(m)
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            noop()
        t1 = time.perf_counter()
        for _ in range(n):
            wrapper._timed(noop)
        t2 = time.perf_counter()
        for _ in range(n):
            with prof.step():
                pass
        t3 = time.perf_counter()
        prof.reset()
        bare.append(t1 - t0)
        timed.append(t2 - t1)
        steps.append(t3 - t2)
    call = (statistics.median(timed) - statistics.median(bare)) / n
    return call, statistics.median(steps) / n


def contextlib_null():  # type: ignore[no-untyped-def]
    import contextlib

    return contextlib.nullcontext()


if __name__ == "__main__":
    main()
