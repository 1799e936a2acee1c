"""Distributed FFT benchmark: mpidp.ops.fft beside torch.fft and raw mpi4py, and one AFNO block.

    python bench/fft.py --json docs/bench/fft.json        # launches P = 1, 2, 4 in turn

Per P (``mpiexec -n P``, one thread per rank, float32, a (1, 64, 720, 1440) field):

* ``rfft2+irfft2``: ``mpidp.ops.fft.irfft2(mpidp.ops.fft.rfft2(band))`` (partitions given: the two
  all-to-alls and the local transforms), against ``torch.fft`` of the whole field on one rank
  (the P = 1 row);
* ``transpose``: the all-to-all of rfft2 alone (the (1, 64, rows, 721) complex64 half-spectrum
  of the band to all rows of this rank's modes) through ``mpidp.all_to_all_v``, against raw
  mpi4py ``Alltoallv`` of the same bytes from a packed buffer into a preallocated one (the
  floor: no packing, no unpacking), in the same run, interleaved;
* ``afno block``: forward + backward of one converted :class:`mpidp.models.AFNOBlock` on the
  FourCastNet token grid of 720 x 1440 at patch 8 (90 x 180 tokens, 768 channels, 8 blocks,
  MLP ratio 4), against the plain block at P = 1 and, at P > 1, the plain block on the band
  alone ("band": the compute floor, no exchange).

Times are the median over rounds of the slowest rank. Not a test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FIELD = (1, 64, 720, 1440)
TOKENS = (90, 180)
DIM = 768


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from common import timed_round_robin
    from mpi4py import MPI

    import mpidp
    import mpidp.ops.fft as mfft
    from mpidp.models import AFNOBlock

    torch.manual_seed(0)
    world = MPI.COMM_WORLD
    p, me = world.Get_size(), world.Get_rank()
    m = mpidp.init(domain_parallel_size=p)
    b, c, h, w = FIELD
    rows = m.spec(h)
    k = w // 2 + 1
    modes = mfft.mode_spec(k, manager=m)
    x = torch.randn(b, c, rows[me], w)
    out: dict[str, dict[str, float]] = {}

    def round_trip() -> None:
        X = mfft.rfft2(x, manager=m, spec=rows)
        mfft.irfft2(X, s=(h, w), manager=m, spec=modes, out_spec=rows)

    fns = {"mpidp": round_trip}
    if p == 1:
        fns["torch"] = lambda: torch.fft.irfft2(torch.fft.rfft2(x), s=(h, w))
    out["rfft2+irfft2"] = timed_round_robin(fns, world, args.repeats)

    if p > 1:
        half = torch.fft.rfft(x, dim=-1)  # (b, c, rows, k) complex64
        t = m.transport()
        per_row = b * c  # complex values per (row, mode)
        send = [rows[me] * n * per_row for n in modes]  # to rank j: my rows of j's modes
        recv = [r * modes[me] * per_row for r in rows]  # from rank i: its rows of my modes
        packed = np.empty(sum(send), dtype=np.complex64)
        got = np.empty(sum(recv), dtype=np.complex64)
        sd = np.cumsum([0, *send[:-1]]).tolist()
        rd = np.cumsum([0, *recv[:-1]]).tolist()

        def raw() -> None:
            world.Alltoallv([packed, send, sd, MPI.COMPLEX], [got, recv, rd, MPI.COMPLEX])

        def ours() -> None:
            mpidp.all_to_all_v(half, modes, rows, split_dim=-1, cat_dim=-2, group=t)

        out["transpose"] = timed_round_robin({"raw": raw, "mpidp": ours}, world, args.repeats)

    tok_rows = m.spec(TOKENS[0])
    block = AFNOBlock(DIM, TOKENS, 4.0, num_blocks=8)
    mpidp.broadcast_parameters(block, m)
    plain = AFNOBlock(DIM, (tok_rows[me], TOKENS[1]), 4.0, num_blocks=8)
    dist = mpidp.convert_to_domain_parallel(block, m) if p > 1 else block
    tokens = torch.randn(1, tok_rows[me], TOKENS[1], DIM, requires_grad=True)

    def step(model: torch.nn.Module) -> None:
        model.zero_grad(set_to_none=True)
        model(tokens).square().mean().backward()

    fns = {"mpidp" if p > 1 else "torch": lambda: step(dist)}
    if p > 1:
        fns["band"] = lambda: step(plain)
    out["afno block"] = timed_round_robin(fns, world, max(3, args.repeats // 2))
    if me == 0:
        print(json.dumps({"ranks": p, "ms": out}))
    m.shutdown()


def driver(args: argparse.Namespace) -> None:
    from common import run_worker

    runs = [run_worker(__file__, ranks, ["--repeats", str(args.repeats)]) for ranks in (1, 2, 4)]
    serial = runs[0]["ms"]
    torch_fft, block_1 = serial["rfft2+irfft2"]["torch"], serial["afno block"]["torch"]
    print(
        f"mpidp.ops.fft, field {FIELD} float32; AFNO block on {TOKENS} tokens x {DIM}; "
        f"1 thread per rank; median ms of the slowest rank"
    )
    print(f"{'P':>3}  {'op':<14}{'impl':<8}{'ms':>10}  ratio")
    rows = []
    for run in runs:
        p = run["ranks"]
        for op, impls in run["ms"].items():
            for impl, ms in impls.items():
                if op == "rfft2+irfft2":
                    ratio, what = torch_fft / ms, "speed-up vs torch.fft at P = 1"
                elif op == "transpose":
                    ratio, what = ms / impls["raw"], "x raw Alltoallv"
                else:
                    ratio, what = block_1 / ms, "speed-up vs the plain block at P = 1"
                rows.append({"ranks": p, "op": op, "impl": impl, "ms": ms, "ratio": ratio})
                print(f"{p:>3}  {op:<14}{impl:<8}{ms:>10.1f}  {ratio:.2f} ({what})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
