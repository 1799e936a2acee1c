"""Sharded I/O benchmark: read throughput and bytes per rank at P = 1, 2, 4, and write
throughput of each write path.

    python bench/io.py --json docs/bench/io.json             # launches the runs
    python bench/io.py --phdf5 --json docs/bench/io-mpio.json  # in .venv-phdf5 (mpio path)

The driver writes the sample data set at a larger grid (361 x 720, 6 channels) once, then
starts ``mpiexec -n P`` for P = 1, 2, 4. In each run every rank reads its band of every time
step ("band", mpidp) and, for comparison, the whole field followed by a slice ("full+slice",
what peers do: every domain rank loads the full sample); then the field is written with each
write path, with "gather+write" (the band gathered to rank 0, which writes alone), and as a
Zarr store (every rank writing its own chunks; a band per chunk, and 32-row chunks). Times
are the slowest rank's, median of the rounds; implementations alternate within a round. The
file is in the page cache after the first round, so read figures are HDF5 and memory costs,
not the disk's. Bytes are counted at the file object (mpidp.testing.counting_opener). Not a test.

    python bench/io.py --zarr --dir /tmp/zarr-bench --json docs/bench/io-zarr.json

``--zarr`` measures the Zarr reader instead (:func:`zarr_worker`): a 721 x 1440 field of 20
variables, float32, stored twice (chunks of 181 latitude rows, aligned to the bands of a
chunk-aligned partition at P = 1, 2, 4; and chunks of 32 rows with the balanced partition),
and the same values in netCDF-4. Per item: ShardedZarrDataset against the whole field read with
xarray and sliced, and against ShardedH5Dataset; the bytes each rank fetched from the store
against its rows; and a training-like loop with and without mpidp.io.prefetch.Prefetcher.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: the Zarr benchmark's field: ERA5's 0.25 degree grid, 20 single-level variables
ZARR_GRID, ZARR_VARIABLES, FIXED_ROWS = (721, 1440), [f"v{i:02d}" for i in range(20)], 32


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

    def write_zarr(rows: int | None):
        def run() -> None:
            write_sharded(out.with_suffix(".zarr"), "x", field, manager=m, chunk_rows=rows)

        return run

    reads = {"band (mpidp)": read_band, "full+slice": read_full}
    writes = {"ordered": write("ordered"), "gather+write": gather_write}
    writes["zarr"] = write_zarr(None)  # a band per chunk: bands of equal height move nothing
    writes["zarr, 32-row chunks"] = write_zarr(32)  # boundary rows move to their chunk's owner
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


# -- Zarr ---------------------------------------------------------------------------------------


def aligned_sizes(rows: int, chunk: int, parts: int) -> list[int]:
    """A partition of ``rows`` over ``parts`` ranks whose cuts fall on chunk boundaries
    (whole chunks per rank, the spare ones to the first ranks)."""
    chunks = -(-rows // chunk)
    if chunks < parts:
        raise SystemExit(f"{chunks} chunks of {chunk} rows cannot be shared by {parts} ranks")
    per = [chunks // parts + (r < chunks % parts) for r in range(parts)]
    stops = [min(sum(per[: r + 1]) * chunk, rows) for r in range(parts)]
    return [b - a for a, b in zip([0, *stops[:-1]], stops, strict=True)]


def write_zarr_data(folder: Path, times: int, aligned_rows: int) -> dict[str, Path]:
    """The field as xarray writes it: two Zarr stores (format 3, uncompressed, one time step
    per chunk; ``aligned_rows`` and 32 latitude rows per chunk) and a netCDF-4 file (contiguous).
    Smooth fields plus noise, deterministic. Skipped where they exist."""
    import numpy as np
    import xarray as xr

    h, w = ZARR_GRID
    files = {
        "aligned": folder / f"field-c{aligned_rows}.zarr",
        "fixed": folder / f"field-c{FIXED_ROWS}.zarr",
        "netcdf": folder / "field.nc",
    }
    if all(f.exists() for f in files.values()):
        return files
    rng = np.random.default_rng(0)
    lat = np.linspace(90.0, -90.0, h)
    lon = np.arange(w) * (360.0 / w)
    shape = np.cos(np.deg2rad(lat))[:, None] * np.sin(np.deg2rad(lon))[None, :]
    data = {
        v: (
            ("time", "latitude", "longitude"),
            (k + shape[None] * (1 + 0.1 * np.arange(times))[:, None, None]).astype(np.float32)
            + rng.standard_normal((times, h, w), dtype=np.float32) * 0.01,
        )
        for k, v in enumerate(ZARR_VARIABLES)
    }
    ds = xr.Dataset(
        data, coords={"time": np.arange(times) * 6.0, "latitude": lat, "longitude": lon}
    )
    for key, rows in (("aligned", aligned_rows), ("fixed", FIXED_ROWS)):
        encoding = {v: {"chunks": (1, rows, w), "compressors": None} for v in ZARR_VARIABLES}
        ds.to_zarr(files[key], mode="w", zarr_format=3, encoding=encoding, consolidated=False)
    ds.to_netcdf(files["netcdf"], engine="h5netcdf")
    return files


def wrapped_group(path: Path, log: list[int] | None = None, latency: float = 0.0) -> Any:
    """The store at ``path`` opened through a wrapper that appends the size of every value it
    returns to ``log`` (what the reader fetched) and waits ``latency`` seconds before each
    request (a remote store's round trip; Zarr sends a read's requests concurrently)."""
    import asyncio

    import zarr
    from zarr.storage import LocalStore, WrapperStore

    sizes = [] if log is None else log

    class Wrapped(WrapperStore[Any]):
        def _with_store(self, store: Any) -> Wrapped:
            return Wrapped(store)

        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            if latency:
                await asyncio.sleep(latency)
            buf = await self._store.get(key, prototype, byte_range)
            sizes.append(0 if buf is None else len(buf))
            return buf

        async def get_partial_values(self, prototype: Any, key_ranges: Any) -> Any:
            if latency:
                await asyncio.sleep(latency)
            bufs = await self._store.get_partial_values(prototype, key_ranges)
            sizes.extend(0 if b is None else len(b) for b in bufs)
            return bufs

    return zarr.open_group(Wrapped(LocalStore(path, read_only=True)), mode="r")


def zarr_worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import xarray as xr
    from common import timed_round_robin
    from mpi4py import MPI
    from torch.utils.data import DataLoader, Subset

    import mpidp
    from mpidp.io import ShardedH5Dataset, ShardedZarrDataset
    from mpidp.io.prefetch import Prefetcher

    world = MPI.COMM_WORLD
    p, me = world.Get_size(), world.Get_rank()
    m = mpidp.init(domain_parallel_size=p)
    files = {k: Path(v) for k, v in json.loads(args.files).items()}
    h, w = ZARR_GRID
    row_bytes = w * 4 * len(ZARR_VARIABLES)
    aligned = aligned_sizes(h, args.aligned_rows, p)
    opts: dict[str, Any] = dict(manager=m, normalize=None, lead_time=1)
    zarr_aligned = ShardedZarrDataset(files["aligned"], spec=aligned, **opts)
    zarr_fixed = ShardedZarrDataset(files["fixed"], **opts)
    h5 = ShardedH5Dataset(files["netcdf"], **opts)
    full = xr.open_zarr(files["aligned"], chunks=None, decode_times=False, consolidated=False)
    lo, hi = zarr_fixed.rows

    def items(ds: Any) -> Callable[[], None]:
        def run() -> None:
            for i in range(len(ds)):
                ds[i]

        return run

    def full_slice() -> None:
        for i in range(len(zarr_fixed)):
            for t in (i, i + 1):  # the item's input and target times
                field = full.isel(time=t).load()
                band = np.stack([field[v].values[lo:hi] for v in ZARR_VARIABLES])
                torch.from_numpy(band)

    impls: dict[str, Callable[[], object]] = {
        f"zarr, {args.aligned_rows}-row chunks, aligned bands": items(zarr_aligned),
        f"zarr, {FIXED_ROWS}-row chunks": items(zarr_fixed),
        "netCDF-4 (ShardedH5Dataset)": items(h5),
        "xarray whole field + slice": full_slice,
    }
    ms = timed_round_robin(impls, world, args.rounds)
    item_bytes = world.allreduce(2 * (hi - lo) * row_bytes, op=MPI.MAX)

    fetched = []
    for name, key, spec in (
        (f"{args.aligned_rows}-row chunks, aligned bands", "aligned", aligned),
        (f"{args.aligned_rows}-row chunks, balanced bands", "aligned", None),
        (f"{FIXED_ROWS}-row chunks, balanced bands", "fixed", None),
    ):
        for halo in (0, 1):
            log: list[int] = []
            group = wrapped_group(files[key], log)
            ds = ShardedZarrDataset(group, spec=spec, halo=halo, **opts)
            log.clear()
            ds.read_band(1)
            a, b = max(ds.rows[0], 0), min(ds.rows[1], h)
            got = world.allgather((sum(log), (b - a) * row_bytes))
            fetched.append(
                {
                    "case": name,
                    "halo": halo,
                    "bytes": [g for g, _ in got],
                    "ideal": [i for _, i in got],
                    "ratio": [g / i for g, i in got],
                }
            )
    remote = ShardedZarrDataset(
        wrapped_group(files["aligned"], latency=args.latency / 1e3), spec=aligned, **opts
    )
    prefetch = {
        where: measure_prefetch(ds, args.steps, args.rounds, world, Prefetcher, DataLoader, Subset)
        for where, ds in (
            ("local store", zarr_aligned),
            (f"{args.latency:g} ms per request", remote),
        )
    }
    for opened in (zarr_aligned, zarr_fixed, h5, remote):
        opened.close()
    full.close()
    if me == 0:
        print(
            json.dumps(
                {
                    "P": p,
                    "cores": len(os.sched_getaffinity(0)),
                    "grid": list(ZARR_GRID),
                    "channels": len(ZARR_VARIABLES),
                    "items": len(zarr_fixed),
                    "aligned_sizes": aligned,
                    "balanced_sizes": list(zarr_fixed.spec.sizes),
                    "ms_per_pass": ms,
                    "item_bytes_per_rank": item_bytes,
                    "MBps_per_rank": {
                        k: item_bytes * len(zarr_fixed) / v / 1e3 for k, v in ms.items()
                    },
                    "fetched": fetched,
                    "prefetch": prefetch,
                    "mpi": MPI.Get_library_version().splitlines()[0],
                }
            )
        )
    m.shutdown()


def measure_prefetch(
    ds: Any, steps: int, rounds: int, world: Any, prefetcher: Any, loader: Any, subset: Any
) -> dict[str, Any]:
    """A training-like loop of ``steps`` steps, each reading an item and computing on it for
    about as long as the read takes in such a loop (a matmul loop on the rank's band), run
    three ways: the compute alone, read then compute, and read through a Prefetcher,
    alternating within each of ``rounds`` rounds. Slowest rank, median, in ms per step;
    ``hidden`` is the share of the read time the Prefetcher hid (at most about compute /
    read, less the first read, which nothing hides)."""
    import torch
    from mpi4py import MPI

    order = subset(ds, [i % len(ds) for i in range(steps)])
    x0, _ = ds[0]
    weights = torch.randn(x0.shape[-1], 64)

    def compute(x: torch.Tensor, repeats: int) -> None:
        a = x.flatten(0, 1)
        for _ in range(repeats):
            torch.mm(a, weights)

    def timed(fn: Callable[[], object]) -> float:
        world.Barrier()
        start = time.perf_counter()
        fn()
        world.Barrier()
        return world.allreduce(time.perf_counter() - start, op=MPI.MAX)

    def read_only() -> None:
        for _ in loader(order, batch_size=None):
            pass

    read = statistics.median(timed(read_only) for _ in range(3)) / steps
    one = statistics.median(timed(lambda: compute(x0, 5)) for _ in range(3)) / 5
    repeats = world.allreduce(max(1, round(read / one)), op=MPI.MAX)

    def plain() -> None:
        for x, _ in loader(order, batch_size=None):
            compute(x, repeats)

    def prefetched() -> None:
        for x, _ in prefetcher(loader(order, batch_size=None), depth=2):
            compute(x, repeats)

    def compute_only() -> None:
        for _ in range(steps):
            compute(x0, repeats)

    loops = {"compute only": compute_only, "read + compute": plain, "prefetched": prefetched}
    out: dict[str, list[float]] = {k: [] for k in loops}
    for _ in range(rounds):
        for name, fn in loops.items():
            out[name].append(timed(fn))
    med = {k: statistics.median(v) * 1e3 / steps for k, v in out.items()}
    read_ms = med["read + compute"] - med["compute only"]
    return {
        "steps": steps,
        "matmuls_per_step": repeats,
        "read_alone_ms_per_step": read * 1e3,
        "ms_per_step": med,
        "read_ms_per_step": read_ms,
        "hidden": (med["read + compute"] - med["prefetched"]) / read_ms if read_ms > 0 else 0.0,
    }


def zarr_driver(args: argparse.Namespace) -> None:
    from common import run_worker

    folder = Path(args.dir or "/tmp/mpidp-bench-io-zarr")
    folder.mkdir(parents=True, exist_ok=True)
    files = write_zarr_data(folder, args.times, args.aligned_rows)
    results = []
    for p in args.ranks:
        worker_args = ["--zarr", "--files", json.dumps({k: str(v) for k, v in files.items()})]
        worker_args += ["--rounds", str(args.rounds), "--steps", str(args.steps)]
        worker_args += ["--aligned-rows", str(args.aligned_rows), "--latency", str(args.latency)]
        results.append(run_worker(__file__, p, worker_args))
    report_zarr(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


def report_zarr(results: list[dict[str, Any]]) -> None:
    r0 = results[0]
    h, w = r0["grid"]
    print(
        f"Zarr: {h} x {w} x {r0['channels']} float32 ({h * w * r0['channels'] * 4 / 1e6:.0f} MB "
        f"a time step), {r0['items']} items (input + target time) per pass; {r0['mpi']}"
    )
    print(f"{'P':>2} {'what':<37} {'ms/pass':>8} {'MB/s/rank':>10} {'whole/this':>10}")
    for r in results:
        note = (
            f" (oversubscribed: {r['P']} ranks on {r['cores']} cores)"
            if r["P"] > r["cores"]
            else ""
        )
        print(f"-- P = {r['P']}{note}; bands {r['aligned_sizes']} / {r['balanced_sizes']}")
        whole = r["ms_per_pass"]["xarray whole field + slice"]
        for k, v in r["ms_per_pass"].items():
            rate = r["MBps_per_rank"][k]
            print(f"{r['P']:>2} {k:<37} {v:>8.1f} {rate:>10.0f} {whole / v:>9.2f}x")
        for f in r["fetched"]:
            ratios = ", ".join(f"{x:.3f}" for x in f["ratio"])
            print(f"{r['P']:>2} fetched/ideal, {f['case']}, halo {f['halo']}: {ratios}")
        for where, pf in r["prefetch"].items():
            steps = ", ".join(f"{k} {v:.1f}" for k, v in pf["ms_per_step"].items())
            print(
                f"{r['P']:>2} prefetch ({where}), {pf['steps']} steps, ms/step: {steps}; read "
                f"{pf['read_ms_per_step']:.1f} ms/step, {100 * pf['hidden']:.0f}% of it hidden"
            )


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
    ap.add_argument("--zarr", action="store_true", help="benchmark the Zarr reader instead")
    ap.add_argument("--dir", help="--zarr: where the data goes (kept for the next run)")
    ap.add_argument("--aligned-rows", type=int, default=181, help="--zarr: aligned chunk rows")
    ap.add_argument("--steps", type=int, default=16, help="--zarr: steps of the prefetch loop")
    ap.add_argument(
        "--latency", type=float, default=5.0, help="--zarr: ms per request of the remote-like store"
    )
    ap.add_argument("--files", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.zarr:
        if "--times" not in sys.argv:
            args.times = 3
        zarr_worker(args) if args.worker else zarr_driver(args)
    else:
        worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
