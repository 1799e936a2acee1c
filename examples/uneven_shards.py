"""Research experiment: one model under balanced and weighted latitude partitions.

    mpiexec -n 4 python examples/uneven_shards.py
    mpiexec -n 3 python examples/uneven_shards.py --grid 181x360 --weights 3,1,1

All ranks form one domain group. The same U-Net (same weights) runs forward and backward on
the same field cut three ways: balanced (the default rule: 91 rows over 4 ranks are 23, 23,
23, 22), weighted towards the first rank, and weighted towards the last. For each partition
the script checks that the gathered output and every parameter gradient equal the
one-process result (float64), and reports per rank the rows owned, the compute time of the
same network built for its rows alone and of one domain-parallel forward + backward (medians of
--repeat) and the halo bytes that step moves (from the halo plan, see mpidp plan). Weighted
partitions are how one gives fewer rows to ranks that share a node with I/O or sit on slower
devices; the result does not change. Rank 0 prints.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import mpidp
from mpidp.cli import HelpFormatter
from mpidp.models import WeatherUNet
from mpidp.preflight.plan import plan_model
from mpidp.runtime.partition import Balanced, PartitionPolicy, Weighted


def step_time(model: torch.nn.Module, x: torch.Tensor, repeat: int) -> tuple[float, torch.Tensor]:
    """Median seconds of forward + backward, and the output of the last one."""
    times = []
    for _ in range(repeat):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        y = model(x)
        y.square().sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), y.detach()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--grid", default="91x180", metavar="LATxLON", help="the field's grid")
    p.add_argument("--channels", type=int, default=6, metavar="N", help="the field's channels")
    p.add_argument(
        "--weights",
        default="",
        metavar="W0,W1,...",
        help="one weight per rank for the weighted partition (default: 2,1,1,...)",
    )
    p.add_argument(
        "--repeat", type=int, default=5, metavar="N", help="timed steps; the median is shown"
    )
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    lat, lon = (int(v) for v in args.grid.split("x"))
    world = mpidp.DistributedManager.world_from_launcher()
    heavy = (
        [float(w) for w in args.weights.split(",")] if args.weights else [2.0] + [1.0] * (world - 1)
    )
    policies: list[tuple[str, PartitionPolicy]] = [("balanced", Balanced())]
    if world > 1:
        policies += [
            ("weighted " + ",".join(f"{w:g}" for w in heavy), Weighted(tuple(heavy))),
            ("reversed " + ",".join(f"{w:g}" for w in heavy[::-1]), Weighted(tuple(heavy[::-1]))),
        ]

    torch.manual_seed(0)
    serial = WeatherUNet(args.channels, args.channels, (lat, lon)).double()
    full = torch.randn(1, args.channels, lat, lon, dtype=torch.float64)
    reference = copy.deepcopy(serial)
    want = reference(full)
    want.square().sum().backward()
    want_grads = {n: q.grad for n, q in reference.named_parameters() if q.grad is not None}

    rows_out = []
    first = mpidp.init(domain_parallel_size=world)
    for name, policy in policies:
        manager = mpidp.DistributedManager(domain_parallel_size=world, partition=policy)
        model = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager)
        x = mpidp.shard_tensor(full, manager=manager)
        seconds, y = step_time(model, x, args.repeat)
        # this rank's compute load: the same network built for a grid of its rows alone
        band_net = WeatherUNet(args.channels, args.channels, (max(x.size(-2), 1), lon)).double()
        alone, _ = step_time(band_net, x, args.repeat)
        out_err = (mpidp.gather_tensor(y, manager=manager) - want.detach()).abs().max().item()
        mpidp.sync_gradients(model, manager)  # domain parts summed: the serial gradients
        grad_err = max(  # relative to the largest serial gradient entry of each parameter
            ((g - want_grads[n]).abs().max() / want_grads[n].abs().max()).item()
            for n, g in ((n, q.grad) for n, q in model.named_parameters())
            if g is not None
        )
        times = manager.transport("world", "cpu").all_gather_object((seconds, alone))
        cost = plan_model(serial, tuple(full.shape), world, partition=policy, dtype=torch.float64)
        errors = manager.transport("world", "cpu").all_gather_object((out_err, grad_err))
        worst = tuple(max(e[i] for e in errors) for i in range(2))
        for r in range(world):
            rows_out.append(
                {
                    "partition": name,
                    "rank": r,
                    "rows": cost.ranks[r].rows,
                    "step_seconds": times[r][0],
                    "band_alone_seconds": times[r][1],
                    "halo_bytes": cost.ranks[r].recv_bytes,
                    "max_output_error": worst[0],
                    "max_grad_error": worst[1],
                }
            )
        if world > 1:
            manager.shutdown()
    if first.rank == 0:
        print(
            f"uneven shards: WeatherUNet on {lat} x {lon} x {args.channels}, float64, "
            f"{world} domain ranks; forward + backward, median of {args.repeat}"
        )
        print(
            f"{'partition':<20}{'rank':>5}{'rows':>6}{'band ms':>9}{'step ms':>9}"
            f"{'halo KB in':>12}{'max |out err|':>15}{'max grad err':>14}"
        )
        for row in rows_out:
            print(
                f"{row['partition']:<20}{row['rank']:>5}{row['rows']:>6}"
                f"{row['band_alone_seconds'] * 1e3:>9.1f}{row['step_seconds'] * 1e3:>9.1f}"
                f"{row['halo_bytes'] / 1e3:>12.1f}"
                f"{row['max_output_error']:>15.2e}{row['max_grad_error']:>14.2e}"
            )
        print(
            "band ms: the same network built for this rank's rows alone (its compute load); "
            "step ms: the domain-parallel step, which waits for the slowest rank; "
            "grad err: relative"
        )
        bad = [r for r in rows_out if max(r["max_output_error"], r["max_grad_error"]) > 1e-10]
        for row in bad:
            print(
                f"MISMATCH: partition {row['partition']}, rank {row['rank']}: output error "
                f"{row['max_output_error']:.2e}, gradient error {row['max_grad_error']:.2e} "
                "(more than 1e-10)"
            )
        if not bad:
            print("every partition computes the serial result")
    first.shutdown()
    return rows_out


if __name__ == "__main__":
    main()
