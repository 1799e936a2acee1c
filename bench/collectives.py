"""Collectives benchmark: mpidp's differentiable v-collectives beside raw mpi4py, in one run.

Run at P = 2 and P = 4:
    mpiexec -n 2 python -m mpi4py bench/collectives.py --json collectives-p2.json
    mpiexec -n 4 python -m mpi4py bench/collectives.py --json collectives-p4.json

Times all_gather_v, scatter_v, gather_v and all_to_all_v from 1 KB to 16 MB (bytes each rank
contributes; rank 0 holds one extra element, so every split is uneven) through the public
``mpidp.*`` functions over the MPI transport and over torch.distributed (gloo), beside raw
mpi4py on numpy buffers (reused: the floor; and into a new buffer per call, which any call that
returns a new tensor also pays) and, for all_gather_v, a padded ``all_gather_into_tensor`` on
gloo plus the unpadding. Bandwidth is bytes per rank / time. Not a test.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from common import run_table
from mpi4py import MPI

import mpidp
from mpidp.comm import TorchTransport

SIZES = [1 << 10, 1 << 16, 1 << 20, 1 << 24]


def cases(
    nbytes: int, m: mpidp.DistributedManager, world: MPI.Comm
) -> dict[str, dict[str, Callable[[], object]]]:
    p, me = world.Get_size(), world.Get_rank()
    t_mpi, t_gloo = m.transport(), TorchTransport(m.domain_group)
    n = nbytes // 8
    sizes = [n + (1 if i == 0 else 0) for i in range(p)]
    displs = np.cumsum([0, *sizes[:-1]]).tolist()
    total = sum(sizes)
    mine = torch.randn(sizes[me], dtype=torch.float64)
    full = torch.randn(total, dtype=torch.float64)
    floor_out = np.empty(total)
    floor_part = np.empty(sizes[me])
    # all_to_all: each rank sends about nbytes in all, uneven parts to every rank.
    send = [n // p + (1 if j < n % p else 0) for j in range(p)]
    everyone = world.allgather(send)
    recv = [everyone[i][me] for i in range(p)]
    a2a_in = torch.randn(sum(send), dtype=torch.float64)
    a2a_out = np.empty(sum(recv))
    sd, rd = np.cumsum([0, *send[:-1]]).tolist(), np.cumsum([0, *recv[:-1]]).tolist()

    def raw_allgather(fresh: bool) -> Callable[[], object]:
        def run() -> None:
            out = np.empty(total) if fresh else floor_out
            world.Allgatherv(mine.numpy(), [out, sizes, displs, MPI.DOUBLE])

        return run

    def raw_scatter(fresh: bool) -> Callable[[], object]:
        def run() -> None:
            out = np.empty(sizes[me]) if fresh else floor_part
            world.Scatterv([full.numpy(), sizes, displs, MPI.DOUBLE], out, root=0)

        return run

    def raw_gather(fresh: bool) -> Callable[[], object]:
        def run() -> None:
            out = (np.empty(total) if fresh else floor_out) if me == 0 else None
            spec = [out, sizes, displs, MPI.DOUBLE] if me == 0 else None
            world.Gatherv(mine.numpy(), spec, root=0)

        return run

    def raw_alltoall(fresh: bool) -> Callable[[], object]:
        def run() -> None:
            out = np.empty(sum(recv)) if fresh else a2a_out
            world.Alltoallv([a2a_in.numpy(), send, sd, MPI.DOUBLE], [out, recv, rd, MPI.DOUBLE])

        return run

    biggest = max(sizes)
    padded_out = torch.empty(biggest * p, dtype=torch.float64)

    def gloo_padded() -> torch.Tensor:
        padded = torch.nn.functional.pad(mine, (0, biggest - sizes[me]))
        dist.all_gather_into_tensor(padded_out, padded, group=m.domain_group)
        parts = padded_out.view(p, biggest)
        return torch.cat([parts[i, : sizes[i]] for i in range(p)])

    def ours(fn: Callable[..., torch.Tensor], *args: object) -> dict[str, Callable[[], object]]:
        return {
            "mpidp mpi": lambda: fn(*args, group=t_mpi),
            "mpidp torch(gloo)": lambda: fn(*args, group=t_gloo),
        }

    return {
        "all_gather_v": {
            "raw Allgatherv": raw_allgather(False),
            "raw Allgatherv, new buffer": raw_allgather(True),
            **ours(mpidp.all_gather_v, mine, sizes, 0),
            "gloo padded all_gather": gloo_padded,
        },
        "scatter_v": {
            "raw Scatterv": raw_scatter(False),
            "raw Scatterv, new buffer": raw_scatter(True),
            **ours(mpidp.scatter_v, full if me == 0 else None, sizes, 0, 0),
        },
        "gather_v": {
            "raw Gatherv": raw_gather(False),
            "raw Gatherv, new buffer": raw_gather(True),
            **ours(mpidp.gather_v, mine, sizes, 0, 0),
        },
        "all_to_all_v": {
            "raw Alltoallv": raw_alltoall(False),
            "raw Alltoallv, new buffer": raw_alltoall(True),
            **ours(mpidp.all_to_all_v, a2a_in, send, recv, 0),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sizes", type=int, nargs="*", default=SIZES)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    m = mpidp.init(domain_parallel_size=world.Get_size())
    title = (
        f"collectives, {world.Get_size()} ranks, "
        f"{MPI.Get_library_version().splitlines()[0].strip()}, torch {torch.__version__}"
    )
    run_table(title, args.sizes, lambda nb: cases(nb, m, world), world, args.repeats, args.json)
    m.shutdown()


if __name__ == "__main__":
    main()
