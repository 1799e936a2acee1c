"""anemoi's distributed primitives (mpidp.anemoi) against their stated meaning, computed from
every rank's data: forward, and the gradient each rank receives for a loss that is the sum of
every rank's part (float64, uneven and empty cuts, anemoi's per-rank shapes, both
transports)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import rand
from mpi4py import MPI

import mpidp

with warnings.catch_warnings():  # the pre-move module, on purpose (its warning: tests/unit)
    warnings.filterwarnings("ignore", "mpidp.anemoi has moved", DeprecationWarning)
    from mpidp import anemoi

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
ME = MPI.COMM_WORLD.Get_rank()


def cuts():
    out = {"uneven": list(mpidp.ShardSpec.balanced(2 * WORLD + 1, WORLD).sizes)}
    if WORLD > 1:
        out["empty"] = [0] + [2] * (WORLD - 1)
    return out


def everyone(t, x):
    """Every rank's tensor, in rank order."""
    return [torch.as_tensor(z) for z in t.all_gather_object(x.detach())]


@pytest.mark.parametrize("cut", list(cuts()))
def test_primitives_mean_what_anemoi_says(t, cut):
    sizes = cuts()[cut]
    n, lo = sum(sizes), sum(sizes[:ME])
    mine = slice(lo, lo + sizes[ME])
    shapes = [(3, s, 2) for s in sizes]  # anemoi passes per-rank shapes; dim 1 is taken
    full = rand((3, n, 2), 1)  # the same on every rank
    part = rand((3, sizes[ME], 2), 10 + ME)
    parts = everyone(t, part)
    whole = torch.cat(parts, 1)

    def run(f, x, w):
        """f(x), and x's gradient for the loss sum over ranks of <f(x), w_rank>."""
        x = x.clone().requires_grad_()
        y = f(x)
        (y * w).sum().backward()
        return y.detach(), x.grad

    # shard: split forward; backward gathers (replicated input) or keeps the part
    w = rand((3, sizes[ME], 2), 20 + ME)
    ws = torch.cat(everyone(t, w), 1)
    y, g = run(lambda x: anemoi.shard_tensor(x, 1, shapes, t), full, w)
    assert torch.equal(y, full[:, mine]) and torch.equal(g, ws)
    y, g = run(lambda x: anemoi.shard_tensor(x, 1, sizes, t, gather_in_backward=False), full, w)
    want = torch.zeros_like(full)
    want[:, mine] = w
    assert torch.equal(y, full[:, mine]) and torch.equal(g, want)
    # gather: the whole tensor; a replicated downstream (one w on every rank) gives the part
    w = rand((3, n, 2), 30)
    y, g = run(lambda x: anemoi.gather_tensor(x, 1, sizes, t), part, w)
    assert torch.equal(y, whole) and torch.equal(g, w[:, mine])
    # sync: the whole tensor; a downstream that differs by rank: the summed gradient's part
    w = rand((3, n, 2), 40 + ME)
    wsum = sum(everyone(t, w))
    y, g = run(lambda x: anemoi.sync_tensor(x, 1, sizes, t), part, w)
    assert torch.equal(y, whole)
    torch.testing.assert_close(g, wsum[:, mine], rtol=1e-14, atol=1e-14)
    # without the gather: the identity on a tensor every rank holds, gradients summed
    y, g = run(lambda x: anemoi.sync_tensor(x, 1, sizes, t, gather_in_fwd=False), full, w)
    assert torch.equal(y, full)
    torch.testing.assert_close(g, wsum, rtol=1e-14, atol=1e-14)
    # reduce: the sum, identity backward
    x = rand((3, n, 2), 50 + ME)
    xsum = sum(everyone(t, x))
    y, g = run(lambda z: anemoi.reduce_tensor(z, t), x, w)
    torch.testing.assert_close(y, xsum, rtol=1e-14, atol=1e-14)
    assert torch.equal(g, w)
    # reduce + shard: this rank's part of the sum; backward gathers the parts' gradients
    wp = rand((3, sizes[ME], 2), 60 + ME)
    y, g = run(lambda z: anemoi.reduce_shard_tensor(z, 1, sizes, t), x, wp)
    torch.testing.assert_close(y, xsum[:, mine], rtol=1e-14, atol=1e-14)
    assert torch.equal(g, torch.cat(everyone(t, wp), 1))


def test_all_to_all_transpose_and_the_head_exchange(t):
    """Cut along dim 1 -> cut along dim 0 of a (P + 3, n, 2) field, and back."""
    rows = cuts()["uneven"]
    cols = list(mpidp.ShardSpec.balanced(WORLD + 3, WORLD).sizes)
    field = rand((WORLD + 3, sum(rows), 2), 70)
    lo = sum(rows[:ME])
    band = field[:, lo : lo + rows[ME]]
    y = anemoi.all_to_all_transpose(band, 0, cols, 1, rows, t)
    c0 = sum(cols[:ME])
    assert torch.equal(y, field[c0 : c0 + cols[ME]])
    back = anemoi.all_to_all_transpose(y, 1, rows, 0, cols, t)
    assert torch.equal(back, band)
    assert anemoi.shard_heads is mpidp.shard_heads
    with pytest.raises(mpidp.ConfigError, match="neither a size nor a shape"):
        anemoi.gather_tensor(band, 1, [(2,)] * WORLD, t)
