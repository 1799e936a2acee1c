"""What ShardedTensor dispatch costs: a small model's training step at P = 1, plain against
converted (its own forward on ShardedTensors) and against the plain model fed a ShardedTensor,
and the cost of one dispatched op.

    python bench/dispatch.py --json docs/bench/dispatch.json

At P = 1 every layer computes what torch computes, so the difference between the plain step
and the converted one is the front end alone: wrapping the input, one dispatch per torch call
in the model's own forward, the converted layers' entry. The per-op rows time ``x + y`` and
``F.gelu(x)`` on a small (1, 8, 16, 16) tensor, plain and as a ShardedTensor (microseconds per
call: the median over batches of 20 calls, interleaved, :func:`per_call`). The steps are
interleaved in one process (bench/common.py), median of the rounds, in wall time and in the
process's CPU time (:func:`cpu_round_robin`: on a shared machine the figure less moved by
the load); each step's Python function calls (:func:`python_calls`) are counted once, a
figure the machine's load does not move. Not a test.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F
    from common import timed_round_robin
    from mpi4py import MPI

    import mpidp
    from mpidp.models import WeatherUNet

    world = MPI.COMM_WORLD
    m = mpidp.init(domain_parallel_size=world.Get_size())
    h, w = args.grid
    torch.manual_seed(0)
    plain = WeatherUNet(4, 4, (h, w), width=8)
    converted = mpidp.convert_to_domain_parallel(copy.deepcopy(plain), m)
    x, y = torch.randn(1, 4, h, w), torch.randn(1, 4, h, w)
    xs, ys = mpidp.shard(x, manager=m), mpidp.shard(y, manager=m)

    def step_plain() -> None:
        plain.zero_grad(set_to_none=True)
        (plain(x) - y).square().mean().backward()

    def step_converted() -> None:
        converted.zero_grad(set_to_none=True)
        (converted(x) - y).square().mean().backward()

    def step_sharded() -> None:
        plain.zero_grad(set_to_none=True)
        (plain(xs) - ys).square().mean().backward()

    steps = {"plain": step_plain, "converted": step_converted, "sharded": step_sharded}
    ms = timed_round_robin(steps, world, args.steps)
    cpu = cpu_round_robin(steps, args.steps)
    calls = {f"{k}_calls": python_calls(fn) for k, fn in steps.items()}
    a, b = torch.randn(1, 8, 16, 16), torch.randn(1, 8, 16, 16)
    sa, sb = mpidp.shard(a, manager=m), mpidp.shard(b, manager=m)
    ops = per_call(
        {
            "add_plain_us": lambda: torch.add(a, b),
            "add_sharded_us": lambda: torch.add(sa, sb),
            "gelu_plain_us": lambda: F.gelu(a),
            "gelu_sharded_us": lambda: F.gelu(sa),
        },
        args.calls,
    )
    if world.Get_rank() == 0:
        row = {"ranks": world.Get_size(), "grid": [h, w], **{f"{k}_ms": v for k, v in ms.items()}}
        row["converted_over_plain"] = ms["converted"] / ms["plain"]
        row["sharded_over_plain"] = ms["sharded"] / ms["plain"]
        row.update({f"{k}_cpu_ms": v for k, v in cpu.items()})
        row["converted_cpu_over_plain"] = cpu["converted"] / cpu["plain"]
        row["sharded_cpu_over_plain"] = cpu["sharded"] / cpu["plain"]
        row.update(ops)
        row.update(calls)
        print(json.dumps(row))
    m.shutdown()


def cpu_round_robin(fns: dict[str, Any], rounds: int) -> dict[str, float]:
    """Milliseconds of this process's CPU time per call of each function: the median over
    ``rounds`` interleaved rounds. On a shared machine a step's wall time also holds the time
    it waited for a core; its CPU time does not (one thread per rank)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.process_time()
            fn()
            samples[name].append((time.process_time() - t0) * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def python_calls(fn: Any) -> int:
    """The Python function calls of one ``fn()`` (cProfile's count, builtins included): what
    the front end adds, independent of the machine's load."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    return int(pstats.Stats(prof).total_calls)  # type: ignore[attr-defined]


def per_call(fns: dict[str, Any], calls: int, batch: int = 20) -> dict[str, float]:
    """Microseconds per call of each function: the median over batches of ``batch`` calls,
    the functions interleaved batch by batch. A batch takes well under a scheduler's time
    slice, so on a shared machine most batches run uninterrupted and the median is the
    call's own cost (a mean over one long loop measures the machine's load as well)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(3):  # warm-up
        for fn in fns.values():
            fn()
    for _ in range(max(calls // batch, 1)):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            samples[name].append((time.perf_counter() - t0) / batch * 1e6)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the rows here (default: print)")
    parser.add_argument("--grid", type=int, nargs=2, default=[64, 128], help="H W")
    parser.add_argument("--steps", type=int, default=20, help="rounds of the three steps")
    parser.add_argument("--calls", type=int, default=2000, help="calls per op timing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from common import run_worker

    cli = ["--grid", *map(str, args.grid), "--steps", str(args.steps), "--calls", str(args.calls)]
    row = run_worker(__file__, 1, cli)
    print(
        f"small U-Net step {tuple(args.grid)}, P = 1: plain {row['plain_ms']:.1f} ms, "
        f"converted {row['converted_ms']:.1f} ms ({row['converted_over_plain']:.2f}x), "
        f"plain fed a ShardedTensor {row['sharded_ms']:.1f} ms ({row['sharded_over_plain']:.2f}x)"
    )
    print(
        f"CPU time per step: plain {row['plain_cpu_ms']:.1f} ms, converted "
        f"{row['converted_cpu_over_plain']:.2f}x, fed {row['sharded_cpu_over_plain']:.2f}x"
    )
    print(
        f"Python calls per step: plain {row['plain_calls']}, converted "
        f"{row['converted_calls']}, fed {row['sharded_calls']}"
    )
    print(
        f"one op on a (1, 8, 16, 16) tensor: add {row['add_plain_us']:.1f} -> "
        f"{row['add_sharded_us']:.1f} us, gelu {row['gelu_plain_us']:.1f} -> "
        f"{row['gelu_sharded_us']:.1f} us"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
