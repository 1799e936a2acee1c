"""Halo exchange benchmark: mpidp.halo_exchange beside raw mpi4py Sendrecv, in one run.

Run at P = 2 and P = 4:
    mpiexec -n 2 python -m mpi4py bench/halo.py --json halo-p2.json
    mpiexec -n 4 python -m mpi4py bench/halo.py --json halo-p4.json

A (1, 64, 721, 1440) float32 field cut into latitude bands (721 rows: uneven), halos of 1, 2 and
3 rows at both ends. "band" rows: the baseline (ratio 1.00) is what a hand-written exchange
costs, raw mpi4py Sendrecv of the packed halo rows with both neighbours then one ``torch.cat``
of the extended band (edge ranks pad zeros), against ``mpidp.halo_exchange`` returning the same
band through the MPI transport and through torch.distributed (gloo), and as a ShardedTensor's
layers call it ("known spec": the partition travels with the tensor, the arguments are agreed
once instead of at every call); "reused" is the raw
exchange concatenating into one preallocated buffer (mpidp's MPI transport takes its output
from a buffer cache, reused once the caller drops the previous result). "strips" rows: the raw
Sendrecv alone (rows packed, nothing concatenated) against ``mpidp.halo_strips``, which returns
the halo rows without copying the band. "polar" adds the flip and the half-circle roll at the
edge ranks.
The "overlap" rows time a memory-bound interior computation with the strips exchanged before
it, and with the exchange started before it and finished after it. The bytes column is the
halo bytes a rank receives. Not a test: ratios compare within one run.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch
from common import run_table
from mpi4py import MPI

import mpidp
from mpidp.comm import TorchTransport
from mpidp.runtime.partition import known_spec

SHAPE = (1, 64, 721, 1440)


def cases(
    width: int, m: mpidp.DistributedManager, world: MPI.Comm
) -> dict[str, dict[str, Callable[[], object]]]:
    p, me = world.Get_size(), world.Get_rank()
    t_mpi, t_gloo = m.transport(), TorchTransport(m.domain_group)
    spec = m.spec(SHAPE[2])
    x = torch.randn((*SHAPE[:2], spec.sizes[me], SHAPE[3]), dtype=torch.float32)
    strip = (*SHAPE[:2], width, SHAPE[3])
    up = me - 1 if me > 0 else MPI.PROC_NULL
    down = me + 1 if me < p - 1 else MPI.PROC_NULL
    recv_lo, recv_hi = np.zeros(strip, np.float32), np.zeros(strip, np.float32)

    reused = torch.empty((*SHAPE[:2], spec.sizes[me] + 2 * width, SHAPE[3]))

    def raw(cat: str) -> Callable[[], object]:
        def run() -> object:
            first = x[:, :, :width].contiguous().numpy()
            last = x[:, :, -width:].contiguous().numpy()
            world.Sendrecv(first, dest=up, recvbuf=recv_hi, source=down)
            world.Sendrecv(last, dest=down, recvbuf=recv_lo, source=up)
            lo, hi = torch.from_numpy(recv_lo), torch.from_numpy(recv_hi)
            if cat == "new":
                return torch.cat([lo, x, hi], dim=2)
            if cat == "reused":
                return torch.cat([lo, x, hi], dim=2, out=reused)
            return None

        return run

    def ours(fn: Callable[..., object], boundary: str) -> dict[str, Callable[[], object]]:
        return {
            f"mpidp mpi {boundary}": lambda: fn(
                x, width, width, spec=spec, boundary=boundary, group=t_mpi
            ),
            f"mpidp gloo {boundary}": lambda: fn(
                x, width, width, spec=spec, boundary=boundary, group=t_gloo
            ),
        }

    def known(boundary: str) -> Callable[[], object]:
        """As a ShardedTensor's layers call it: the spec travels with the band, so the
        exchange agrees on its arguments once, not at every call."""

        def run() -> object:
            with known_spec(x, 2, spec):
                return mpidp.halo_exchange(
                    x, width, width, spec=spec, boundary=boundary, group=t_mpi
                )

        return run

    def interior() -> torch.Tensor:
        return torch.mul(x, 1.0001)

    def then() -> object:
        mpidp.halo_strips(x, width, width, spec=spec, group=t_mpi)
        return interior()

    def overlapped() -> object:
        pending = mpidp.start_halo_exchange(x, width, width, spec=spec, group=t_mpi, strips=True)
        out = interior()
        pending.wait()
        return out

    out = {
        f"band {width}": {
            "raw Sendrecv + cat": raw("new"),
            "raw Sendrecv + cat, reused": raw("reused"),
            **ours(mpidp.halo_exchange, "zeros"),
            "mpidp mpi zeros, known spec": known("zeros"),
            **ours(mpidp.halo_exchange, "polar"),
        },
        f"strips {width}": {
            "raw Sendrecv": raw("none"),
            **ours(mpidp.halo_strips, "zeros"),
            **ours(mpidp.halo_strips, "polar"),
        },
    }
    if width == 3:
        out["overlap"] = {
            "strips, then compute": then,
            "start, compute, wait": overlapped,
            "compute alone": interior,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--widths", type=int, nargs="*", default=[1, 2, 3])
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    m = mpidp.init(domain_parallel_size=world.Get_size())
    row_bytes = SHAPE[0] * SHAPE[1] * SHAPE[3] * 4
    title = (
        f"halo exchange, {SHAPE} float32, {world.Get_size()} ranks, "
        f"{MPI.Get_library_version().splitlines()[0].strip()}, torch {torch.__version__}"
    )
    run_table(
        title,
        [2 * w * row_bytes for w in args.widths],
        lambda nb: cases(nb // (2 * row_bytes), m, world),
        world,
        args.repeats,
        args.json,
    )
    m.shutdown()


if __name__ == "__main__":
    main()
