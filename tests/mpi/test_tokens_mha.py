"""``nn.MultiheadAttention`` and causal attention over tokens of blocks (issue 46): a block's
rows x columns flattened as the sequence (``mpidp.sharded.tokens_attention``), against the
serial model on the full field at every grid that fits the world (bands are the grid (P, 1):
the band rule runs there, on the same tests).

Float64, a 5 x 7 field (uneven over every grid here), embed 8, 2 heads: the output, the
attention weights where returned, the input gradient and every parameter gradient after
``mpidp.sync_gradients``, asserted only after every collective of a test. Plus the
refusals (dropout over tokens, whole queries against tokens), on every rank.

Six ranks (the grids 2 x 3 and 3 x 2): ``mpiexec -n 6 ... tests/mpi/test_tokens_mha.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import agreed, close, rand, refusal
from torch import nn

import mpidp
from mpidp.errors import MpidpError

pytestmark = pytest.mark.mpi

B, E, HEADS, T, H, W = 2, 8, 2, 2, 5, 7
N = H * W


class Mha(nn.Module):
    """``nn.MultiheadAttention`` self-attention over a block's tokens, back to the block.
    ``mask``: ``"float"`` an additive (N, N) mask, ``"bool"`` a boolean one per batch and head
    (B * heads, N, N), ``"causal"`` the causal mask with ``is_causal=True`` (without weights
    nor padding: torch then takes its own causal mask); ``pad``: a key padding mask; ``extra``:
    ``bias_k`` / ``bias_v`` and a zero key; ``weights``: also return the attention weights
    (``"mean"`` over the heads or ``"heads"``)."""

    def __init__(self, batch_first=True, mask=None, pad=False, extra=False, weights=None) -> None:
        super().__init__()
        self.batch_first, self.kind, self.weights = batch_first, mask, weights
        self.mha = nn.MultiheadAttention(
            E, HEADS, batch_first=batch_first, add_bias_kv=extra, add_zero_attn=extra
        )
        masks = {
            "float": rand((N, N), 5),
            "bool": rand((B * HEADS, N, N), 6) > 1.0,  # True: not attended (torch's MHA)
            "causal": nn.Transformer.generate_square_subsequent_mask(N, dtype=torch.float64),
        }
        self.register_buffer("mask", masks.get(mask))
        self.register_buffer("pad", rand((B, N), 7) if pad else None)  # additive, as the mask

    def forward(self, x):
        t = x.flatten(2).transpose(1, 2)  # (B, N, E)
        s = t if self.batch_first else t.transpose(0, 1)  # (N, B, E)
        y, p = self.mha(
            s, s, s, key_padding_mask=self.pad, attn_mask=self.mask,
            need_weights=self.weights is not None, is_causal=self.kind == "causal",
            average_attn_weights=self.weights == "mean",
        )  # fmt: skip
        y = y if self.batch_first else y.transpose(0, 1)
        out = y.transpose(1, 2).reshape(x.shape)
        return out if p is None else (out, p)


class Causal(nn.Module):
    """SDPA with ``is_causal=True`` over the tokens of ``lead`` fields (a cube's time x rows x
    columns: the global order ``lead`` first), alone and with an additive and a boolean mask
    of the global shape (torch applies both); then the tokens back to the input's shape."""

    def __init__(self, lead: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.register_buffer("mask", rand((lead * N, lead * N), 8))
        self.register_buffer("keep", rand((lead * N, lead * N), 9) > -1.0)

    def forward(self, x):
        t = x.reshape(B, E, -1).transpose(1, 2)  # (B, T N, E), lead T
        qkv = self.qkv(t).reshape(B, -1, 3, HEADS, E // HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = a + F.scaled_dot_product_attention(q, k, v, self.mask, is_causal=True)
        a = a + F.scaled_dot_product_attention(q, k, v, self.keep, is_causal=True)
        return a.transpose(1, 2).reshape(B, -1, E).transpose(1, 2).reshape(x.shape)


def compare(m, net, shape, convert=False):
    """The failed checks of the unchanged ``net`` on ``mpidp.shard(x, dim=(-2, -1))`` (or, with
    ``convert``, converted and fed this rank's plain block) against ``net`` on the full field:
    every output (the weights: this rank's query rows), input and parameter gradients."""
    net = net.double()
    full = rand(shape, 0)
    fr = full.clone().requires_grad_()
    want = net(fr)
    want = want if isinstance(want, tuple) else (want,)
    ws = [rand(tuple(o.shape), 1 + i) for i, o in enumerate(want)]
    sum((o * w).sum() for o, w in zip(want, ws, strict=True)).backward()
    model = copy.deepcopy(net)
    model.zero_grad(set_to_none=True)
    if convert:
        model = mpidp.convert_to_domain_parallel(model, manager=m)
        x = mpidp.shard_tensor(full, dim=(-2, -1), manager=m).detach().requires_grad_()
        rows, cols = m.block_spec(shape).block(m.domain_rank)
        got = model(x)
        got = got if isinstance(got, tuple) else (got,)
        ws = [ws[0][..., rows, cols]]
        sum((o * w).sum() for o, w in zip(got, ws, strict=True)).backward()
        outs = [close(got[0], want[0][..., rows, cols])]
        gx, mine = x.grad, fr.grad[..., rows, cols]
    else:
        x = mpidp.shard(full, dim=(-2, -1), manager=m).requires_grad_()
        got = model(x)
        got = got if isinstance(got, tuple) else (got,)
        sum((o * w).sum() for o, w in zip(got, ws, strict=True)).backward()
        outs = [close(o.full_tensor(), w) for o, w in zip(got, want, strict=True)]
        gx, mine = x.local.grad, mpidp.shard(fr.grad, dim=(-2, -1), manager=m).local
    mpidp.sync_gradients(model, m)
    found = [(f"output {i}", ok) for i, ok in enumerate(outs)]
    found += [("input grad", close(gx, mine))]
    found += [
        (f"grad {n}", close(p.grad, q.grad))
        for (n, p), q in zip(model.named_parameters(), net.parameters(), strict=True)
    ]
    return [f"rank {m.rank}: {name}" for name, ok in found if not ok]


MHA_CASES = {
    "batch_first, float mask, padding, mean weights": {"mask": "float", "pad": True,
                                                       "weights": "mean"},
    "sequence first, bool mask per head, bias_k, zero key, weights per head": {
        "batch_first": False, "mask": "bool", "extra": True, "weights": "heads"},
    "is_causal (torch's own causal mask)": {"mask": "causal"},
}  # fmt: skip


@pytest.mark.parametrize("case", list(MHA_CASES))
def test_multihead_attention(gm, case):
    """torch's module unchanged on a block's tokens, every rank's queries against every key
    in the global order; the weights this rank's query rows."""
    failed = agreed(compare(gm, Mha(**MHA_CASES[case]), (B, E, H, W)))
    assert not failed, failed


def test_converted_multihead_attention(gm):
    """The converted model: its MultiheadAttention (mpidp's layer) on tokens of blocks runs
    the same rule; the output is this rank's block."""
    failed = agreed(compare(gm, Mha(mask="float", pad=True), (B, E, H, W), convert=True))
    assert not failed, failed


def test_causal_sdpa(gm):
    """is_causal over tokens (on blocks of a cube: lead 2): each query masks the keys by its
    global id. (On bands a cube's tokens are T blocks merged into the band, which attention
    refuses: one field there.)"""
    shape = (B, E, T, H, W) if gm._blocks else (B, E, H, W)
    failed = agreed(compare(gm, Causal(len(shape) - 3), shape))
    assert not failed, failed


def test_refusals(gm):
    """Dropout over tokens, whole queries against tokens, and torch's causal hint with extra
    keys raise on every rank."""
    if not gm._blocks:
        pytest.skip("bands: the band rules")
    x = mpidp.shard(rand((B, E, H, W), 0), dim=(-2, -1), manager=gm)
    t = x.flatten(2).transpose(1, 2)  # (B, N, E)
    drop = nn.MultiheadAttention(E, HEADS, dropout=0.5, batch_first=True).double()
    extra = nn.MultiheadAttention(E, HEADS, add_bias_kv=True, batch_first=True).double()
    causal = nn.Transformer.generate_square_subsequent_mask(N, dtype=torch.float64)
    whole = rand((B, 3, E), 1)
    calls = [
        lambda: drop(t, t, t),  # attention dropout in training
        lambda: F.scaled_dot_product_attention(t, t, t, dropout_p=0.5),
        lambda: drop.eval()(whole, t, t),  # whole queries against tokens
        # torch's causal mask would span bias_k too: no mask of the rows says that
        lambda: extra(t, t, t, attn_mask=causal, is_causal=True, need_weights=False),
    ]
    found = agreed([refusal(c, MpidpError) is None for c in calls])
    assert not any(found), found
