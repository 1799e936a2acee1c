"""anemoi-style head/sequence exchange (mpidp.ops.attention) against serial attention: uneven
sequence cuts and uneven head counts, batch > 1, masks, float64, both transports; forward and
the q, k, v gradients of every rank's rows; the exchange's adjoint."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import mpidp
from mpidp.layers.mha import DomainParallelMultiheadAttention
from mpidp.ops.attention import head_spec, shard_heads, shard_sequence
from mpidp.testing import assert_matches_serial
from tests.mpi.helpers import adjoint_gap, check_sharded, rand

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


# -- nn.MultiheadAttention: converted, and on ShardedTensors --------------------------------


def _mha_case(case: str):
    """(module, masks) for a case; the sequence is 3 P + 2 tokens (uneven at every P)."""
    n = 3 * WORLD + 2
    heads = 1 if case == "one-head" else 3
    mha = torch.nn.MultiheadAttention(
        6, heads, batch_first=case != "seq-first", add_bias_kv=case == "bias-kv",
        add_zero_attn=case == "bias-kv", dtype=torch.float64,
    )  # fmt: skip
    masks = {}
    if case == "masks":
        masks["attn_mask"] = rand((n, n), 11)
        pad = torch.zeros(2, n, dtype=torch.bool)
        pad[0, -2:] = True  # the last tokens of the first sample are padding
        masks["key_padding_mask"] = pad
    return mha, masks, n


MHA_CASES = ["plain", "masks", "one-head", "seq-first", "bias-kv"]


@pytest.mark.parametrize("case", MHA_CASES)
def test_multihead_attention_converted_equals_serial(manager, case):
    """Queries cut along the sequence (uneven; fewer heads than ranks too), keys and values
    gathered: output, input gradient and every parameter gradient equal serial."""
    mha, masks, n = _mha_case(case)
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(mha), manager)
    assert WORLD == 1 or isinstance(dist, DomainParallelMultiheadAttention)
    shape, dim = ((n, 2, 6), -3) if case == "seq-first" else ((2, n, 6), -2)
    x = rand(shape, 12)
    sizes = None  # the manager's balanced cut; "plain": an empty band first, then thin ones
    if case == "plain" and WORLD > 1:
        sizes = (0,) + (1,) * (WORLD - 2) + (n - WORLD + 2,)
    assert_matches_serial(
        lambda z: mha(z, z, z, need_weights=False, **masks)[0],
        lambda z: dist(z, z, z, need_weights=False, **masks)[0],
        [x],
        manager=manager,
        dim=dim,
        sizes=sizes,
        out_sizes=sizes,
        modules=(mha, dist),
    )


def test_multihead_attention_weights_and_refusals(manager):
    mha, masks, n = _mha_case("masks")
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(mha), manager)
    x = rand((2, n, 6), 13)
    spec = manager.spec(n)
    band = x[:, spec.start(ME) : spec.stop(ME)]
    out, weights = dist(band, band, band, **masks)
    want, want_w = mha(x, x, x, **masks)
    torch.testing.assert_close(weights, want_w[:, spec.start(ME) : spec.stop(ME)])
    torch.testing.assert_close(out, want[:, spec.start(ME) : spec.stop(ME)])
    if WORLD > 1:  # a band's own mask (local shapes) is not the serial model's
        with pytest.raises(mpidp.ConfigError, match="expected the whole sequence"):
            dist(band, band, band, attn_mask=masks["attn_mask"][: band.size(1)])
        with pytest.raises(mpidp.ConfigError, match="is_causal=True needs attn_mask"):
            dist(band, band, band, is_causal=True)
    # keys that are not the queries: a band or a whole memory? it must be said
    other = band.clone()
    if WORLD > 1:
        with pytest.raises(mpidp.ConfigError, match=r"set module\.keys = 'sharded'"):
            dist(band, other, other, **masks)
    dist.keys = "sharded"
    torch.testing.assert_close(dist(band, other, other, **masks)[0], out)
    dist.keys = "whole"
    memory = x.clone()  # every rank passes the whole sequence as a memory
    torch.testing.assert_close(dist(band, memory, memory, **masks)[0], out)


@pytest.mark.parametrize("case", ["masks", "one-head", "seq-first"])
def test_multihead_attention_on_sharded_tensors(manager, case):
    """The unconverted module on ShardedTensor tokens (the route a third-party model takes)."""
    mha, masks, n = _mha_case(case)
    dim = 0 if case == "seq-first" else 1
    x = rand((n, 2, 6) if case == "seq-first" else (2, n, 6), 14)
    check_sharded(manager, lambda z: mha(z, z, z, **masks)[0], x, dim=dim, module=mha)


@pytest.mark.parametrize("cut", ["balanced", "thin"])
@pytest.mark.parametrize("window", [2, (5, 1)], ids=["symmetric", "left-heavy"])
def test_sliding_window_attention_equals_serial(t, cut, window):
    """anemoi's window_size: each rank fetches only the keys within the window beyond its band
    (several ranks away on thin bands); forward and q, k, v gradients equal serial SDPA with
    the whole sequence's banded mask."""
    from mpidp.ops.attention import sliding_window_attention

    b, heads, n, c = 2, 3, 3 * WORLD + 4, 4
    left, right = (window, window) if isinstance(window, int) else window
    sizes = cuts(n)[cut]
    lo, hi = sum(sizes[:ME]), sum(sizes[: ME + 1])
    q, k, v = (rand((b, heads, n, c), s) for s in (31, 32, 33))
    i = torch.arange(n)
    band_mask = (i[None, :] >= i[:, None] - left) & (i[None, :] <= i[:, None] + right)
    w = rand((b, heads, n, c), 34)
    ref = [z.clone().requires_grad_() for z in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, attn_mask=band_mask)
    (want * w).sum().backward()
    bands = [z[:, :, lo:hi].clone().requires_grad_() for z in (q, k, v)]
    out = sliding_window_attention(*bands, window, group=t)
    torch.testing.assert_close(out, want[:, :, lo:hi].detach(), rtol=1e-10, atol=1e-12)
    (out * w[:, :, lo:hi]).sum().backward()
    for mine, full in zip(bands, ref, strict=True):
        torch.testing.assert_close(mine.grad, full.grad[:, :, lo:hi], rtol=1e-10, atol=1e-12)
