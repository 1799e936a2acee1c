"""Timing and reporting shared by the benchmarks (not a test; compare ratios within one run)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpi4py import MPI


def run_worker(script: str | Path, ranks: int, args: list[str]) -> dict[str, Any]:
    """Run ``script --worker *args`` under ``mpiexec -n ranks`` (one thread per rank, through
    ``python -m mpi4py`` so one failing rank ends the job) and return the JSON object its
    last line prints."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", str(script), "--worker"]
    out = subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd + args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def round_times(
    fns: dict[str, Callable[[], object]], comm: MPI.Comm, repeats: int
) -> dict[str, list[float]]:
    """Several implementations timed interleaved: every round calls each once (barrier-aligned,
    after one warm-up round), so a slow spell of this shared machine hits all of them alike.
    Per name, this rank's time of each round (seconds)."""
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            comm.Barrier()
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return samples


def timed_round_robin(
    fns: dict[str, Callable[[], object]], comm: MPI.Comm, repeats: int
) -> dict[str, float]:
    """:func:`round_times`' median over the rounds of the slowest rank, in ms."""
    samples = round_times(fns, comm, repeats)
    return {
        name: comm.allreduce(statistics.median(s), op=MPI.MAX) * 1e3 for name, s in samples.items()
    }


def repeats_for(nbytes: int, base: int) -> int:
    """Fewer repeats for large messages, so a run stays within minutes on a laptop."""
    return max(5, base if nbytes < (1 << 22) else base // 4)


def run_table(
    title: str,
    sizes: list[int],
    cases: Callable[[int], dict[str, dict[str, Callable[[], object]]]],
    comm: MPI.Comm,
    repeats: int,
    json_path: str | None,
) -> list[dict[str, Any]]:
    """Time every implementation of every op at every size (interleaved, see
    :func:`timed_round_robin`); rank 0 prints a table (ratio to the first implementation of
    each op, the baseline) and writes JSON."""
    p = comm.Get_size()
    rows = []
    for nbytes in sizes:
        for op, impls in cases(nbytes).items():
            times = timed_round_robin(impls, comm, repeats_for(nbytes, repeats))
            base = next(iter(times.values()))
            for name, ms in times.items():
                rows.append(
                    {
                        "op": op,
                        "bytes": nbytes,
                        "impl": name,
                        "ms": ms,
                        "GB/s": nbytes / ms / 1e6,
                        "ratio_to_raw": ms / base,
                        "ranks": p,
                    }
                )
    if comm.Get_rank() == 0:
        print(title)
        print(f"{'op':<15}{'bytes':>10}  {'impl':<26}{'ms':>10}{'GB/s':>8}{'x raw':>8}")
        for r in rows:
            print(
                f"{r['op']:<15}{r['bytes']:>10}  {r['impl']:<26}{r['ms']:>10.3f}"
                f"{r['GB/s']:>8.2f}{r['ratio_to_raw']:>8.2f}"
            )
        if json_path:
            with open(json_path, "w") as fh:
                json.dump(rows, fh, indent=1)
    return rows
