"""The pre-flight commands: ``mpidp plan`` (a model's cut priced per rank; with ``--scaling``
its step predicted to 1024 ranks) and ``mpidp explain`` (a model traced op by op). Neither
needs MPI or data (explain uses a launcher's ranks when there is one)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mpidp.cli.parsing import HelpFormatter, domain_size

__all__ = ["add_explain", "add_plan", "explain", "plan"]

_MODELS = "unet, resblock, patch, afno, fno, swin, graph"
_PLAN = """Price a domain-parallel run of a model on a grid before submitting it: per rank, the
rows it owns, the halo rows every layer fetches, the bytes its halo exchanges move in one
training step and the activation memory its bands hold. -d LATxLON (e.g. 4x8) prices blocks:
rows and columns per rank, halo rows and columns (corners and the polar fold included). Both
forms end with the bytes (halos and transposes) of bands and of every block shape of as
many ranks, and say which moves the fewest.

No MPI and no data: shape arithmetic on meta tensors, and every rank's forward simulated on
meta ShardedTensors. Exits 1 when the model cannot be cut this way (the problems are printed).
Big models show their stages on stderr.

--scaling instead predicts the busiest rank's step time (compute, communication, the copies
a band step makes that a serial one does not, the fixed cost of the calls), its speed-up and
efficiency and its memory at P = 1, 2, 4, ... up to 1024 (bands up to the grid's rows; then
blocks, the shape of each P that moves the fewest bytes) from the model's serial step (timed
here, or --step-seconds), this machine's copy rate (measured here, or --copy-rate) and a
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


def add_plan(sub: Any) -> None:
    """The ``plan`` subcommand's parser, in ``sub`` (argparse's subparsers)."""
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
        type=domain_size,
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
        choices=("infiniband-hdr", "infiniband-ndr", "nvlink-h100", "slingshot", "ethernet-25g"),
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
        "--copy-rate",
        type=float,
        default=None,
        metavar="B/S",
        help="with --scaling: bytes per second of the copies a band step makes that a serial "
        "one does not (default: measured here at the copies' sizes; 0: not priced)",
    )
    plan.add_argument(
        "--per-call",
        nargs="+",
        default=["3e-4"],
        metavar="S|KIND=S",
        help="with --scaling: a converted layer's call over torch's, one direction: one "
        "figure for every layer (bench/percall.py), or a figure per layer kind, "
        "GroupNorm=8e-4 PeriodicConv2d=4e-4 (bench/scaling_model.py --validate; kinds not "
        "named cost nothing)",
    )


def add_explain(sub: Any) -> None:
    """The ``explain`` subcommand's parser, in ``sub`` (argparse's subparsers)."""
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


def plan(args: argparse.Namespace) -> int:
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


def _per_call(given: list[str]) -> float | dict[str, float]:
    """``--per-call``'s figures: one number, or ``KIND=SECONDS`` items."""
    from mpidp.errors import ConfigError

    costs = {}
    for item in given:
        kind, sep, seconds = item.partition("=")
        try:
            if len(given) == 1 and not sep:
                return float(item)
            costs[kind] = float(seconds)
        except ValueError:
            sep = ""
        if not sep or not kind:
            raise ConfigError(
                f"--per-call {item!r}: give one number of seconds, or KIND=SECONDS items "
                f"(GroupNorm=8e-4 PeriodicConv2d=4e-4)"
            )
    return costs


def _scaling(args: argparse.Namespace, grid: tuple[int, ...]) -> int:
    import dataclasses
    import math

    import torch

    from mpidp.errors import ConfigError, MpidpError
    from mpidp.preflight.plan import build_model
    from mpidp.preflight.scaling import (
        NETWORKS,
        as_dicts,
        copy_bytes_per_second,
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
        per_call = _per_call(args.per_call)
        model = build_model(args.model, args.channels, grid)  # type: ignore[arg-type]
        step = args.step_seconds
        if step is None:
            print("mpidp plan: timing one serial step of the model here", file=sys.stderr)
            step = serial_step_seconds(model, shape, dtype=dtype)
        rate = args.copy_rate
        if rate is None:
            print("mpidp plan: timing this machine's copies at the model's sizes", file=sys.stderr)
            rate = copy_bytes_per_second(model, shape, dtype=dtype)
        rate = rate or math.inf  # 0: not priced
        kw = {"serial_step": step, "network": network, "per_call": per_call}
        kw["copy_rate"] = rate
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
            "copy_rate": rate if math.isfinite(rate) else None,
            "network": dataclasses.asdict(network),
            "points": as_dicts(points),
            "blocks": as_dicts(blocks),
            "blocks_unpriced": unpriced,
        }
        print(json.dumps(doc, indent=1))
    else:
        print(table(points, step, network, copy_rate=rate))
        print()
        if blocks:
            title = "blocks (the shape moving the fewest bytes)"
            print(table(blocks, step, network, title, copy_rate=rate))
        else:
            print(f"blocks not priced: {unpriced}")
    return 0


def explain(args: argparse.Namespace) -> int:
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
