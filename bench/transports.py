"""Transport benchmark: mpidp's MPI and torch transports beside raw mpi4py, in one run.

Run: mpiexec -n 2 python -m mpi4py bench/transports.py [--json out.json]
Times point-to-point exchange (ring, both neighbours) and uneven all_gather_v from 1 KB to
16 MB per rank. Prints a table (median of repeats, ms) and the ratio to raw MPI; compare
ratios within one run, since the machine is shared and noisy. Not a test.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import torch
from common import timed
from mpi4py import MPI

import mpidp

SIZES = [1 << 10, 1 << 16, 1 << 20, 1 << 24]  # bytes per rank


def cases(nbytes: int, m: mpidp.DistributedManager, world: MPI.Comm) -> dict[str, dict[str, Any]]:
    """The timed calls for one message size, every implementation moving the same bytes."""
    p, me = world.Get_size(), world.Get_rank()
    nxt, prv = (me + 1) % p, (me - 1) % p
    t_mpi, t_torch = m.transport(), mpidp.comm.TorchTransport(m.domain_group)
    n = nbytes // 8
    x = torch.randn(n, dtype=torch.float64)
    r_out = torch.empty(n, dtype=torch.float64)
    sizes = [n + (1 if i == 0 else 0) for i in range(p)]  # uneven
    mine = torch.randn(sizes[me], dtype=torch.float64)
    a, b = x.numpy(), r_out.numpy()
    gathered = np.empty(sum(sizes))
    displs = np.cumsum([0, *sizes[:-1]]).tolist()

    def raw_p2p() -> None:
        world.Sendrecv(a, dest=nxt, recvbuf=b, source=prv)

    def raw_gather() -> None:
        world.Allgatherv(mine.numpy(), [gathered, sizes, displs, MPI.DOUBLE])

    def raw_gather_fresh() -> None:
        # What a call that returns a new tensor must also pay: a fresh output buffer.
        out = np.empty(sum(sizes))
        world.Allgatherv(mine.numpy(), [out, sizes, displs, MPI.DOUBLE])

    return {
        "exchange": {
            "raw mpi4py": raw_p2p,
            "mpidp mpi": lambda: t_mpi.exchange([(nxt, x)], [(prv, r_out)]),
            "mpidp torch(gloo)": lambda: t_torch.exchange([(nxt, x)], [(prv, r_out)]),
        },
        "all_gather_v": {
            "raw mpi4py": raw_gather,
            "raw + new buffer": raw_gather_fresh,
            "mpidp mpi": lambda: t_mpi.all_gather_v(mine, sizes),
            "mpidp torch(gloo)": lambda: t_torch.all_gather_v(mine, sizes),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    m = mpidp.init(domain_parallel_size=MPI.COMM_WORLD.Get_size())
    world = MPI.COMM_WORLD
    p, me = world.Get_size(), world.Get_rank()
    rows = []
    for nbytes in SIZES:
        for op, impls in cases(nbytes, m, world).items():
            base = None
            for name, fn in impls.items():
                ms = timed(fn, world, args.repeats)
                base = ms if base is None else base
                rows.append(
                    {
                        "op": op,
                        "bytes": nbytes,
                        "impl": name,
                        "ms": ms,
                        "ratio_to_raw": ms / base,
                        "ranks": p,
                    }
                )
    if me == 0:
        print(
            f"transports, {p} ranks, {MPI.Get_library_version().splitlines()[0].strip()}, "
            f"torch {torch.__version__}"
        )
        print(f"{'op':<13}{'bytes':>10}  {'impl':<18}{'ms':>10}{'x raw':>8}")
        for r in rows:
            print(
                f"{r['op']:<13}{r['bytes']:>10}  {r['impl']:<18}{r['ms']:>10.3f}"
                f"{r['ratio_to_raw']:>8.2f}"
            )
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
    m.shutdown()


if __name__ == "__main__":
    main()
