"""Roll a trained model forward domain-parallel and write the forecast as netCDF-4.

    mpiexec -n 4 python examples/inference.py                     # after examples/train.py
    mpiexec -n 2 python examples/inference.py --checkpoint runs/train/checkpoint.pt \\
        --steps 8 --start 50 --map t2m

The checkpoint may come from any rank count (its state_dict keys are the serial model's). By
default every rank joins one domain group (--domain sets fewer; the data-parallel replicas
then roll out different start times, --start and the following ones). Each rank reads only
its band of the initial state, the model steps forward autoregressively on bands, and each
step is written, in physical units with the source data's CF units and long_name, by
the sharded writer into one file per start time (forecast-<start>.nc, atomically; xarray
opens it). Each step is scored against the data (mpidp.ops.skill: latitude-weighted RMSE and
anomaly correlation of the forecast, of persistence and of the training times' climatology),
written as skill-<start>.json. World rank 0 prints the table and saves a PNG of one
variable's last step: truth, forecast and error side by side.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from skill import (  # examples/skill.py
    save_comparison,
    step_hours,
    time_units,
    timestamp,
    training_times,
)
from train import build_model  # the model a checkpoint names (examples/train.py)

import mpidp
from mpidp.cli import HelpFormatter, Parser, exit_once
from mpidp.io import RolloutWriter, ShardedH5Dataset, load_checkpoint
from mpidp.ops.skill import Skill, SkillMeter, climatology, physical_band
from mpidp.runtime.progress import Progress

HERE = Path(__file__).resolve().parent


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--checkpoint", default="runs/train/checkpoint.pt", help="what examples/train.py wrote"
    )
    p.add_argument(
        "--data",
        default="",
        metavar="PATH",
        help="the data the initial states come from (default: the data of the training run)",
    )
    p.add_argument(
        "--start",
        type=int,
        default=-1,
        metavar="INDEX",
        help="time index of the first initial state; -1: the latest that leaves --steps steps",
    )
    p.add_argument("--steps", type=int, default=4, metavar="N", help="forecast steps")
    p.add_argument(
        "--domain",
        type=int,
        default=0,
        metavar="N",
        help="ranks per domain group; 0: all ranks in one group",
    )
    p.add_argument("--out", default="runs/inference", metavar="DIR", help="folder for the output")
    p.add_argument(
        "--map",
        default="t2m",
        metavar="CHANNEL",
        help="the channel drawn on the PNG (truth, forecast, error)",
    )
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, checked before any work (every rank alike: a mistake is one message)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not Path(args.checkpoint).is_file():
        parser.error(
            f"--checkpoint {args.checkpoint}: no such file; train first (python "
            f"examples/train.py writes runs/train/checkpoint.pt) or pass the file it wrote"
        )
    if args.data and not Path(args.data).exists():
        parser.error(f"--data {args.data}: no such file; leave it out for the training data")
    if args.steps < 1 or args.domain < 0:
        parser.error(
            f"--steps {args.steps} --domain {args.domain}: give --steps >= 1, --domain >= 0"
        )
    return args


def layout_text(layout: dict[str, int]) -> str:
    """``4 ranks = dp 2 x domain 2`` for a checkpoint's layout."""
    parts = [f"dp {layout.get('dp', 1)}"]
    if layout.get("tensor", 1) > 1:
        parts.append(f"tensor {layout['tensor']}")
    parts.append(f"domain {layout.get('domain', 1)}")
    return f"{layout.get('world', 1)} ranks = {' x '.join(parts)}"


def origin(times: Any, units: str | None, start: int, steps: int) -> str:
    """``2000-01-14 18:00, valid 2000-01-16 18:00``: the start and valid dates of a rollout
    (``time index 55`` where the data has no dates)."""
    first = timestamp(times[start], units) if times is not None else None
    if first is None:
        return f"time index {start}"
    return f"{first}, valid {timestamp(times[start + steps], units)}"


def main(argv: list[str] | None = None) -> list[Path]:
    args = parse(argv)
    world = mpidp.DistributedManager.world_from_launcher()
    manager = mpidp.init(domain_parallel_size=args.domain or world)
    state = load_checkpoint(args.checkpoint, manager=manager)
    cfg, spec = state["extra"]["config"], state["extra"]["model"]
    dtype = torch.float64 if cfg["precision"] == "float64" else torch.float32
    data = args.data or cfg["data"] or str(HERE / "data" / f"sample-{cfg['lat']}x{cfg['lon']}.h5")
    grid = (cfg["lat"], cfg["lon"])

    model = build_model(spec).to(device=manager.device, dtype=dtype)
    model = mpidp.convert_to_domain_parallel(model, manager)
    model.load_state_dict(state["model"])
    model.eval()
    ds = ShardedH5Dataset(data, manager=manager, grid=grid, dtype=dtype)
    if list(ds.channels) != list(state["extra"]["channels"]):
        want = state["extra"]["channels"]
        exit_once(f"{data} has channels {ds.channels}; the model was trained on {want}")
    if args.map not in ds.channels:
        exit_once(
            f"--map {args.map}: {data} has no such channel; draw one of "
            f"{', '.join(ds.channels)} (nothing was run or written)"
        )
    units = time_units(data)
    hours = step_hours(ds.times, units)  # between steps, for the skill table's lead times
    last = ds.n_times - 1 - args.steps
    first = last if args.start < 0 else args.start
    if not 0 <= first <= last:
        exit_once(f"--start {args.start}: a {args.steps}-step rollout needs 0..{last}")
    starts = [first + r for r in range(manager.dp_world_size) if first + r <= last]
    out = Path(args.out)
    if manager.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    manager.transport("world", "cpu").barrier()

    assert ds.mean is not None and ds.std is not None  # normalised data (the default)
    mean = ds.mean.to(dtype).view(-1, 1, 1).to(manager.device)
    std = ds.std.to(dtype).view(-1, 1, 1).to(manager.device)
    # the reference forecast "climatology": the mean state of the times the model trained on
    clim = climatology(ds, training_times(ds.n_times, cfg["val_samples"]), manager)
    assert ds.latitudes is not None  # the sample data and ERA5-style files carry them
    weights = mpidp.latitude_weights(ds.latitudes, manager=manager)
    field_units = [ds.attributes[c].get("units", "") for c in ds.channels]
    written: list[Path] = []
    skill: Skill | None = None
    t0 = time.perf_counter()
    mine = starts[manager.dp_rank :: manager.dp_world_size]
    bar = Progress(len(mine) * args.steps, prefix="inference: ", enabled=manager.rank == 0)
    for start in mine:
        path = out / f"forecast-{start}.nc"
        x = ds.read_band(start).unsqueeze(0).to(manager.device)
        with (
            RolloutWriter(
                path,
                ds.channels,
                ds.latitudes,
                ds.longitudes,
                manager,
                time_units=units,
                attrs={"source": "mpidp examples/inference.py", "checkpoint": args.checkpoint},
                variable_attrs=ds.attributes,
            ) as writer,
            torch.no_grad(),
        ):
            meter = SkillMeter(
                ds.channels,
                physical_band(ds, start),
                clim,
                weights,
                manager,
                units=field_units,
                step_hours=hours,
            )
            for k in range(1, args.steps + 1):
                x = x + model(x)
                time_k = float(ds.times[start + k]) if ds.times is not None else k
                writer.write(x[0] * std + mean, time=time_k)
                bar.advance(f"forecast from time index {start}")
                meter.add(k, (x[0] * std + mean).cpu(), physical_band(ds, start + k))
        skill = meter.result()
        if manager.domain_rank == 0:
            skill.write_json(out / f"skill-{start}.json")
        written.append(path)
    bar.close()
    seconds = time.perf_counter() - t0
    # one figure: replica 0's last step, gathered over its domain group
    if manager.dp_rank == 0 and starts:
        assert skill is not None  # replica 0 rolled out starts[0]
        c = ds.channels.index(args.map)
        field = mpidp.gather_tensor((x[0, c] * std[c, 0] + mean[c, 0]).cpu(), 0, manager=manager)
        truth = physical_band(ds, starts[0] + args.steps)[c]
        truth = mpidp.gather_tensor(truth, 0, manager=manager)
        if manager.domain_rank == 0:
            png = out / f"{args.map}-{starts[0]}+{args.steps}.png"
            lead = f" ({args.steps * hours:g} h)" if hours else ""
            title = (
                f"{ds.attributes[args.map]['long_name']}: {args.steps}-step{lead} forecast "
                f"from {origin(ds.times, units, starts[0], args.steps)}"
            )
            save_comparison(
                png,
                truth,
                field,
                ds.latitudes,
                ds.longitudes,
                name=args.map,
                units=field_units[c],
                title=title,
                rmse=skill.of(args.map)[-1].rmse,
            )
            print(
                f"mpidp inference: {manager.world_size} ranks = dp {manager.dp_world_size} x "
                f"domain {manager.domain_world_size}, from a checkpoint saved by "
                f"{layout_text(state['layout'])}; {len(starts)} rollout(s) of {args.steps} "
                f"steps in {seconds:.2f} s; wrote "
                f"{', '.join(str(out / f'forecast-{s}.nc') for s in starts)}, "
                f"{', '.join(str(out / f'skill-{s}.json') for s in starts)} and {png}\n",
                flush=True,
            )
            print(skill.table(), flush=True)
            when = timestamp(ds.times[starts[0]], units) if ds.times is not None else None
            start = f"{when} (time index {starts[0]})" if when else f"time index {starts[0]}"
            print(f"\nthe forecast from {start} {skill.verdict(args.map)}", flush=True)
    ds.close()
    manager.shutdown()
    return written


if __name__ == "__main__":
    main()
