"""Memory per rank, measured exactly: what autograd saves for the backward pass, the transport's
receive buffers, and ``mpidp plan``'s activation estimate beside them, at P = 1, 2, 4.

    python bench/memory.py --json docs/bench/memory.json      # launches P = 1, 2, 4

For each model (a converted U-Net, AFNO and Swin-style model, and the serial U-Net fed
``ShardedTensor`` bands), one training step per rank:

- **saved**: the bytes of every storage that a tensor saved for backward lives in, each storage
  counted once, parameters and buffers left out (``torch.autograd.graph.saved_tensors_hooks``).
  This is the activation memory a step holds at the end of its forward pass; no allocator, no
  interpreter.
- **buffers**: the most bytes the MPI transport's receive-buffer cache held at once during the
  step (received halo strips, transposes and gathers of 64 KiB and more, in use or kept for
  reuse); **idle**: what it keeps after the step, in use by nothing (kept for the next step);
  **temp**: its buffers that back no saved tensor when the forward ends, the peak of the step
  (the halo-extended bands a convolution saves live in such buffers: they are activations,
  not temporaries).
- **plan**: ``mpidp.preflight.plan.plan_model``'s activation bytes for that rank (the outputs
  of every spatial layer on its rows), from a dry run on meta tensors.

Every figure is for the fullest rank; "of serial" divides by the same model's figure at
P = 1 without mpidp. Bytes are deterministic: the machine's load does not change them.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

GRID = (184, 360)  # a multiple of the AFNO / Swin patch of 8: 23 x 45 tokens
MODELS = ["unet", "afno", "swin", "sharded"]


def build(name: str, channels: int, grid: tuple[int, int]) -> Any:
    from mpidp.models import AFNONet, SwinNet, WeatherUNet

    if name in ("unet", "sharded"):
        return WeatherUNet(channels, channels, grid, width=8)
    if name == "afno":
        return AFNONet(channels, channels, grid, patch=8, embed_dim=64, depth=2)
    return SwinNet(channels, channels, grid, patch=8, embed_dim=64, depth=2, heads=4, window=(4, 5))


def saved_bytes(model: Any, run: Any, loss: Any, buffers: Any = None) -> tuple[int, int]:
    """Bytes of the storages the tensors saved for backward live in (each once), parameters
    excluded, while ``run()`` does the model's forward (then ``loss(out).backward()``: the
    loss's own saved tensors are not the model's); and the bytes of the transport's
    ``buffers`` that back none of them when the forward ends."""
    import torch

    state = [*model.parameters(), *model.buffers()]  # model state, not activations
    params = {p.untyped_storage().data_ptr() for p in state}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    # the transport's buffers that back no saved tensor at the forward's end (its peak)
    extra = 0
    if buffers is not None:
        extra = sum(a.nbytes for a in buffers._arrays if a.ctypes.data not in storages)
    loss(out).backward()
    return sum(storages.values()), extra


def _loss(manager: Any, out: Any) -> Any:
    import mpidp

    if manager is None:
        return out.square().mean()
    return mpidp.global_mean(out.square(), manager=manager)


def worker(args: argparse.Namespace) -> None:
    import torch
    from mpi4py import MPI

    import mpidp
    from mpidp.preflight.plan import plan_model

    torch.manual_seed(0)
    world = MPI.COMM_WORLD
    p, me = world.Get_size(), world.Get_rank()
    m = mpidp.init(domain_parallel_size=p)
    h, w = args.grid
    c = args.channels
    spec = m.spec(h)
    rows = spec.sizes[m.domain_rank]
    result: dict[str, Any] = {"ranks": p}
    for name in MODELS:
        serial = build(name, c, (h, w))
        mpidp.broadcast_parameters(serial, m)
        x = torch.randn(1, c, rows, w)
        t = m.transport()
        if name == "sharded":
            model, feed = serial, mpidp.ShardedTensor.from_local(x, dim=-2, spec=spec, manager=m)
        else:
            plain = p == 1 and args.plain
            model, feed = (serial if plain else mpidp.convert_to_domain_parallel(serial, m)), x
        run = functools.partial(model, feed)
        converted = name != "sharded" and not (p == 1 and args.plain)
        loss = functools.partial(_loss, m if converted else None)
        saved_bytes(model, run, loss)  # warm-up: the buffers' peak counts from the second step
        buffers = getattr(t, "buffers", None)
        if buffers is not None:
            buffers.peak_bytes = buffers.held_bytes()
        saved, temporary = saved_bytes(model, run, loss, buffers)
        peak = buffers.peak_bytes if buffers is not None else 0
        idle = buffers.idle_bytes() if buffers is not None else 0
        planned = plan_model(build(name, c, (h, w)), (1, c, h, w), p).ranks[me].activation_bytes
        mine = {"saved": saved, "buffers": peak, "idle": idle, "temporary": temporary}
        mine.update(plan=planned, rows=rows)
        everyone = world.allgather(mine)
        result[name] = max(everyone, key=lambda r: r["saved"])
        result[name]["per_rank_saved"] = [r["saved"] for r in everyone]
    if me == 0:
        print(json.dumps(result))
    m.shutdown()


def driver(args: argparse.Namespace) -> None:
    from common import run_worker

    common = ["--grid", *map(str, args.grid), "--channels", str(args.channels)]
    serial = run_worker(__file__, 1, [*common, "--plain"])
    runs = [run_worker(__file__, p, common) for p in (1, 2, 4)]
    h = args.grid[0]
    print(
        f"memory per rank (the fullest), grid {tuple(args.grid)}, {args.channels} channels, "
        f"float32: MB, and the ratio to the serial model's saved bytes"
    )
    head = f"{'model':<8}{'P':>3}{'rows':>6}{'saved MB':>10}{'of serial':>11}{'ideal':>8}"
    head += f"{'buffers MB':>12}{'idle MB':>9}{'temp MB':>9}{'of saved':>10}"
    print(head + f"{'plan MB':>9}{'saved/plan':>12}")
    table = []
    for name in MODELS:
        base = serial[name]["saved"]
        for r in runs:
            row = r[name]
            p = r["ranks"]
            entry = {
                "model": name,
                "ranks": p,
                "rows": row["rows"],
                "saved_bytes": row["saved"],
                "serial_saved_bytes": base,
                "saved_of_serial": row["saved"] / base,
                "ideal": row["rows"] / h,
                "buffer_bytes": row["buffers"],
                "idle_buffer_bytes": row["idle"],
                "temporary_bytes": row["temporary"],
                "temporary_of_saved": row["temporary"] / row["saved"],
                "plan_bytes": row["plan"],
                "saved_over_plan": row["saved"] / row["plan"] if row["plan"] else None,
                "per_rank_saved": row["per_rank_saved"],
            }
            table.append(entry)
            ratio = f"{entry['saved_over_plan']:.2f}" if row["plan"] else "-"
            print(
                f"{name:<8}{p:>3}{row['rows']:>6}{row['saved'] / 2**20:>10.1f}"
                f"{entry['saved_of_serial']:>11.3f}{entry['ideal']:>8.3f}"
                f"{row['buffers'] / 2**20:>12.1f}{row['idle'] / 2**20:>9.1f}"
                f"{row['temporary'] / 2**20:>9.2f}{entry['temporary_of_saved']:>10.3f}"
                f"{row['plan'] / 2**20:>9.1f}{ratio:>12}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--grid", type=int, nargs=2, default=list(GRID))
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--plain", action="store_true", help="P = 1: the models without mpidp")
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
