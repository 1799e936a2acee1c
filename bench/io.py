"""Sharded I/O benchmark: read throughput and bytes per rank at P = 1, 2, 4, and write
throughput of each write path.

    python bench/io.py --json docs/bench/io.json             # launches the runs
    python bench/io.py --phdf5 --json docs/bench/io-mpio.json  # in .venv-phdf5 (mpio path)

The driver writes the sample data set at a larger grid (361 x 720, 6 channels) once, then
starts ``mpiexec -n P`` for P = 1, 2, 4. In each run every rank reads its band of every time
step ("band", mpidp) and, for comparison, the whole field followed by a slice ("full+slice",
what peers do: every domain rank loads the full sample); then the field is written with each
write path, and with "gather+write" (the band gathered to rank 0, which writes alone). Times
are the slowest rank's, median of the rounds; implementations alternate within a round. The
file is in the page cache after the first round, so read figures are HDF5 and memory costs,
not the disk's. Bytes are counted at the file object (mpidp.testing.counting_opener). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    import h5py
    import numpy as np
    import torch
    from mpi4py import MPI

    import mpidp
    from mpidp.io import ShardedH5Dataset, parallel_hdf5_available, write_sharded
    from mpidp.testing import counting_opener

    world = MPI.COMM_WORLD
    p, me = world.Get_size(), world.Get_rank()
    m = mpidp.init(domain_parallel_size=p)
    ds = ShardedH5Dataset(args.file, manager=m, normalize=None, lead_time=0)
    h, w = ds.grid
    spec = ds.spec
    times = range(ds.n_times)

    def read_band() -> None:
        for t in times:
            ds.read_band(t)

    def read_full() -> None:
        with h5py.File(args.file, "r") as f:
            for t in times:
                full = np.concatenate(
                    [f[n][t][None] if f[n].ndim == 3 else f[n][t] for n in ("msl", "t", "t2m", "z")]
                )
                torch.from_numpy(np.ascontiguousarray(full[:, spec.slice(me)]))

    field = torch.randn(4, len(ds.channels), spec.sizes[me], w)
    out = Path(args.out) / f"bench-{p}.nc"

    def write(method: str):
        def run() -> None:
            write_sharded(out, "x", field, manager=m, method=method)

        return run

    def gather_write() -> None:
        full = mpidp.gather_v(field, spec.sizes, -2, 0, m) if p > 1 else field
        if me == 0:
            tmp = out.with_suffix(".tmp")
            with h5py.File(tmp, "w") as f:
                f.create_dataset("x", data=full.numpy())
            os.replace(tmp, out)
        world.Barrier()

    reads = {"band (mpidp)": read_band, "full+slice": read_full}
    writes = {"ordered": write("ordered"), "gather+write": gather_write}
    if parallel_hdf5_available():
        writes["mpio"] = write("mpio")
    timings: dict[str, list[float]] = {k: [] for k in [*reads, *writes]}
    for _ in range(args.rounds):
        for name, fn in [*reads.items(), *writes.items()]:
            world.Barrier()
            start = time.perf_counter()
            fn()
            world.Barrier()
            timings[name].append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
    log: list = []
    counted = ShardedH5Dataset(
        args.file, manager=m, normalize=None, lead_time=0, opener=counting_opener(log)
    )
    before = len(log)
    counted.read_band(0)
    per_rank = world.allgather(sum(f.bytes_read for f in log[before:]))
    counted.close()
    ds.close()
    field_bytes = len(ds.channels) * h * w * 4
    if me == 0:
        med = {k: statistics.median(v) for k, v in timings.items()}
        print(
            json.dumps(
                {
                    "P": p,
                    "grid": [h, w],
                    "channels": len(ds.channels),
                    "times_read": len(times),
                    "seconds": med,
                    "read_GBps": {k: field_bytes * len(times) / med[k] / 1e9 for k in reads},
                    "write_GBps": {k: 4 * field_bytes / med[k] / 1e9 for k in writes},
                    "bytes_per_rank_one_step": per_rank,
                    "field_bytes_one_step": field_bytes,
                    "mpi": MPI.Get_library_version().splitlines()[0],
                }
            )
        )
    m.shutdown()


def driver(args: argparse.Namespace) -> None:
    import tempfile

    from mpidp.io import make_sample_data

    venv = ROOT / (".venv-phdf5" if args.phdf5 else ".venv")
    python = str(venv / "bin" / "python")
    mpiexec = "/usr/bin/mpiexec.mpich" if args.phdf5 else str(ROOT / ".venv" / "bin" / "mpiexec")
    results = []
    with tempfile.TemporaryDirectory(prefix="mpidp-bench-io-") as tmp:
        data = Path(tmp) / "sample.h5"
        make_sample_data(data, n_lat=args.grid[0], n_lon=args.grid[1], n_time=args.times)
        for p in args.ranks:
            cmd = [
                mpiexec,
                "-n",
                str(p),
                python,
                "-m",
                "mpi4py",
                __file__,
                "--worker",
                "--file",
                str(data),
                "--out",
                tmp,
                "--rounds",
                str(args.rounds),
            ]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
            if run.returncode:
                sys.exit(f"P={p} failed:\n{run.stdout}\n{run.stderr}")
            results.append(json.loads(run.stdout.strip().splitlines()[-1]))
    names_r = list(results[0]["seconds"])
    print(
        f"grid {results[0]['grid']}, {results[0]['channels']} channels, "
        f"{results[0]['times_read']} time steps read; {results[0]['mpi']}"
    )
    print(f"{'P':>2} {'what':<14} {'seconds':>8} {'GB/s':>6} {'vs P=1':>7}")
    base = results[0]["seconds"]
    for r in results:
        for k in names_r:
            gbps = r["read_GBps"].get(k) or r["write_GBps"].get(k)
            print(
                f"{r['P']:>2} {k:<14} {r['seconds'][k]:>8.3f} {gbps:>6.2f} "
                f"{base[k] / r['seconds'][k]:>6.2f}x"
            )
        share = [b / r["field_bytes_one_step"] for b in r["bytes_per_rank_one_step"]]
        print(
            f"{r['P']:>2} bytes read per rank, one step: {r['bytes_per_rank_one_step']} "
            f"(fraction of the field: {', '.join(f'{s:.3f}' for s in share)})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--grid", type=int, nargs=2, default=(361, 720))
    ap.add_argument("--times", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--phdf5", action="store_true", help="run in .venv-phdf5 (mpio writes)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
