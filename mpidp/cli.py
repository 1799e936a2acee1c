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
from typing import Any, NoReturn

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


def _domain_size(text: str) -> int | tuple[int, int]:
    """``-d 4`` (bands) or ``-d 2x2`` (a grid of blocks: latitude x longitude ranks)."""
    from mpidp.errors import ConfigError
    from mpidp.runtime.grid import parse_domain

    try:
        return parse_domain(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


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


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Descriptions as written, and every option's default after its help, unless the help
    already names it or it is None, False, empty (the help says what those mean). mpidp's
    commands and the examples use it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        empty = action.default is None or action.default is False or action.default in ("", [])
        if empty or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


_MODELS = "unet, resblock, patch, afno, fno, swin, graph"
_INFO = """Describe every rank of this launch: its host, launcher, device, backend, transport and
place in the (data-parallel, domain) mesh.

Run it under the launcher of the job to check, e.g. mpiexec -n 4 mpidp info -d 2. Rank 0
prints one table, or with --json one JSON document.
"""
_PLAN = """Price a domain-parallel run of a model on a grid before submitting it: per rank, the
rows it owns, the halo rows every layer fetches, the bytes its halo exchanges move in one
training step and the activation memory its bands hold. -d LATxLON (e.g. 4x8) prices blocks:
rows and columns per rank, halo rows and columns (corners and the polar fold included). Both
forms end with the halo bytes of bands and of every block shape of as many ranks, and say
which moves the fewest.

No MPI and no data: shape arithmetic on meta tensors, and every rank's forward simulated on
meta ShardedTensors. Exits 1 when the model cannot be cut this way (the problems are printed).
Big models show their stages on stderr.

--scaling instead predicts the busiest rank's step time (compute, communication, the fixed
cost of the calls), its speed-up and efficiency and its memory at P = 1, 2, 4, ... up to
1024 (bands up to the grid's rows; then blocks, the shape of each P that moves the fewest
halo bytes) from the model's serial step (timed here, or --step-seconds) and a
latency/bandwidth model of the network (--network, or --alpha and --beta);
bench/scaling_model.py measures this machine's and checks the predictions against real steps.
"""
_EXPLAIN = """Run a model's forward once on meta tensors cut over N domain ranks and print, per
module path, each op's result layout and the bytes it sends, and the first op mpidp would
refuse, with its fix.

Without a launcher it simulates its N ranks in turn in this one process (no MPI needed: each
rank's forward on its meta band, collectives answering with shapes; the same table a job of N
ranks prints); under a launcher it uses the job's ranks and rank 0 prints. Exits 1 when an op
is refused.
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
        type=_domain_size,
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
    plan = sub.add_parser(
        "plan",
        help="price a model's cut per rank, before submitting",
        description=_PLAN,
        formatter_class=HelpFormatter,
    )
    plan.add_argument("--grid", default="721x1440", help="LATxLON, or TIMExLATxLON for a 5-D input")
    plan.add_argument(
        "-d",
        "--domain",
        type=_domain_size,
        default=4,
        metavar="N|LATxLON",
        help="domain ranks: N latitude bands, or LATxLON blocks (e.g. 4x8)",
    )
    plan.add_argument(
        "--model",
        default="unet",
        metavar="NAME",
        help=f"an example model ({_MODELS}) or module:factory",
    )
    plan.add_argument("--channels", type=int, default=6, metavar="N", help="input channels")
    plan.add_argument("--batch", type=int, default=1, metavar="N", help="samples per rank")
    plan.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float64", "bfloat16"),
        help="activation dtype: sets the bytes priced",
    )
    plan.add_argument(
        "--partition",
        default="balanced",
        metavar="RULE",
        help="how rows are split: balanced, or weighted:w0,w1,... with one weight per rank",
    )
    plan.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="SHAPE",
        help="a further input of the model's forward, e.g. 1x3x721x1440 (repeatable)",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON document, not a table")
    plan.add_argument(
        "--scaling", action="store_true", help="predict the step at P = 1 to 1024 (see above)"
    )
    plan.add_argument(
        "--network",
        default="infiniband-hdr",
        choices=("infiniband-hdr", "slingshot", "ethernet-25g"),
        help="with --scaling: the interconnect's assumed latency and bandwidth",
    )
    plan.add_argument("--alpha", type=float, default=None, help="with --scaling: seconds/message")
    plan.add_argument("--beta", type=float, default=None, help="with --scaling: bytes/second")
    plan.add_argument(
        "--step-seconds",
        type=float,
        default=None,
        metavar="S",
        help="with --scaling: the serial forward + backward (default: timed here once)",
    )
    plan.add_argument(
        "--fixed",
        type=float,
        default=0.0,
        metavar="S",
        help="with --scaling: what the front end adds to every step (bench/scaling_model.py)",
    )
    plan.add_argument(
        "--per-call",
        type=float,
        default=3e-4,
        metavar="S",
        help="with --scaling: a converted layer's call over torch's (bench/percall.py)",
    )
    explain = sub.add_parser(
        "explain",
        help="trace a model op by op over N ranks, on meta tensors",
        description=_EXPLAIN,
        formatter_class=HelpFormatter,
    )
    explain.add_argument(
        "--model",
        default="unet",
        metavar="NAME",
        help=f"an example model ({_MODELS}) or module:factory, called with whichever of "
        "in_channels, out_channels, channels and grid it takes",
    )
    explain.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="SHAPE",
        help="an input of the model's forward, e.g. 1x6x721x1440; the first is cut into bands; "
        "repeatable (default: 1x6x91x180)",
    )
    explain.add_argument(
        "--dim", type=int, default=-2, help="the dimension of the first input cut into bands"
    )
    explain.add_argument(
        "-d",
        "--domain",
        dest="ranks",
        type=int,
        default=2,
        metavar="N",
        help="domain ranks; under a launcher, the job's ranks",
    )
    # the spellings of earlier releases, kept for one more (not shown by --help)
    explain.add_argument(
        "-n", "--ranks", dest="ranks", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    explain.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "float64", "bfloat16"),
        help="dtype of the model and its inputs: sets the bytes counted",
    )
    explain.add_argument("--json", action="store_true", help="print one JSON document, not a table")
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
        return _explain(args)
    if args.command == "sample-data":
        return _sample_data(args) if first_rank() else 0
    if args.command == "plan":
        return _plan(args) if first_rank() else 0
    if args.command == "profile-report":
        return _profile_report(args) if first_rank() else 0
    return _info(args)


def first_rank() -> bool:
    """Whether this process is rank 0 of its launch, or started alone (from the launcher's
    variables: no MPI, no communication). plan and sample-data need no MPI, so under a
    launcher the other ranks do nothing (and print nothing)."""
    import os

    from mpidp.errors import MpidpError
    from mpidp.runtime.bootstrap import detect_launch

    try:
        return detect_launch(dict(os.environ)).rank == 0
    except MpidpError:  # an inconsistent environment: info says why; here, carry on
        return True


def exit_once(message: str, code: int = 2) -> NoReturn:
    """End a command-line program on a mistake every rank sees alike (an argument, a missing
    file): ``message`` printed once, by the launch's first rank, and exit ``code`` on every
    rank, with no traceback. Not for errors one rank may meet alone (those abort the job)."""
    if first_rank():
        print(message, file=sys.stderr, flush=True)
    raise SystemExit(code)


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are printed once under a launcher (by its first
    rank; every rank exits 2)."""

    def error(self, message: str) -> NoReturn:
        if first_rank():
            self.print_usage(sys.stderr)
        exit_once(f"{self.prog}: error: {message}", 2)


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


def _plan(args: argparse.Namespace) -> int:
    import torch

    from mpidp.errors import MpidpError
    from mpidp.preflight.plan import build_model, parse_partition, plan_model, to_json
    from mpidp.runtime.progress import Progress

    try:
        grid = tuple(int(v) for v in args.grid.lower().split("x"))
        extra = [tuple(int(v) for v in shape.lower().split("x")) for shape in args.input]
        if len(grid) not in (2, 3):
            raise ValueError
    except ValueError:
        print(
            f"mpidp plan: cannot read --grid {args.grid}"
            + "".join(f" or --input {shape}" for shape in args.input)
            + ": use LATxLON or TIMExLATxLON for --grid and full shapes like 1x3x721x1440 "
            "for --input",
            file=sys.stderr,
        )
        return 2
    if args.scaling:
        return _scaling(args, grid)
    # three stages, shown on stderr (stdout holds the result) once they take over 2 s
    stages = Progress(
        3, label="stage", prefix="mpidp plan: ", rate=False, every=1, stream=sys.stderr, delay=2
    )
    try:
        with stages:
            stages.advance(f"building the {args.model} model")
            model = build_model(args.model, args.channels, grid)  # type: ignore[arg-type]
            result = plan_model(
                model,
                (args.batch, args.channels, *grid),
                args.domain,
                partition=parse_partition(args.partition, args.domain),
                dtype=getattr(torch, args.dtype),
                extra_inputs=extra,
                progress=stages.advance,
            )
    except MpidpError as err:
        print(f"mpidp plan: {err}", file=sys.stderr)
        return 2
    print(to_json(result) if args.json else result)
    return 1 if result.report.problems else 0


def _scaling(args: argparse.Namespace, grid: tuple[int, ...]) -> int:
    import dataclasses

    import torch

    from mpidp.errors import ConfigError, MpidpError
    from mpidp.preflight.plan import build_model
    from mpidp.preflight.scaling import (
        NETWORKS,
        as_dicts,
        predict_scaling,
        serial_step_seconds,
        table,
    )

    if args.partition != "balanced":
        print(
            "mpidp plan: --scaling prices balanced cuts (weights are per rank count)",
            file=sys.stderr,
        )
        return 2
    shape = (args.batch, args.channels, *grid)
    dtype = getattr(torch, args.dtype)
    network = NETWORKS[args.network]
    if args.alpha is not None or args.beta is not None:
        network = dataclasses.replace(
            network,
            name="given",
            alpha=args.alpha if args.alpha is not None else network.alpha,
            beta=args.beta if args.beta is not None else network.beta,
            source="--alpha/--beta",
        )
    try:
        model = build_model(args.model, args.channels, grid)  # type: ignore[arg-type]
        step = args.step_seconds
        if step is None:
            print("mpidp plan: timing one serial step of the model here", file=sys.stderr)
            step = serial_step_seconds(model, shape, dtype=dtype)
        kw = {"serial_step": step, "network": network, "per_call": args.per_call}
        counts = [2**k for k in range(11)]
        points = predict_scaling(model, shape, counts, fixed=args.fixed, dtype=dtype, **kw)
        try:  # blocks: the best shape of each rank count
            blocks = predict_scaling(
                model, shape, counts, fixed=args.fixed, dtype=dtype, blocks=True, **kw
            )
            unpriced = ""
        except ConfigError as err:  # a model whose exchanges are priced on bands only
            blocks, unpriced = [], str(err)
    except MpidpError as err:
        print(f"mpidp plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        doc = {
            "serial_step": step,
            "network": dataclasses.asdict(network),
            "points": as_dicts(points),
            "blocks": as_dicts(blocks),
            "blocks_unpriced": unpriced,
        }
        print(json.dumps(doc, indent=1))
    else:
        print(table(points, step, network))
        print()
        if blocks:
            print(table(blocks, step, network, "blocks (the shape moving the fewest halo bytes)"))
        else:
            print(f"blocks not priced: {unpriced}")
    return 0


def _explain(args: argparse.Namespace) -> int:
    import torch

    from mpidp.errors import MpidpError
    from mpidp.preflight.explain import explain, simulate
    from mpidp.preflight.plan import build_model
    from mpidp.runtime.manager import DistributedManager

    try:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shape or ["1x6x91x180"]]
        if len(shapes[0]) < 3:
            raise ValueError
    except ValueError:
        print(
            f"mpidp explain: cannot read --shape {' '.join(args.shape)}: use full shapes "
            "like 1x6x721x1440",
            file=sys.stderr,
        )
        return 2
    dtype = getattr(torch, args.dtype)

    def make() -> torch.nn.Module:
        model = build_model(args.model, shapes[0][1], shapes[0][2:])  # type: ignore[arg-type]
        return model.to(dtype)

    world = DistributedManager.world_from_launcher()
    if world == 1 and args.ranks > 1:  # every rank simulated in turn here: nothing to launch
        try:
            result = simulate(make, *shapes, parts=args.ranks, dim=args.dim, dtype=dtype)
        except MpidpError as err:
            print(f"mpidp explain: {err}", file=sys.stderr)
            return 2
        print(result.to_json() if args.json else result)
        return 1 if result.refused else 0
    with DistributedManager(domain_parallel_size=world) as manager:
        try:
            result = explain(make(), *shapes, dim=args.dim, manager=manager, dtype=dtype)
        except MpidpError as err:
            if manager.rank == 0:
                print(f"mpidp explain: {err}", file=sys.stderr)
            return 2
        if manager.rank == 0:
            print(result.to_json() if args.json else result)
            sys.stdout.flush()
    return 1 if result.refused else 0


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


if __name__ == "__main__":
    raise SystemExit(main())
