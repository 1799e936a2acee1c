"""Attention on bands against hand-written MPI: windowed (Swin / Pangu) and Ulysses.

    python bench/attention.py --json docs/bench/attention.json

Run at P = 2 and 4 (one thread per rank, float32); every figure is a median over rounds that
alternate the variants (bench/common.py), so a slow spell of this shared machine hits all of
them alike. Not a test.

- **window**: one shifted window attention (Pangu-style earth-specific bias, windows of 6 x
  12 tokens) on a (1, 93, 180, 96) token grid, forward. ``mpidp``: the converted module on the
  band. ``raw``: the same local work (padding, roll, windows) with the rows moved by
  ``Isend``/``Irecv`` of numpy buffers from a precomputed plan (no checks, no autograd).
  ``gather``: every rank all-gathers the whole grid and runs the serial module. Also the
  rows each rank computes (extended band vs whole grid) and the forward + backward time.
- **ulysses**: ``F.scaled_dot_product_attention`` on ShardedTensor q, k, v (1, 8 heads,
  4096 tokens, 32 channels), sequence cut into bands, against local SDPA between raw
  ``Alltoallv`` of q, k, v and the output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def window_bench(m, world, repeats: int) -> dict:  # type: ignore[no-untyped-def]
    import numpy as np
    import torch
    from common import timed_round_robin
    from mpi4py import MPI
    from torch import nn

    import mpidp
    from mpidp.models.swin import WindowAttention, _window_cut
    from mpidp.models.window import window_rows

    me, p = world.Get_rank(), world.Get_size()
    h, w, c, window = 93, 180, 96, (6, 12)
    torch.manual_seed(0)
    serial = WindowAttention(c, 4, window, shift=True, earth_grid=(h, w))
    dist = mpidp.convert_to_domain_parallel(WindowAttention(c, 4, window, True, (h, w)), m)
    dist.load_state_dict(serial.state_dict())
    spec = m.spec(h)
    full = torch.randn(1, h, w, c)
    x = full[:, spec.start(me) : spec.stop(me)].contiguous()
    first, wanted, runs, keep = window_rows(spec.sizes, window[0], serial.shift[0], me)
    lo_w, hi_w = _window_cut(w, window[1])
    grid = (h + sum(_window_cut(h, window[0])), w + lo_w + hi_w)

    # what each rank sends whom: the parts of the ranks' wanted runs inside this band
    a, b = spec.start(me), spec.stop(me)
    sends = [(q, max(s, a), min(e, b)) for q in range(p) if q != me for s, e in wanted[q]]
    sends = [(q, s, e) for q, s, e in sends if e > s]
    recvs = []  # (position in my extension, owner, lo, hi)
    at = 0
    for row, n in runs:
        if row is not None:
            for r, s, e in spec.overlaps(row, row + n):
                recvs.append((at + s - row, r, s, e))
        at += n

    def prepare(t: torch.Tensor) -> torch.Tensor:
        y = nn.functional.pad(t, [0, 0, lo_w, hi_w])
        return torch.roll(y, -serial.shift[1], 2)

    def finish(t: torch.Tensor) -> torch.Tensor:
        return torch.roll(t, serial.shift[1], 2).narrow(2, lo_w, w)

    def raw() -> torch.Tensor:
        y = prepare(x)
        ext = torch.zeros(1, sum(n for _, n in runs), y.size(2), c)
        reqs = []
        for pos, r, s, e in recvs:
            if r == me:
                ext[:, pos : pos + e - s] = y[:, s - a : e - a]
            else:
                reqs.append(world.Irecv(ext[:, pos : pos + e - s].numpy(), source=r, tag=s))
        for q, s, e in sends:
            reqs.append(world.Isend(np.ascontiguousarray(y[:, s - a : e - a].numpy()), q, s))
        MPI.Request.Waitall(reqs)
        out = serial._windows(ext, (first, 0), grid).narrow(1, keep, b - a)
        return finish(out)

    def gather() -> torch.Tensor:
        buf = torch.empty(1, h, w, c)
        counts = [n * w * c for n in spec.sizes]
        world.Allgatherv(x.numpy(), [buf.numpy(), counts])
        return serial(buf)[:, a:b]

    def both_ways() -> None:
        xg = x.clone().requires_grad_()
        dist(xg).sum().backward()

    with torch.no_grad():
        got, want = dist(x), raw()
        assert float((got - want).abs().max()) < 1e-5, "raw and mpidp differ"
        ms = timed_round_robin(
            {"mpidp": lambda: dist(x), "raw": raw, "gather": gather}, world, repeats
        )
    ms.update(timed_round_robin({"mpidp_fwd_bwd": both_ways}, world, repeats))
    rows = world.allreduce(sum(n for _, n in runs), op=MPI.MAX)
    return {"ms": ms, "rows_computed_max": rows, "rows_band_max": max(spec.sizes), "rows_all": h}


def ulysses_bench(m, world, repeats: int) -> dict:  # type: ignore[no-untyped-def]
    import numpy as np
    import torch
    import torch.nn.functional as F
    from common import timed_round_robin

    import mpidp
    from mpidp.ops.attention import head_spec

    me, p = world.Get_rank(), world.Get_size()
    heads, seq, ch = 8, 4096, 32
    spec = m.spec(seq)
    hs = head_spec(heads, p)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, spec.sizes[me], ch) for _ in range(3))
    qs, ks, vs = (mpidp.ShardedTensor.from_local(t, dim=2, spec=spec, manager=m) for t in (q, k, v))

    def exchange(t: torch.Tensor, split: int, cut, cat: int, into) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """Part r of ``t`` along ``split`` (cut by ``cut``) to rank r; what arrives from the
        ranks concatenated along ``cat`` (rank r's part has ``into.sizes[r]`` entries)."""
        send = np.concatenate(
            [t.narrow(split, cut.start(r), cut.sizes[r]).numpy().ravel() for r in range(p)]
        )
        shapes = []
        for r in range(p):
            shape = list(t.shape)
            shape[split], shape[cat] = cut.sizes[me], into.sizes[r]
            shapes.append(shape)
        counts = [t.numel() // t.size(split) * cut.sizes[r] for r in range(p)]
        rcounts = [int(np.prod(shape)) for shape in shapes]
        recv = np.empty(sum(rcounts), dtype=np.float32)
        world.Alltoallv([send, counts], [recv, rcounts])
        parts = np.split(recv, np.cumsum(rcounts)[:-1])
        return torch.from_numpy(
            np.concatenate([z.reshape(sh) for z, sh in zip(parts, shapes, strict=True)], cat)
        )

    def to_heads(t: torch.Tensor) -> torch.Tensor:
        return exchange(t, 1, hs, 2, spec)

    def to_rows(t: torch.Tensor) -> torch.Tensor:
        return exchange(t, 2, spec, 1, hs)

    def raw() -> torch.Tensor:
        return to_rows(F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v)))

    def sharded() -> torch.Tensor:
        return F.scaled_dot_product_attention(qs, ks, vs).local

    with torch.no_grad():
        assert float((raw() - sharded()).abs().max()) < 1e-5, "raw and mpidp differ"
        ms = timed_round_robin({"mpidp": sharded, "raw": raw}, world, repeats)
    return {"ms": ms}


def worker(args: argparse.Namespace) -> None:
    import torch
    from mpi4py import MPI

    import mpidp

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    m = mpidp.init(domain_parallel_size=world.Get_size())
    row = {"ranks": world.Get_size()}
    row["window"] = window_bench(m, world, args.repeats)
    row["ulysses"] = ulysses_bench(m, world, args.repeats)
    if world.Get_rank() == 0:
        print(json.dumps(row))
    m.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from common import run_worker

    rows = [run_worker(__file__, ranks, ["--repeats", str(args.repeats)]) for ranks in (2, 4)]
    print("window attention, (1, 93, 180, 96) tokens, windows 6 x 12, shifted, forward, ms")
    print(
        f"{'P':>3} {'mpidp':>8} {'raw':>8} {'ratio':>6} {'gather':>8} {'rows':>10} {'fwd+bwd':>8}"
    )
    for r in rows:
        w = r["window"]
        ms = w["ms"]
        rows_txt = f"{w['rows_computed_max']}/{w['rows_all']}"
        print(
            f"{r['ranks']:>3} {ms['mpidp']:>8.1f} {ms['raw']:>8.1f} {ms['mpidp'] / ms['raw']:>6.2f}"
            f" {ms['gather']:>8.1f} {rows_txt:>10} {ms['mpidp_fwd_bwd']:>8.1f}"
        )
    print("Ulysses SDPA, (1, 8, 4096, 32), forward, ms")
    print(f"{'P':>3} {'mpidp':>8} {'raw':>8} {'ratio':>6}")
    for r in rows:
        ms = r["ulysses"]["ms"]
        print(
            f"{r['ranks']:>3} {ms['mpidp']:>8.1f} {ms['raw']:>8.1f} {ms['mpidp'] / ms['raw']:>6.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
