"""Roll a trained model forward domain-parallel and write the forecast as netCDF-4.

    mpiexec -n 4 python examples/inference.py                     # after examples/train.py
    mpiexec -n 2 python examples/inference.py --checkpoint runs/train/checkpoint.pt \\
        --steps 8 --start 50 --map t2m

The checkpoint may come from any rank count (its state_dict keys are the serial model's). By
default every rank joins one domain group (``--domain`` sets fewer; the data-parallel replicas
then roll out different start times, ``--start`` and the following ones). Each rank reads only
its band of the initial state, the model steps forward autoregressively on bands, and each
step is written, in physical units, by the sharded writer into one file per start time
(``forecast-<start>.nc``, atomically; xarray opens it). World rank 0 gathers one field of the
last step and saves a PNG map of it.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import h5py
import torch
from train import build_model  # the model a checkpoint names (examples/train.py)

import mpidp
from mpidp.io import RolloutWriter, ShardedH5Dataset, load_checkpoint

HERE = Path(__file__).resolve().parent


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="runs/train/checkpoint.pt")
    p.add_argument("--data", default="", help="default: the data the checkpoint trained on")
    p.add_argument(
        "--start", type=int, default=-1, help="first initial time (-1: the latest possible)"
    )
    p.add_argument("--steps", type=int, default=4, help="forecast steps")
    p.add_argument("--domain", type=int, default=0, help="ranks per domain group (0: all)")
    p.add_argument("--out", default="runs/inference")
    p.add_argument("--map", default="t2m", help="the variable drawn on the PNG map")
    return p.parse_args(argv)


def save_map(path: Path, field: torch.Tensor, lat: Any, lon: Any, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=120)
    extent = (float(lon[0]), float(lon[-1]), float(lat[-1]), float(lat[0]))
    im = ax.imshow(field.numpy(), extent=extent, aspect="auto", cmap="RdYlBu_r")
    fig.colorbar(im, ax=ax, shrink=0.9)
    ax.set_xlabel("longitude (degrees east)")
    ax.set_ylabel("latitude")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)


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
        raise SystemExit(f"{data} has channels {ds.channels}; the model was trained on {want}")
    with h5py.File(data, "r") as f:
        units = f["time"].attrs.get("units") if "time" in f else None
    units = units.decode() if isinstance(units, bytes) else units
    last = ds.n_times - 1 - args.steps
    first = last if args.start < 0 else args.start
    if not 0 <= first <= last:
        raise SystemExit(f"--start {args.start}: a {args.steps}-step rollout needs 0..{last}")
    starts = [first + r for r in range(manager.dp_world_size) if first + r <= last]
    out = Path(args.out)
    if manager.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    manager.transport("world", "cpu").barrier()

    assert ds.mean is not None and ds.std is not None  # normalised data (the default)
    mean = ds.mean.to(dtype).view(-1, 1, 1).to(manager.device)
    std = ds.std.to(dtype).view(-1, 1, 1).to(manager.device)
    written: list[Path] = []
    t0 = time.perf_counter()
    for start in starts[manager.dp_rank :: manager.dp_world_size]:
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
            ) as writer,
            torch.no_grad(),
        ):
            for k in range(1, args.steps + 1):
                x = x + model(x)
                time_k = float(ds.times[start + k]) if ds.times is not None else k
                writer.write(x[0] * std + mean, time=time_k)
        written.append(path)
    seconds = time.perf_counter() - t0
    # one map: replica 0's last step, gathered over its domain group
    if manager.dp_rank == 0 and starts:
        c = ds.channels.index(args.map)
        field = mpidp.gather_tensor((x[0, c] * std[c, 0] + mean[c, 0]).cpu(), 0, manager=manager)
        if manager.domain_rank == 0:
            png = out / f"{args.map}-{starts[0]}+{args.steps}.png"
            title = f"{args.map}: {args.steps}-step forecast from time index {starts[0]}"
            save_map(png, field, ds.latitudes, ds.longitudes, title)
            print(
                f"mpidp inference: {manager.world_size} ranks = dp {manager.dp_world_size} x "
                f"domain {manager.domain_world_size}; checkpoint saved at "
                f"{state['layout']}; {len(starts)} rollout(s) of {args.steps} steps in "
                f"{seconds:.2f} s; wrote {', '.join(str(out / f'forecast-{s}.nc') for s in starts)}"
                f" and {png}",
                flush=True,
            )
    ds.close()
    manager.shutdown()
    return written


if __name__ == "__main__":
    main()
