"""Command line: ``mpidp info`` (also ``python -m mpidp info``).

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
    args = parser.parse_args(argv)
    return _info(args)


if __name__ == "__main__":
    raise SystemExit(main())
