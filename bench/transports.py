"""Transport benchmark: mpidp's MPI and torch transports beside raw mpi4py, in one run.

Run: mpiexec -n 2 python -m mpi4py bench/transports.py [--json out.json]
Times point-to-point exchange (ring, both neighbours) and uneven all_gather_v from 1 KB to
16 MB per rank. Prints a table (median of repeats, ms) and the ratio to raw MPI; compare
ratios within one run, since the machine is shared and noisy. Not a test.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch
from common import run_table
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
    world = MPI.COMM_WORLD
    m = mpidp.init(domain_parallel_size=world.Get_size())
    title = (
        f"transports, {world.Get_size()} ranks, "
        f"{MPI.Get_library_version().splitlines()[0].strip()}, torch {torch.__version__}"
    )
    run_table(title, SIZES, lambda nb: cases(nb, m, world), world, args.repeats, args.json)
    m.shutdown()


if __name__ == "__main__":
    main()
