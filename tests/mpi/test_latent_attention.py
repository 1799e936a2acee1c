"""Attention from whole queries (learned latents) to keys and values cut along the sequence:
a Perceiver-style aggregator over a field's tokens, with and without a key padding mask, and
with logits far beyond exp's range, through both front ends (``convert_to_domain_parallel``
and ShardedTensor input) against serial torch, float64, uneven bands (an empty one at 4
ranks: 3 rows), 1e-10: outputs, input gradients and every parameter gradient. The keys never
move: the bytes sent are the latents' size (a counting test). A mutation that merges the
blocks without the max shift fails the large-logit case."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import mpidp
import mpidp.ops.attention
from mpidp.sharded import shard
from mpidp.testing import assert_matches_serial, count_traffic
from tests.mpi.helpers import check_sharded, rand

WORLD = MPI.COMM_WORLD.Get_size()
F64 = torch.float64
C, W, HEADS, LATENTS = 4, 5, 2, 3


@pytest.fixture(scope="module")
def m():
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as manager:
        yield manager


class LatentAggregator(nn.Module):
    """Learned latent queries attend to the field's tokens (keys and values projected from
    the band); the attended latents, pooled, come back into the field as a bias."""

    def __init__(
        self,
        masked: bool = False,
        loud: float = 1.0,
        stride: int = 1,
        manual: bool = False,
        module: bool = False,
    ) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(HEADS, LATENTS, C // HEADS) * loud)
        self.kv = nn.Linear(C, 2 * C)
        self.back = nn.Linear(C, C)
        self.conv = nn.Conv2d(C, C, 3, padding=1, stride=stride)
        self.masked, self.manual = masked, manual
        self.mha = nn.MultiheadAttention(C, HEADS, batch_first=True) if module else None

    def forward(self, x):
        f = self.conv(x)
        b, c, h, w = f.shape
        tokens = f.flatten(2).transpose(1, 2)  # (B, H W, C): the band's rows
        k, v = self.kv(tokens).chunk(2, dim=-1)
        k, v = (z.reshape(b, h * w, HEADS, c // HEADS).transpose(1, 2) for z in (k, v))
        q = self.latents.expand(b, -1, -1, -1)
        mask = None
        if self.masked:  # every third token is padding
            keep = torch.arange(h * w) % 3 != 1
            mask = keep.view(1, 1, 1, h * w).expand(b, 1, LATENTS, h * w)
        if self.mha is not None:  # torch's module: its own projections, weights returned
            pad = (torch.arange(h * w) % 3 == 1).expand(b, h * w) if self.masked else None
            q = self.latents.reshape(1, LATENTS, -1).expand(b, -1, -1)
            att, weights = self.mha(q, tokens, tokens, key_padding_mask=pad)
            pooled = att.mean(1) + weights.amax(-1).mean()
            return x + self.back(pooled)[:, :, None, None]
        if self.manual:  # the written-out form, through the matmul and softmax rules
            att = torch.softmax(q @ k.transpose(-2, -1) / (c // HEADS) ** 0.5, dim=-1) @ v
        else:
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, heads, L, hd)
        pooled = att.transpose(1, 2).reshape(b, LATENTS, c).mean(1)
        return x + self.back(pooled)[:, :, None, None]


CASES = {
    "latents": {},
    "key padding mask": {"masked": True},
    "logits past exp's range": {"loud": 4e3},
    "written out": {"manual": True},
    "nn.MultiheadAttention": {"module": True},
    "nn.MultiheadAttention, key padding mask": {"module": True, "masked": True},
}


def build(case, stride=1):
    torch.manual_seed(11)
    return LatentAggregator(**CASES[case], stride=stride).to(F64)


# (rows, stride): 5 rows over 4 ranks strided to 3, so one band of tokens is empty
ROWS = [(7, 1)] + ([(5, 2)] if WORLD == 4 else [])


@pytest.mark.parametrize(("rows", "stride"), ROWS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_latent_cross_attention_on_sharded_tensors(m, case, rows, stride):
    model = build(case, stride)
    check_sharded(m, model, rand((2, C, rows, W), 1), dim=2, module=model)


@pytest.mark.parametrize(("rows", "stride"), ROWS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_latent_cross_attention_through_conversion(m, case, rows, stride):
    serial = build(case, stride)
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), m)
    assert_matches_serial(
        serial, dist, [rand((2, C, rows, W), 2)], manager=m, modules=(serial, dist),
        rtol=1e-10, atol=1e-12,
    )  # fmt: skip


def test_the_keys_never_move(m):
    """The merge sends the latents' sums (B x heads x L x (head_dim + 1) values, and their
    maxima), whatever the field's size."""
    model = build("latents")
    sent = []
    for rows in (8, 32):
        x = shard(rand((1, C, rows, W), 3), 2, m)
        with count_traffic(m) as traffic:
            y = model.conv(x).flatten(2).transpose(1, 2)
            k, v = (z.reshape(1, rows * W, HEADS, 2).transpose(1, 2) for z in (y, y))
            F.scaled_dot_product_attention(model.latents.expand(1, -1, -1, -1), k, v)
        sent.append(traffic.bytes)
    assert sent[0] == sent[1], sent  # independent of the number of keys
    keys = 32 * W * C * 8 // WORLD  # the keys of one band at 32 rows, float64
    assert sent[1] < keys, (sent, keys)


@pytest.mark.mpi(min_size=2)
def test_without_the_max_shift_the_large_logits_fail(m, monkeypatch):
    """Mutation: blocks merged with exp(s) instead of exp(s - M) overflow."""
    real = mpidp.ops.attention.attention_over_key_band

    def unshifted(
        q, k, v, start, total, group=None, attn_mask=None, is_causal=False, scale=None, **_
    ):
        from mpidp.ops.collectives import reduce_from

        scores = (q @ k.transpose(-2, -1)) * (scale or 1.0 / q.size(-1) ** 0.5)
        weights = torch.exp(scores)
        total_ = reduce_from(torch.cat([weights @ v, weights.sum(-1, keepdim=True)], -1), group)
        return total_[..., :-1] / total_[..., -1:]

    monkeypatch.setattr("mpidp.sharded.products.attention_over_key_band", unshifted)
    model = build("logits past exp's range")
    with pytest.raises(AssertionError):
        check_sharded(m, model, rand((2, C, 7, W), 1), dim=2, module=model)
    assert real is mpidp.ops.attention.attention_over_key_band


def _dropped_attention(m, p):
    q, k, v = (
        rand(s, i).requires_grad_()
        for i, s in ((21, (2, 2, 3, 4)), (22, (2, 2, 9, 4)), (23, (2, 2, 9, 4)))
    )
    spec, t = m.spec(9), m.transport()
    start, rows = spec.start(t.rank), spec.sizes[t.rank]
    torch.manual_seed(5)  # the same on every rank: each rank's band stream derives from it
    out, probs = mpidp.ops.attention.attention_over_key_band(
        q, k.narrow(2, start, rows), v.narrow(2, start, rows), start, 9, t, weights=True,
        dropout_p=p,
    )  # fmt: skip
    return q, k, v, out, probs, spec, t


@pytest.mark.parametrize("p", [0.0, 0.4])
def test_dropout_is_the_serial_attention_for_the_mask_drawn(m, p):
    """With dropout the result is serial attention under the mask the ranks drew (read off
    the dropped probabilities they return), the normaliser taken before the drop as torch
    does: probabilities, output and the gradients of q, k and v at 1e-10; about p of the
    probabilities dropped; the default generators still in step. A mutation that normalises
    by the kept probabilities fails."""
    q, k, v, out, probs, spec, t = _dropped_attention(m, p)
    g = rand(tuple(out.shape), 24)
    (out * g).sum().backward()
    got = [t.all_reduce(z.grad, "sum") for z in (q, k, v)]  # shares and rows, summed
    dropped = mpidp.all_gather_v_replicated(probs.detach(), spec.sizes, dim=-1, group=t)
    qs, ks, vs = (z.detach().clone().requires_grad_() for z in (q, k, v))
    keep = dropped != 0
    want = torch.softmax(qs @ ks.transpose(-2, -1) / 2.0, dim=-1) * keep / (1 - p)
    if p:
        assert 0.25 < 1 - keep.double().mean() < 0.55, keep.double().mean()
    else:
        assert keep.all()
    torch.testing.assert_close(dropped, want.detach(), rtol=1e-10, atol=1e-12)
    ref = want @ vs
    torch.testing.assert_close(out.detach(), ref.detach(), rtol=1e-10, atol=1e-12)
    (ref * g).sum().backward()
    for name, a, b in zip("qkv", got, (qs, ks, vs), strict=True):
        torch.testing.assert_close(a, b.grad, rtol=1e-10, atol=1e-12, msg=name)
    prints = torch.tensor([float(mpidp.runtime.rng.fingerprint())], dtype=F64)
    assert t.all_reduce(prints.clone(), "max") == t.all_reduce(prints.clone(), "min")


@pytest.mark.mpi(min_size=2)  # one rank: a converted layer is torch's module, its own draws
@pytest.mark.parametrize("module", [False, True], ids=["sdpa", "nn.MultiheadAttention"])
def test_dropout_in_training_is_the_same_draw_on_both_front_ends(m, module):
    """A latent aggregator with attention dropout, in training mode: converted and on
    ShardedTensors it draws the same masks from the same seed (one rule), so the outputs
    agree to 1e-10; the drop changes the result; the generators stay in step."""
    torch.manual_seed(11)
    model = Dropped(module).to(F64).train()
    x = rand((2, C, 7, W), 4)
    torch.manual_seed(3)
    y = model(shard(x, 2, m))
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(model), m)
    torch.manual_seed(3)
    spec = m.spec(7)
    r = m.transport().rank
    y2 = dist(x.narrow(2, spec.start(r), spec.sizes[r]))
    torch.testing.assert_close(y2, y.local.detach(), rtol=1e-10, atol=1e-12)
    quiet = model.eval()(shard(x, 2, m))
    assert (quiet.local - y.local).abs().max() > 1e-6
    prints = torch.tensor([float(mpidp.runtime.rng.fingerprint())], dtype=F64)
    t = m.transport()
    assert t.all_reduce(prints.clone(), "max") == t.all_reduce(prints.clone(), "min")


class Dropped(LatentAggregator):
    """The aggregator with attention dropout 0.3 (SDPA's dropout_p, or the module's)."""

    def __init__(self, module: bool) -> None:
        super().__init__(module=module)
        if module:
            self.mha = nn.MultiheadAttention(C, HEADS, dropout=0.3, batch_first=True)

    def forward(self, x):
        if self.mha is not None:
            return super().forward(x)
        f = self.conv(x)
        b, c, h, w = f.shape
        tokens = f.flatten(2).transpose(1, 2)
        k, v = (
            z.reshape(b, h * w, HEADS, c // HEADS).transpose(1, 2)
            for z in self.kv(tokens).chunk(2, -1)
        )
        q = self.latents.expand(b, -1, -1, -1)
        att = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3 if self.training else 0.0)
        return x + self.back(att.transpose(1, 2).reshape(b, LATENTS, c).mean(1))[:, :, None, None]
