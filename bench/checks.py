"""What the always-on checks cost (issue 19): a collective through the MPI transport with its
checks (a fingerprint all-reduced before the call, the deadline-bounded wait) and without them,
beside raw mpi4py on the same bytes, interleaved in one run.

    mpiexec -n 2 python -m mpi4py bench/checks.py --json docs/bench/checks-p2.json

Ops: all_gather_v (uneven: rank 0 holds one extra float64), all_reduce (the sync_gradients
path), and a halo-sized point-to-point exchange with its receive-count check, 1 KB to 1 MB.
Not a test: compare ratios within one run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch
from common import run_table
from mpi4py import MPI

import mpidp

SIZES = [1 << 10, 1 << 16, 1 << 20]


def cases(
    nbytes: int, t: mpidp.comm.Transport, world: MPI.Comm
) -> dict[str, dict[str, Callable[[], object]]]:
    p, me = world.Get_size(), world.Get_rank()
    n = nbytes // 8
    sizes = [n + (1 if i == 0 else 0) for i in range(p)]
    displs = np.cumsum([0, *sizes[:-1]]).tolist()
    mine = torch.randn(sizes[me], dtype=torch.float64)
    out = np.empty(sum(sizes))
    grads = torch.randn(n, dtype=torch.float64)
    red = np.empty(n)
    peer = (me + 1) % p
    src = (me - 1) % p
    strip, into = torch.randn(n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)

    def switch(fn: Callable[[], object], on: bool) -> Callable[[], object]:
        def run() -> object:
            t._checks = on  # type: ignore[attr-defined]
            try:
                return fn()
            finally:
                t._checks = True  # type: ignore[attr-defined]

        return run

    def exchange() -> None:
        t.exchange([(peer, strip)], [(src, into)])

    def raw_exchange() -> None:
        world.Sendrecv(strip.numpy(), dest=peer, recvbuf=into.numpy(), source=src)

    gather = lambda: t.all_gather_v(mine, sizes)  # noqa: E731
    reduce = lambda: t.all_reduce(grads, "sum")  # noqa: E731
    return {
        "all_gather_v": {
            "raw mpi4py Allgatherv": lambda: world.Allgatherv(
                mine.numpy(), [out, sizes, displs, MPI.DOUBLE]
            ),
            "mpidp, unchecked": switch(gather, False),
            "mpidp, checked (default)": switch(gather, True),
        },
        "all_reduce": {
            "raw mpi4py Allreduce": lambda: world.Allreduce(grads.numpy(), red, op=MPI.SUM),
            "mpidp, unchecked": switch(reduce, False),
            "mpidp, checked (default)": switch(reduce, True),
        },
        "exchange": {
            "raw mpi4py Sendrecv": raw_exchange,
            "mpidp (count checked)": exchange,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=400)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    with mpidp.DistributedManager(domain_parallel_size=world.Get_size()) as m:
        t = m.transport()
        run_table(
            f"checks, P = {world.Get_size()} (ms; x raw = ratio to raw mpi4py)",
            SIZES,
            lambda nbytes: cases(nbytes, t, world),
            world,
            args.repeats,
            args.json,
        )


if __name__ == "__main__":
    main()
