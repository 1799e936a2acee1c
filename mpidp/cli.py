"""Command line: ``mpidp info``, ``mpidp plan``, ``mpidp explain`` and ``mpidp sample-data PATH``
(also ``python -m mpidp ...``).

Run it under the launcher of the job to check, e.g. ``mpiexec -n 4 mpidp info -d 2``: rank 0
prints one table (or, with ``--json``, one JSON document) describing every rank.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

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
    head = (
        f"mpidp: {first['world_size']} ranks, mesh dp x domain = "
        f"{first['mesh_shape'][0]} x {first['mesh_shape'][1]}, torch {first['torch']}\n"
        f"MPI: {first['mpi_library'] or 'not loaded'}"
    )
    return head + "\n" + "\n".join(lines)


def _info(args: argparse.Namespace) -> int:
    from mpidp.manager import DistributedManager

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
                    "ranks": ranks,
                }
                print(json.dumps(doc, indent=2))
            else:
                print(_table(ranks))
            sys.stdout.flush()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpidp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="describe every rank of this launch")
    info.add_argument(
        "-d",
        "--domain-parallel-size",
        type=int,
        default=1,
        help="ranks per domain group (default 1)",
    )
    info.add_argument("--backend", default=None, help="torch.distributed backend (default: auto)")
    info.add_argument("--transport", default="auto", choices=("auto", "mpi", "torch"))
    info.add_argument("--timeout", type=float, default=120.0, help="rendezvous timeout, seconds")
    info.add_argument("--json", action="store_true", help="print one JSON document")
    sample = sub.add_parser(
        "sample-data", help="write the built-in synthetic ERA5-like data set to PATH"
    )
    sample.add_argument("path", help="the HDF5/netCDF-4 file to write (replaced atomically)")
    sample.add_argument("--lat", type=int, default=91, help="latitude rows, poles included")
    sample.add_argument("--lon", type=int, default=180, help="longitude columns")
    sample.add_argument("--time", type=int, default=64, help="time steps, 6 hours apart")
    sample.add_argument("--seed", type=int, default=0)
    plan = sub.add_parser(
        "plan",
        help="per-rank rows, halo rows per layer, halo bytes per step and activation memory "
        "of a model on a grid, before submitting (no MPI, no data)",
    )
    plan.add_argument(
        "--grid", default="721x1440", help="LATxLON or TIMExLATxLON (5-D input; default 721x1440)"
    )
    plan.add_argument("-d", "--domain", type=int, default=4, help="domain ranks (default 4)")
    plan.add_argument(
        "--model",
        default="unet",
        help="an example model (unet, resblock, patch, afno, fno, swin, graph) or module:factory "
        "(default unet)",
    )
    plan.add_argument("--channels", type=int, default=6, help="input channels (default 6)")
    plan.add_argument("--batch", type=int, default=1, help="samples per rank (default 1)")
    plan.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float64", "bfloat16"),
        help="activation dtype: sets the bytes priced (default float32)",
    )
    plan.add_argument(
        "--partition", default="balanced", help="balanced or weighted:w0,w1,... (one per rank)"
    )
    plan.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="SHAPE",
        help="a further input of the model's forward, e.g. 1x3x721x1440 (repeatable)",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON document")
    explain = sub.add_parser(
        "explain",
        help="run a model once on meta ShardedTensors over N ranks and print, per module path, "
        "each op's result layout and bytes sent, and the first op that would be refused",
    )
    explain.add_argument(
        "--model",
        default="unet",
        help="an example model (unet, resblock, patch, afno, fno, swin, graph) or module:factory "
        "(called with whichever of in_channels, out_channels, channels, grid it takes; "
        "default unet)",
    )
    explain.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="SHAPE",
        help="an input of the model's forward, e.g. 1x6x721x1440; the first is cut into bands; "
        "repeatable (default 1x6x91x180)",
    )
    explain.add_argument(
        "--dim", type=int, default=-2, help="the dim of the first input cut into bands (-2)"
    )
    explain.add_argument(
        "-n",
        "--ranks",
        type=int,
        default=2,
        help="domain ranks (default 2; under a launcher: the job's ranks)",
    )
    explain.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float64", "bfloat16"),
        help="dtype of the model and its inputs: sets the bytes counted (default float32)",
    )
    explain.add_argument(
        "--json", action="store_true", help="print one JSON document (default: a table)"
    )
    args = parser.parse_args(argv)
    if args.command == "explain":
        return _explain(args, list(argv) if argv is not None else sys.argv[1:])
    if args.command == "sample-data":
        return _sample_data(args)
    if args.command == "plan":
        return _plan(args)
    return _info(args)


def _plan(args: argparse.Namespace) -> int:
    import torch

    from mpidp.errors import MpidpError
    from mpidp.plan import build_model, parse_partition, plan_model, to_json

    try:
        grid = tuple(int(v) for v in args.grid.lower().split("x"))
        extra = [tuple(int(v) for v in shape.lower().split("x")) for shape in args.input]
        if len(grid) not in (2, 3):
            raise ValueError
    except ValueError:
        print(
            f"mpidp plan: --grid {args.grid!r} / --input {args.input}: use LATxLON or "
            f"TIMExLATxLON, and full shapes like 1x3x721x1440 for --input",
            file=sys.stderr,
        )
        return 2
    try:
        model = build_model(args.model, args.channels, grid)  # type: ignore[arg-type]
        result = plan_model(
            model,
            (args.batch, args.channels, *grid),
            args.domain,
            partition=parse_partition(args.partition, args.domain),
            dtype=getattr(torch, args.dtype),
            extra_inputs=extra,
        )
    except MpidpError as err:
        print(f"mpidp plan: {err}", file=sys.stderr)
        return 2
    print(to_json(result) if args.json else result)
    return 1 if result.report.problems else 0


def _explain(args: argparse.Namespace, argv: list[str]) -> int:
    import os
    import shutil
    import subprocess

    import torch

    from mpidp.errors import MpidpError
    from mpidp.manager import DistributedManager

    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shape or ["1x6x91x180"]]
        if len(shapes[0]) < 3:
            raise ValueError
    except ValueError:
        print(
            f"mpidp explain: --shape {args.shape}: use full shapes like 1x6x721x1440",
            file=sys.stderr,
        )
        return 2
    world = DistributedManager.world_from_launcher()
    if world == 1 and args.ranks > 1:  # start the ranks: this environment's MPI, or PATH's
        here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        mpiexec = here if os.path.exists(here) else shutil.which("mpiexec")
        if mpiexec is None:
            print(
                "mpidp explain: no mpiexec next to this Python or on PATH; run it under "
                f"your launcher: mpiexec -n {args.ranks} mpidp explain ...",
                file=sys.stderr,
            )
            return 2
        cmd = [mpiexec, "-n", str(args.ranks), sys.executable, "-m", "mpi4py", "-m", "mpidp", *argv]
        return subprocess.run(cmd, check=False).returncode
    from mpidp.explain import explain
    from mpidp.plan import build_model

    dtype = getattr(torch, args.dtype)
    with DistributedManager(domain_parallel_size=world) as manager:
        try:
            model = build_model(args.model, shapes[0][1], shapes[0][2:])  # type: ignore[arg-type]
            result = explain(model.to(dtype), *shapes, dim=args.dim, manager=manager, dtype=dtype)
        except MpidpError as err:
            if manager.rank == 0:
                print(f"mpidp explain: {err}", file=sys.stderr)
            return 2
        if manager.rank == 0:
            print(result.to_json() if args.json else result)
            sys.stdout.flush()
    return 1 if result.refused else 0


def _sample_data(args: argparse.Namespace) -> int:
    from mpidp.io import make_sample_data

    path = make_sample_data(
        args.path, n_lat=args.lat, n_lon=args.lon, n_time=args.time, seed=args.seed
    )
    print(f"mpidp: wrote {path} ({args.time} x {args.lat} x {args.lon}, 4 variables, 6 channels)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
