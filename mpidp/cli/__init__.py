"""Check a domain-parallel job before and while it runs: describe the ranks of a launch,
price a model's cut per rank before submitting, trace it op by op, write the sample data.

Run info under the launcher of the job to check, e.g. mpiexec -n 4 mpidp info -d 2: rank 0
prints one table (or, with --json, one JSON document) describing every rank. plan needs no
MPI and no data; neither does explain, which simulates its ranks when no launcher started
them. python -m mpidp is the same command. mpidp SUBCOMMAND --help describes each.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from mpidp.cli import plan as _preflight
from mpidp.cli.parsing import HelpFormatter, Parser, domain_size, exit_once, first_rank

__all__ = ["HelpFormatter", "Parser", "build_parser", "exit_once", "first_rank", "main"]

_COLUMNS = (
    ("rank", "rank"),
    ("local", "local_rank"),
    ("host", "host"),
    ("launcher", "launcher"),
    ("device", "device"),
    ("backend", "backend"),
    ("transport", "transport"),
    ("mesh (dp,domain)", "mesh_coords"),
    ("pid", "pid"),
)


def _table(ranks: list[dict[str, Any]]) -> str:
    rows = [[name for name, _ in _COLUMNS]]
    rows += [
        [str(tuple(r[k])) if isinstance(r[k], list) else str(r[k]) for _, k in _COLUMNS]
        for r in ranks
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    first = ranks[0]
    p_lat, p_lon = first.get("grid", (first["mesh_shape"][1], 1))
    blocks = f" (a {p_lat} x {p_lon} grid of latitude x longitude blocks)" if p_lon > 1 else ""
    head = (
        f"mpidp: {first['world_size']} ranks, mesh dp x domain = "
        f"{first['mesh_shape'][0]} x {first['mesh_shape'][1]}{blocks}, torch {first['torch']}\n"
        f"MPI: {first['mpi_library'] or 'not loaded'}"
    )
    return head + "\n" + "\n".join(lines)


def _info(args: argparse.Namespace) -> int:
    from mpidp.runtime.manager import DistributedManager

    with DistributedManager(
        domain_parallel_size=args.domain_parallel_size,
        backend=args.backend,
        transport=args.transport,
        timeout=args.timeout,
    ) as manager:
        ranks = manager.transport("world", "cpu").all_gather_object(manager.describe())
        if manager.rank == 0:
            if args.json:
                doc = {
                    "world_size": manager.world_size,
                    "mesh": {"dp": manager.dp_world_size, "domain": manager.domain_world_size},
                    "grid": list(manager.grid),
                    "ranks": ranks,
                }
                print(json.dumps(doc, indent=2))
            else:
                print(_table(ranks))
            sys.stdout.flush()
    return 0


_INFO = """Describe every rank of this launch: its host, launcher, device, backend, transport and
place in the (data-parallel, domain) mesh.

Run it under the launcher of the job to check, e.g. mpiexec -n 4 mpidp info -d 2. Rank 0
prints one table, or with --json one JSON document.
"""
_SAMPLE = """Write the built-in synthetic ERA5-like data set to PATH (HDF5 that netCDF-4 reads,
with --format zarr a Zarr store in xarray's layout, with --format anemoi one in anemoi-datasets'
layout): t2m and msl, and z and t on two pressure levels (anemoi: z_500, z_850, t_500, t_850),
6-hourly, each a climatology plus travelling waves. PATH is replaced atomically.
examples/train.py writes it on first use.
"""

_PROFILE = """Print the per-rank table of a profile written by mpidp.profile's to_json: mean
milliseconds per step of each rank's step, compute, communication and waiting for the slowest
peer. --plot writes the same as one stacked bar per rank.
"""


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand (the --help test reads it)."""
    parser = Parser(prog="mpidp", description=__doc__, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, title="subcommands")
    info = sub.add_parser(
        "info",
        help="describe every rank of this launch",
        description=_INFO,
        formatter_class=HelpFormatter,
    )
    info.add_argument(
        "-d",
        "--domain",
        dest="domain_parallel_size",
        type=domain_size,
        default=1,
        metavar="N",
        help="ranks per domain group: N (latitude bands) or LATxLON (a grid of blocks, e.g. 2x2)",
    )
    info.add_argument(  # the spelling of earlier releases, kept for one more (hidden)
        "--domain-parallel-size",
        dest="domain_parallel_size",
        type=int,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
    info.add_argument(
        "--backend",
        default=None,
        help="torch.distributed backend, e.g. gloo or nccl (default: the one for the device)",
    )
    info.add_argument(
        "--transport",
        default="auto",
        choices=("auto", "mpi", "torch"),
        help="how ranks talk: MPI, torch.distributed, or auto (MPI when the launcher is MPI's)",
    )
    info.add_argument(
        "--timeout", type=float, default=120.0, metavar="SECONDS", help="rendezvous timeout"
    )
    info.add_argument("--json", action="store_true", help="print one JSON document, not a table")
    _preflight.add_plan(sub)
    _preflight.add_explain(sub)
    sample = sub.add_parser(
        "sample-data",
        help="write the synthetic ERA5-like sample data to PATH",
        description=_SAMPLE,
        formatter_class=HelpFormatter,
    )
    sample.add_argument(
        "path", help="the file (or, with --format zarr or anemoi, the store) to write"
    )
    sample.add_argument(
        "--lat", type=int, default=91, metavar="N", help="latitude rows, poles included"
    )
    sample.add_argument("--lon", type=int, default=180, metavar="N", help="longitude columns")
    sample.add_argument(
        "--time", type=int, default=64, metavar="N", help="time steps, 6 hours apart"
    )
    sample.add_argument(
        "--seed", type=int, default=0, metavar="N", help="seed of the waves and noise"
    )
    sample.add_argument(
        "--format",
        default="hdf5",
        choices=("hdf5", "zarr", "anemoi"),
        help="hdf5: a netCDF-4 file; zarr: a Zarr store in xarray's layout; anemoi: a Zarr "
        "store in anemoi-datasets' layout, one flattened 'data' array (both need mpidp[zarr])",
    )
    report = sub.add_parser(
        "profile-report",
        help="print the table of a profile mpidp.profile wrote, and plot it",
        description=_PROFILE,
        formatter_class=HelpFormatter,
    )
    report.add_argument("file", metavar="FILE.json", help="the file prof.to_json wrote")
    report.add_argument(
        "--plot",
        metavar="PNG",
        default=None,
        help="also write one bar per rank, split in compute, comm and wait (needs matplotlib)",
    )
    report.add_argument("--json", action="store_true", help="print the mean seconds as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "explain":
        return _preflight.explain(args)
    if args.command == "sample-data":
        return _sample_data(args) if first_rank() else 0
    if args.command == "plan":
        return _preflight.plan(args) if first_rank() else 0
    if args.command == "profile-report":
        return _profile_report(args) if first_rank() else 0
    return _info(args)


def _profile_report(args: argparse.Namespace) -> int:
    from mpidp.errors import MpidpError
    from mpidp.runtime.profile_report import ProfileReport

    try:
        report = ProfileReport.from_json(args.file)
        if args.plot:
            report.plot(args.plot)
    except (OSError, ValueError, KeyError, MpidpError) as err:
        print(f"mpidp profile-report: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report.means(), indent=1) if args.json else report.table())
    return 0


def _sample_data(args: argparse.Namespace) -> int:
    from mpidp.io import make_sample_data, zarr_available
    from mpidp.io.zarr_reader import INSTALL

    if args.format in ("zarr", "anemoi") and not zarr_available():
        print(f"mpidp: --format {args.format} needs zarr>=3: {INSTALL}", file=sys.stderr)
        return 2
    path = make_sample_data(
        args.path,
        n_lat=args.lat,
        n_lon=args.lon,
        n_time=args.time,
        seed=args.seed,
        progress=True,
        format=args.format,
    )
    kind = {"zarr": " (a Zarr store)", "anemoi": " (a Zarr store in anemoi-datasets' layout)"}
    content = "6 variables" if args.format == "anemoi" else "4 variables in 6 channels"
    print(
        f"mpidp: wrote {path}{kind.get(args.format, '')}: {content}, {args.time} times on a "
        f"{args.lat} x {args.lon} grid."
    )
    return 0
