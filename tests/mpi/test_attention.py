"""anemoi-style head/sequence exchange (mpidp.attention) against serial attention: uneven
sequence cuts and uneven head counts, batch > 1, masks, float64, both transports; forward and
the q, k, v gradients of every rank's rows; the exchange's adjoint."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import mpidp
from mpidp.attention import head_spec, shard_heads, shard_sequence
from tests.mpi.helpers import adjoint_gap, rand

WORLD = MPI.COMM_WORLD.Get_size()
ME = MPI.COMM_WORLD.Get_rank()


def cuts(n: int) -> dict[str, list[int]]:
    thin = [1] * (WORLD - 1) + [n - WORLD + 1]
    return {"balanced": list(mpidp.ShardSpec.balanced(n, WORLD).sizes), "thin": thin}


@pytest.mark.parametrize("cut", ["balanced", "thin"])
@pytest.mark.parametrize("heads", [WORLD + 3, 1], ids=["uneven", "one"])
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "mask"])
def test_attention_through_the_head_exchange_equals_serial(t, cut, heads, masked):
    b, n, c = 2, 3 * WORLD + 4, 3
    sizes = cuts(n)[cut]
    lo, hi = sum(sizes[:ME]), sum(sizes[: ME + 1])
    q, k, v = (rand((b, heads, n, c), s) for s in (1, 2, 3))
    mask = rand((1, heads, n, n), 4) if masked else None
    w = rand((b, heads, n, c), 5)
    ref = [z.clone().requires_grad_() for z in (q, k, v)]
    (F.scaled_dot_product_attention(*ref, attn_mask=mask) * w).sum().backward()

    bands = [z[:, :, lo:hi].clone().requires_grad_() for z in (q, k, v)]
    moved = [shard_heads(z, sizes, group=t) for z in bands]
    hs = head_spec(heads, WORLD)
    my_mask = None if mask is None else mask[:, hs.slice(ME)]
    out = F.scaled_dot_product_attention(*moved, attn_mask=my_mask)
    assert out.shape == (b, hs.sizes[ME], n, c)
    band = shard_sequence(out, sizes, heads, group=t)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)[:, :, lo:hi]
    torch.testing.assert_close(band, want, rtol=1e-10, atol=1e-12)
    (band * w[:, :, lo:hi]).sum().backward()  # the loss is the sum of every rank's part
    for mine, full in zip(bands, ref, strict=True):
        torch.testing.assert_close(mine.grad, full.grad[:, :, lo:hi], rtol=1e-10, atol=1e-12)


def test_the_exchange_is_its_own_adjoint(t):
    n, heads = 2 * WORLD + 3, WORLD + 2
    sizes = cuts(n)["balanced"]
    x = rand((2, heads, sizes[ME], 3), 30 + ME).requires_grad_()
    gap = adjoint_gap(t, lambda z: shard_heads(z, sizes, group=t), x)
    assert gap < 1e-12
    hs = head_spec(heads, WORLD)
    y = rand((2, hs.sizes[ME], n, 3), 40 + ME).requires_grad_()
    gap = adjoint_gap(t, lambda z: shard_sequence(z, sizes, heads, group=t), y)
    assert gap < 1e-12


def test_anemoi_shapes_and_a_wrong_one(t):
    """anemoi passes the shard shapes, not lengths; a shape without a sequence dim is named."""
    n = 2 * WORLD + 1
    sizes = cuts(n)["balanced"]
    x = rand((1, 3, sizes[ME], 2), 9)
    shapes = [(1, 3, s, 2) for s in sizes]
    assert torch.equal(shard_heads(x, shapes, group=t), shard_heads(x, sizes, group=t))
    with pytest.raises(mpidp.ConfigError, match="neither a length nor a shape"):
        shard_heads(x, [(s,) for s in sizes], group=t)
