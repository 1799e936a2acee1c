"""Train a small weather model (U-Net, AFNO, FNO, Swin, graph) domain-parallel on sample data.

    mpiexec -n 4 python examples/train.py                # dp 2 x domain 2 (the default)
    python examples/train.py                             # one process: the same numbers
    torchrun --standalone --nproc-per-node 4 examples/train.py
    srun --mpi=pmi2 -n 4 python examples/train.py        # inside sbatch
    mpiexec -n 4 python examples/train.py --config my.yaml --steps 200 --resume
    mpiexec -n 4 python examples/train.py --data-parallel fsdp2 --domain 2   # FSDP2 x domain
    mpiexec -n 4 python examples/train.py --mlp 16 --tensor 2 --domain 2     # TP x domain
    mpiexec -n 4 python examples/train.py --model afno   # FourCastNet-style, through mpidp.ops.fft
    mpiexec -n 4 python examples/train.py --model fno    # Fourier neural operator
    mpiexec -n 4 python examples/train.py --model swin   # Pangu-style shifted windows
    mpiexec -n 4 python examples/train.py --model graph  # GraphCast-style grid -> mesh -> grid

Every rank holds one latitude band of every field (uneven bands are fine); data-parallel
replicas see different samples. The network predicts each variable's six-hour change in
units of that change's std over the training times (so t2m's small changes count as much as
msl's); the loss is their latitude-weighted MSE over the whole global batch, computed
exactly (sums over every band and replica, then one division), so a 2 x 2 run follows the
one-process run's loss curve to rounding. Validation reports the exact
latitude-weighted RMSE of every variable in its physical units, and the forecast's skill
against persistence and climatology (mpidp.ops.skill); the last line says whether it beats
persistence.

Writes, in --out (default runs/train): checkpoint.pt every --checkpoint-every steps and at the
end (loadable at any rank count, and by the serial model), metrics.json (losses, validation,
timing) and loss_curve.png. The sample data (mpidp sample-data) is generated on first use;
--data trains from an HDF5/netCDF-4 file or a Zarr store (each rank reads its band alone).
Rank 0 alone prints: a progress bar on a terminal, else a line every --log-every steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from skill import step_hours, time_units, training_times  # examples/skill.py
from torch.utils.data import Subset

import mpidp
from mpidp.cli import HelpFormatter, Parser, exit_once
from mpidp.io import (
    DataParallelSampler,
    ShardedH5Dataset,
    ShardedZarrDataset,
    ensure_sample_data,
    load_checkpoint,
    save_checkpoint,
)
from mpidp.models import AFNONet, FNO2d, GraphCastNet, SwinNet, WeatherUNet
from mpidp.ops.skill import Skill, SkillMeter, climatology
from mpidp.parallel import (
    ParallelMesh,
    apply_ddp,
    apply_domain_parallel,
    apply_fsdp2,
    apply_tensor_parallel,
    build_device_mesh,
)
from mpidp.runtime.grid import parse_domain
from mpidp.runtime.progress import Progress

HERE = Path(__file__).resolve().parent

#: what --data is read with
Data = ShardedH5Dataset | ShardedZarrDataset


def option(default: Any, help: str, choices: tuple[str, ...] = (), metavar: str = "") -> Any:
    """A Config field with its --help text (and its choices, where there are some)."""
    meta = {"help": help, "choices": choices, "metavar": metavar}
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class Config:
    """Everything a run depends on; a YAML file may set any field, flags win over it."""

    data: str = option(
        "",
        "the training data: an HDF5/netCDF-4 file, or a Zarr store in xarray's or "
        "anemoi-datasets' layout (a directory ending in .zarr or holding zarr.json or .zgroup; "
        "needs mpidp[zarr]) "
        "(default: examples/data/sample-LATxLON.h5, written on first use)",
        metavar="PATH",
    )
    model: str = option(
        "unet",
        "the network: a U-Net, AFNO (FourCastNet-style), a Fourier neural operator, "
        "Swin (Pangu-style windows) or a graph model (GraphCast-style)",
        ("unet", "afno", "fno", "swin", "graph"),
    )
    lat: int = option(0, "latitude rows, poles included; 0 gives 91, or 92 for afno and swin")
    lon: int = option(180, "longitude columns")
    times: int = option(64, "time steps of the sample data, 6 hours apart")
    domain: str = option(
        "auto",
        "ranks per domain group, each holding one latitude band (N), or a grid of latitude x "
        "longitude blocks (AxB: A rows of B ranks); auto gives 2 when the ranks left after "
        "--tensor are even, else all of them",
        metavar="N|AxB|auto",
    )
    data_parallel: str = option(
        "none",
        "how the data-parallel replicas share gradients: none (mpidp.sync_gradients), "
        "ddp (torch DDP) or fsdp2 (parameters sharded over the replicas)",
        ("none", "ddp", "fsdp2"),
    )
    tensor: int = option(1, "tensor-parallel ranks splitting the U-Net's bottleneck MLP")
    mlp: int = option(0, "hidden channels of the U-Net's bottleneck MLP (0: none), >= --tensor")
    steps: int = option(300, "the step to train up to (a resumed run continues to it)")
    batch: int = option(4, "global batch, split over the data-parallel replicas")
    lr: float = option(4e-3, "Adam learning rate")
    width: int = option(
        8, "U-Net width; AFNO, Swin and the graph model use 4 x width channels, FNO 2 x width"
    )
    groups: int = option(2, "group-norm groups of the U-Net")
    patch: int = option(4, "AFNO and Swin patch size; --lat and --lon must be multiples of it")
    modes: int = option(12, "Fourier modes the FNO keeps along each dimension")
    precision: str = option(
        "float32", "floating-point type of the model and the data", ("float32", "float64")
    )
    val_samples: int = option(8, "validation samples, taken from the end of the data")
    val_every: int = option(50, "validate every this many steps and at the end")
    checkpoint_every: int = option(50, "write the checkpoint every this many steps and at the end")
    log_every: int = option(25, "one progress line every this many steps when not on a terminal")
    seed: int = option(0, "seed of the initial weights and of the sample order")
    out: str = option(
        "runs/train", "folder for checkpoint.pt, metrics.json and loss_curve.png", metavar="DIR"
    )
    resume: bool = option(False, "continue from the checkpoint in --out")
    plot: bool = option(True, "write loss_curve.png")


def build_parser() -> argparse.ArgumentParser:
    """A flag per Config field (default None: unset, so a YAML file's value stands)."""
    parser = Parser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--config", metavar="YAML", help="a YAML file of the options below (flags win over it)"
    )
    for field in dataclasses.fields(Config):
        flag = "--" + field.name.replace("_", "-")
        text = field.metadata["help"]
        if field.type == "bool":
            text += " (default: on)" if field.default else " (default: off)"
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=text
            )
            continue
        if "default:" not in text:
            text += f" (default: {field.default})"
        kind = {"int": int, "float": float}.get(str(field.type), str)
        choices = field.metadata["choices"] or None
        metavar = field.metadata["metavar"] or {int: "N", float: "X"}.get(kind)
        parser.add_argument(
            flag, type=kind, default=None, choices=choices, metavar=metavar, help=text
        )
    return parser


def parse_config(argv: list[str] | None = None) -> Config:
    parser = build_parser()
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    if args.config:
        import yaml

        with open(args.config) as f:
            values = yaml.safe_load(f) or {}
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(Config)})
        if unknown:
            parser.error(f"{args.config}: unknown keys {unknown}")
    values.update({k: v for k, v in vars(args).items() if v is not None and k != "config"})
    cfg = Config(**values)
    if cfg.precision not in ("float32", "float64"):
        parser.error(f"--precision {cfg.precision!r}: use float32 or float64")
    if cfg.model not in MODELS:
        parser.error(f"--model {cfg.model!r}: use one of {', '.join(MODELS)}")
    if cfg.lat == 0:
        cfg.lat = 92 if cfg.model in ("afno", "swin") else 91
    if cfg.model in ("afno", "swin") and (cfg.lat % cfg.patch or cfg.lon % cfg.patch):
        parser.error(
            f"--model {cfg.model}: the grid {cfg.lat} x {cfg.lon} must be a multiple of --patch "
            f"{cfg.patch} (e.g. --lat 92 --lon 180)"
        )
    if cfg.model != "unet" and (cfg.mlp or cfg.tensor > 1):
        parser.error("--mlp / --tensor: tensor parallelism is declared in the U-Net only")
    if cfg.domain != "auto" and domain_grid(cfg.domain) is None:
        parser.error(
            f"--domain {cfg.domain!r}: give the ranks per domain group (1, 2, ...), a grid of "
            f"latitude x longitude blocks (2x2, 1x4, ...) or auto"
        )
    for name in ("steps", "batch", "tensor", "width", "val_samples", "val_every", "log_every"):
        if getattr(cfg, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(cfg, name)}: give 1 or more")
    if cfg.data and not Path(cfg.data).exists():
        parser.error(f"--data {cfg.data}: no such file or store; leave --data out for sample data")
    world = mpidp.DistributedManager.world_from_launcher()
    cut = domain_size(cfg, world) * cfg.tensor
    if world % cut:
        parser.error(
            f"--domain {cfg.domain} x --tensor {cfg.tensor} = {cut} ranks per replica does not "
            f"divide the {world} ranks of this launch; use a divisor of {world}"
        )
    if cfg.batch % (world // cut):
        parser.error(
            f"--batch {cfg.batch} must be a multiple of the {world // cut} data-parallel "
            f"replicas ({world} ranks / {cut} per replica)"
        )
    return cfg


#: the models --model names, built from the spec that model_spec() writes into checkpoints
MODELS: dict[str, type[torch.nn.Module]] = {
    "unet": WeatherUNet,
    "afno": AFNONet,
    "fno": FNO2d,
    "swin": SwinNet,
    "graph": GraphCastNet,
}


def model_spec(cfg: Config, channels: int) -> dict[str, Any]:
    """The constructor arguments of ``cfg.model`` (saved with the checkpoint, with its name)."""
    spec: dict[str, Any] = dict(in_channels=channels, out_channels=channels, tendency=True)
    if cfg.model == "afno":
        spec.update(grid=(cfg.lat, cfg.lon), patch=cfg.patch, embed_dim=4 * cfg.width, depth=2)
    elif cfg.model == "swin":  # 23 x 45 tokens in windows of 4 x 5 (padded to 24 rows)
        spec.update(grid=(cfg.lat, cfg.lon), patch=cfg.patch, embed_dim=4 * cfg.width, depth=2)
        spec.update(heads=4, window=(4, 5))
    elif cfg.model == "graph":  # grid -> a 512-node mesh -> 2 processor layers -> grid
        spec.update(grid=(cfg.lat, cfg.lon), mesh_nodes=512, hidden=4 * cfg.width, layers=2)
    elif cfg.model == "fno":
        spec.update(modes1=cfg.modes, modes2=cfg.modes, width=2 * cfg.width, depth=3)
    else:
        spec.update(grid=(cfg.lat, cfg.lon), width=cfg.width, groups=cfg.groups, mlp=cfg.mlp)
    return {"name": cfg.model, **spec}


class ScaledTendency(torch.nn.Module):
    """``net``'s output times ``scale``, per channel: the network predicts the one-step change
    in units of its typical size (``scale``: the std of the change), so that every variable's
    change counts in the loss, and the forecast is still ``x + model(x)``.

    Normalising by each variable's overall std alone makes t2m's six-hour change tiny (its std
    is mostly the pole-to-equator contrast), and the loss all but ignores it. The scale is a
    buffer: checkpoints hold it, and inference needs no change."""

    def __init__(self, net: torch.nn.Module, channels: int) -> None:
        super().__init__()
        self.net = net
        self.register_buffer("scale", torch.ones(channels, 1, 1))
        blocks = getattr(net, "_fsdp_blocks", None)  # FSDP2 shards the net's own blocks
        if blocks is not None:
            blocks = [blocks] if isinstance(blocks, str) else list(blocks)
            self._fsdp_blocks = [f"net.{b}" for b in blocks]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale


def build_model(spec: dict[str, Any]) -> torch.nn.Module:
    """The serial model of a saved spec (checkpoints from before --model hold a U-Net's; those
    from before the scaled tendency, ``"tendency": true``, the bare network)."""
    args = dict(spec)
    name = args.pop("name", "unet")
    tendency = args.pop("tendency", False)
    for key in ("grid", "window"):
        if key in args:
            args[key] = tuple(args[key])
    net = MODELS[name](**args)
    return ScaledTendency(net, args["out_channels"]) if tendency else net


def tendency_std(
    ds: Data, samples: range, weights: torch.Tensor, manager: mpidp.DistributedManager
) -> torch.Tensor:
    """The latitude-weighted std of each channel's one-step change (target minus input,
    normalised units) over ``samples``, exact over the whole field: float64 ``(C,)``. Every
    replica reads every sample, so any layout gives the serial numbers. Collective over the
    domain group."""
    change = torch.stack([y - x for x, y in (ds[i] for i in samples)])
    change, w, dims = change.to(weights.device, torch.float64), weights.double(), (0, 2, 3)
    mean = mpidp.global_mean(change, w, dims, manager).view(1, -1, 1, 1)
    return mpidp.global_mean((change - mean).square(), w, dims, manager).sqrt()


def domain_grid(text: str) -> tuple[int, int] | None:
    """``(P_lat, P_lon)`` of ``--domain N`` (bands: ``(N, 1)``) or ``--domain AxB``; None when
    it is neither."""
    try:
        domain = parse_domain(text)
    except mpidp.ConfigError:
        return None
    return domain if isinstance(domain, tuple) else (domain, 1)


def domain_layout(cfg: Config, world: int) -> int | tuple[int, int]:
    """What ``--domain`` asks for, as the parallelism config takes it: ranks per domain group
    (bands) or a ``(P_lat, P_lon)`` grid of blocks."""
    if cfg.domain != "auto":
        grid = domain_grid(cfg.domain)
        assert grid is not None  # parse_config checked it
        return grid if "x" in str(cfg.domain).lower() else grid[0]
    inner = max(world // max(cfg.tensor, 1), 1)
    return 2 if inner % 2 == 0 else inner


def domain_size(cfg: Config, world: int) -> int:
    """Ranks per domain group."""
    layout = domain_layout(cfg, world)
    return layout[0] * layout[1] if isinstance(layout, tuple) else layout


def describe(meshes: ParallelMesh) -> str:
    """``dp 2 x domain 2``, ``dp 1 x tensor 2 x domain 2 (fsdp2)``."""
    tensor = f"tensor {meshes.tp_size} x " if meshes.tp_size > 1 else ""
    data = f" ({meshes.config.data})" if meshes.config.data != "none" else ""
    p_lat, p_lon = meshes.manager.grid
    domain = f"{p_lat} x {p_lon} blocks" if p_lon > 1 else str(meshes.domain_size)
    return f"dp {meshes.dp_size} x {tensor}domain {domain}{data}"


def parallel_model(
    model: torch.nn.Module, meshes: ParallelMesh, manager: mpidp.DistributedManager
) -> torch.nn.Module:
    """Tensor parallelism, the domain conversion, then DDP or FSDP2 (that order)."""
    apply_tensor_parallel(model, meshes.get("tp"))
    model = apply_domain_parallel(model, manager)
    if meshes.config.data == "fsdp2":
        apply_fsdp2(model, meshes["dp"], config=meshes.config)
    elif meshes.config.data == "ddp":
        model = apply_ddp(model, meshes["dp"])
    return model


def sample_data(cfg: Config, manager: mpidp.DistributedManager) -> str:
    """The data file; world rank 0 writes the sample set when it is missing or was written by
    another version of the generator or with other sizes (a cache on a shared disk)."""
    path = cfg.data or str(HERE / "data" / f"sample-{cfg.lat}x{cfg.lon}.h5")
    if not cfg.data and manager.rank == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        _, why = ensure_sample_data(
            path, n_lat=cfg.lat, n_lon=cfg.lon, n_time=cfg.times, progress=True
        )
        if why:
            print(f"wrote the sample data to {path}: the file there was {why}", flush=True)
    manager.transport("world", "cpu").barrier()
    return path


def is_zarr_store(path: str) -> bool:
    """Whether ``path`` names a Zarr store: a directory ending in ``.zarr`` (or a path so
    named that does not exist yet: the Zarr reader says so), or a directory holding a Zarr
    group's metadata (``zarr.json``, format 3; ``.zgroup``, format 2)."""
    p = Path(path)
    if p.name.endswith(".zarr") and not p.is_file():
        return True
    return p.is_dir() and ((p / "zarr.json").exists() or (p / ".zgroup").exists())


def open_data(path: str, cfg: Config, manager: mpidp.DistributedManager, dtype: Any) -> Data:
    """This rank's band of the data at ``path``: a Zarr store or an HDF5/netCDF-4 file."""
    reader = ShardedZarrDataset if is_zarr_store(path) else ShardedH5Dataset
    return reader(path, manager=manager, grid=(cfg.lat, cfg.lon), dtype=dtype)


def split(n: int, val: int) -> tuple[range, range]:
    """Training samples first, validation last, one sample apart so no time is shared."""
    if not 0 < val < n - 1:
        exit_once(f"--val-samples {val}: the data has {n} samples; use 1 to {n - 2}")
    return range(0, n - val - 1), range(n - val, n)


def batch(ds: Data, indices: list[int], device: torch.device) -> tuple[Any, Any]:
    items = [ds[i] for i in indices]
    return (
        torch.stack([x for x, _ in items]).to(device),
        torch.stack([y for _, y in items]).to(device),
    )


def validate(
    model: torch.nn.Module,
    ds: Data,
    indices: range,
    per_replica: int,
    weights: torch.Tensor,
    meshes: ParallelMesh,
    clim: torch.Tensor,
    change_std: torch.Tensor,
    hours: float | None = None,
) -> tuple[float, dict[str, float], Skill]:
    """Exact latitude-weighted MSE (the training loss: in units of the variance of each
    variable's one-step change, ``change_std`` squared) and RMSE per variable (physical units)
    over every validation sample: local sums, then one all-reduce over the world (tensor-parallel
    ranks count their replica's samples alike, in numerator and denominator). And the skill of
    the one-step forecasts against persistence and climatology (``clim``), pooled alike;
    ``hours``: the time between steps (the skill's lead times)."""
    manager = meshes.manager
    mine = list(indices)[meshes.dp_rank :: meshes.dp_size]  # disjoint, no repeats
    sq = torch.zeros(len(ds.target_channels), dtype=torch.float64)
    count = torch.zeros(1, dtype=torch.float64)
    inputs, forecasts, truths = [], [], []
    model.eval()
    with torch.no_grad():
        for k in range(0, len(mine), per_replica):
            x, y = batch(ds, mine[k : k + per_replica], weights.device)
            forecast = x + model(x)
            err = (forecast - y).double().square() * weights
            sq += err.sum((0, 2, 3)).cpu()
            count += weights.sum().cpu() * y.size(0) * y.size(-1)
            inputs.append(x.cpu())
            forecasts.append(forecast.cpu())
            truths.append(y.cpu())
    model.train()
    world = manager.transport("world", "cpu")
    total = world.all_reduce(torch.cat([sq, count]))
    mse = total[:-1] / total[-1]
    assert ds.mean is not None and ds.std is not None  # normalised data (the default)
    std = ds.std.double().flatten()[: len(mse)]
    rmse = {c: float(v) for c, v in zip(ds.target_channels, mse.sqrt() * std, strict=True)}
    c = len(ds.channels)
    mean, scale = ds.mean[:c].double().view(-1, 1, 1), std[:c].view(-1, 1, 1)
    physical = [torch.cat(v).double() * scale + mean for v in (inputs, forecasts, truths)]
    units = [ds.attributes[name].get("units", "") for name in ds.channels]
    meter = SkillMeter(
        ds.channels,
        physical[0],
        clim,
        weights.cpu(),
        manager,
        units=units,
        forecasts=len(indices),
        group=world,
        step_hours=hours,
    )
    meter.add(1, physical[1], physical[2])
    loss = mse / change_std.double().cpu().flatten().square()
    return float(loss.mean()), rmse, meter.result()


def save_plot(path: Path, history: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(*zip(*history["train"], strict=True), label="training (global batch)", lw=1)
    if history["val"]:
        ax.plot(*zip(*history["val"], strict=True), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("latitude-weighted MSE of the 6-h change\n(in units of its variance, std²)")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    os.replace(tmp, path)


def inference_command(ckpt: Path) -> str:
    """The command that rolls out the model saved in ``ckpt`` (examples/inference.py, at any
    rank count): under the mpiexec beside this Python where there is one, else one process;
    paths as short as the current folder allows."""

    def short(path: Path | str) -> str:
        rel = os.path.relpath(path)
        return str(path) if rel.startswith("..") else rel

    python = short(sys.executable)
    mpiexec = Path(sys.executable).with_name("mpiexec")
    launch = f"{short(mpiexec)} -n 2 {python} -m mpi4py" if mpiexec.exists() else python
    script = short(Path(__file__).parent / "inference.py")  # as this script was named
    default = Path(ckpt) == Path("runs/train/checkpoint.pt")  # inference.py's default
    return f"{launch} {script}" + ("" if default else f" --checkpoint {short(ckpt)}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg = parse_config(argv)
    world = mpidp.DistributedManager.world_from_launcher()
    layout = {"data": cfg.data_parallel, "tensor": cfg.tensor, "domain": domain_layout(cfg, world)}
    try:
        meshes = build_device_mesh(layout)
    except mpidp.ConfigError as err:
        exit_once(f"mpidp train: {err}")
    manager = meshes.manager
    lead = manager.rank == 0
    dtype = torch.float64 if cfg.precision == "float64" else torch.float32
    dp = meshes.dp_size
    per_replica = cfg.batch // dp
    out = Path(cfg.out)
    if lead:
        out.mkdir(parents=True, exist_ok=True)

    path = sample_data(cfg, manager)
    ds = open_data(path, cfg, manager, dtype)
    hours = step_hours(ds.times, time_units(path))  # between steps: the skill's lead times
    train_idx, val_idx = split(len(ds), cfg.val_samples)
    sampler = DataParallelSampler(Subset(ds, train_idx), meshes, seed=cfg.seed, drop_last=True)
    per_epoch = len(sampler) // per_replica
    if per_epoch < 1:
        exit_once(f"--batch {cfg.batch} exceeds the {len(train_idx)} training samples")

    channels = len(ds.channels)
    spec = model_spec(cfg, channels)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank, whatever the layout
    model = build_model(spec).to(device=manager.device, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    weights = mpidp.latitude_weights(cfg.lat, manager=manager, dtype=dtype).to(manager.device)
    # the network's output: the change in units of its typical size; the loss counts it alike
    scale = tendency_std(ds, train_idx, weights, manager).view(-1, 1, 1).to(weights)
    with torch.no_grad():
        model.get_buffer("scale").copy_(scale)
    try:
        model = parallel_model(model, meshes, manager)
    except mpidp.ConfigError as err:
        exit_once(f"mpidp train: {err}")
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    # the reference forecast "climatology": the mean state of the training times
    clim = climatology(ds, training_times(ds.n_times, cfg.val_samples), manager)

    step = 0
    history: dict[str, list[tuple[int, float]]] = {"train": [], "val": []}
    ckpt = out / "checkpoint.pt"
    if cfg.resume:
        if not ckpt.exists():
            exit_once(f"--resume: no checkpoint at {ckpt}; run without --resume first")
        state = load_checkpoint(ckpt, model, optimizer, manager, map_location=manager.device)
        step, history = state["step"], state["extra"]["history"]
    extra = lambda: {  # noqa: E731
        "config": dataclasses.asdict(cfg),
        "model": spec,
        "channels": ds.channels,
        "history": history,
    }

    if lead:
        bands = ", ".join(str(n) for n in manager.spec(cfg.lat).sizes)
        print(
            f"mpidp train: {cfg.model}; {manager.world_size} ranks = {describe(meshes)}; "
            f"grid {cfg.lat} x {cfg.lon} in bands of {bands} rows; "
            f"{channels} channels ({', '.join(ds.channels)}); {n_params} parameters; "
            f"{cfg.precision}; global batch {cfg.batch}; steps {step} to {cfg.steps}",
            flush=True,
        )
    bar = Progress(cfg.steps, first=step, every=cfg.log_every, enabled=lead)
    world_t = manager.transport("world", "cpu")
    t_start = time.perf_counter()
    first_step = step
    val_loss, rmse, skill = math.nan, dict[str, float](), None
    while step < cfg.steps:
        epoch, k = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        local = [train_idx[i] for i in list(sampler)[k * per_replica : (k + 1) * per_replica]]
        x, y = batch(ds, local, manager.device)
        loss = mpidp.global_mean(((x + model(x) - y) / scale).square(), weights, manager=manager)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        meshes.sync_gradients(model)  # domain parts summed, replicas averaged
        optimizer.step()
        step += 1
        # the global batch's loss: the replicas' equal-size batch means, averaged
        value = float(world_t.all_reduce(loss.detach().double().cpu().reshape(1))) / world
        history["train"].append((step, value))
        bar.update(step, f"loss {value:.6f}")
        if step % cfg.val_every == 0 or step == cfg.steps:
            val_loss, rmse, skill = validate(
                model, ds, val_idx, per_replica, weights, meshes, clim, scale, hours
            )
            history["val"].append((step, val_loss))
            shown = ", ".join(f"{c} {v:.4g}" for c, v in rmse.items())
            bar.message(
                f"step {step}: validation loss {val_loss:.6f}; RMSE {shown}; {skill.verdict()}"
            )
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            save_checkpoint(ckpt, model, optimizer, step, manager, extra=extra())
    bar.close()
    seconds = time.perf_counter() - t_start

    if skill is None or history["val"][-1][0] != step:  # e.g. resumed at the last step
        val_loss, rmse, skill = validate(
            model, ds, val_idx, per_replica, weights, meshes, clim, scale, hours
        )
    metrics = {
        "world": manager.world_size,
        "dp": dp,
        "data_parallel": meshes.config.data,
        "tensor": meshes.tp_size,
        "domain": manager.domain_world_size,
        "grid": list(manager.grid),
        "launcher": manager.launch_info.launcher,
        "steps": step,
        "steps_run": step - first_step,
        "seconds": seconds,
        "seconds_per_step": seconds / max(step - first_step, 1),
        "train_loss": history["train"][-1][1] if history["train"] else math.nan,
        "val_loss": val_loss,
        "val_rmse": rmse,
        "val_skill": skill.to_dict(),
        "history": history,
    }
    if lead:
        tmp = out / ".metrics.json.tmp"
        tmp.write_text(json.dumps(metrics, indent=1))
        os.replace(tmp, out / "metrics.json")
        if cfg.plot:
            save_plot(out / "loss_curve.png", history)
        print(
            f"done: {step} steps in {seconds:.1f} s ({metrics['seconds_per_step']:.3f} s/step); "
            f"validation loss {val_loss:.10f}; wrote {ckpt}, {out / 'metrics.json'}"
            + (f", {out / 'loss_curve.png'}" if cfg.plot else ""),
            flush=True,
        )
        print(f"\n{skill.table()}\n", flush=True)
        print(
            f"one step ahead on the {len(val_idx)} validation samples, the model {skill.verdict()}",
            flush=True,
        )
        print(f"\nnext, forecast from this checkpoint: {inference_command(ckpt)}", flush=True)
    ds.close()
    manager.shutdown()
    return metrics


if __name__ == "__main__":
    main()
