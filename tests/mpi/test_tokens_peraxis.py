"""Window attention on latitude x longitude blocks whose two cut axes live in different dims
(mpidp.sharded.axis_products): windows as tall as the field, so the latitude cuts each window's
tokens inside (the rows of the attention) and the longitude falls in the window index merged
into the batch (FuXi's windows of 4 on 2 x 2 blocks), against serial torch.

A FuXi-like (Swin V2) window block in plain torch: the window partition, ``qkv.unbind(0)``,
cosine attention through ``@`` with a bias, shifted with a mask per window through einsum (a
plain weight per window among its operands), through ``scaled_dot_product_attention`` and
its ``is_causal``.
Float64, a 5 x 20 field (uneven over every grid here; the longitude cut moves to window
boundaries first): the output, the input gradient and every parameter gradient after
``mpidp.sync_gradients``, asserted only after every collective; and the calls that stay
refused, refused on every rank with the op, the layout and the fix.
Grids: 2 x 2 at four ranks, 2 x 3 and 3 x 2 at six.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import WORLD, agreed, grid_id, rand, refusal
from torch import nn

import mpidp
from mpidp.errors import MpidpError

pytestmark = pytest.mark.mpi

TOL = 1e-10
H, W, C, HEADS = 5, 20, 4, 2
WH, WW = H, 4  # one window row: the latitude cuts every window inside
N, NW = WH * WW, (H // WH) * (W // WW)
GRIDS = [g for g in [(2, 2), (2, 3), (3, 2)] if g[0] * g[1] == WORLD]


class WindowBlock(nn.Module):
    """``x + attention(windows of x)`` on (B, H, W, C) (windows of ``window`` rows x columns
    on a ``field``), optionally shifted along the longitude with an additive mask per window,
    through ``how``: ``@`` or ``einsum`` (cosine scores), ``sdpa``, or ``causal`` (SDPA's
    ``is_causal``, no mask)."""

    def __init__(self, seed: int, shift: int, how: str, window=(WH, WW), field=(H, W)) -> None:
        super().__init__()
        self.shift, self.how, self.window_hw, self.field = shift, how, window, field
        n, nw = window[0] * window[1], (field[0] // window[0]) * (field[1] // window[1])
        self.qkv = nn.Linear(C, 3 * C).double()
        self.proj = nn.Linear(C, C).double()
        self.bias = nn.Parameter(rand((HEADS, n, n), seed)) if how != "causal" else None
        self.scale = nn.Parameter(rand((), seed + 1))
        self.mask = nn.Parameter(rand((nw, n, n), seed + 2)) if shift else None
        self.window = nn.Parameter(rand((nw,), seed + 3)) if how == "einsum" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        (h, w), (wh, ww) = self.field, self.window_hw
        n, nw = wh * ww, (h // wh) * (w // ww)
        s = x.roll(-self.shift, dims=2) if self.shift else x
        s = s.view(B, h // wh, wh, w // ww, ww, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, n, C)
        qkv = self.qkv(s).reshape(-1, n, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.how == "causal":  # the rows' global positions mask the gathered keys
            y = F.scaled_dot_product_attention(q * self.scale.exp(), k, v, is_causal=True)
        elif self.how == "sdpa":
            mask = self.bias  # a mask per window: one of every batch entry's windows
            mask = mask if self.mask is None else (mask + self.mask.unsqueeze(1)).repeat(B, 1, 1, 1)
            y = F.scaled_dot_product_attention(q * self.scale.exp(), k, v, attn_mask=mask)
        else:
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
            if self.how == "einsum":
                attn = torch.einsum("bhid,bhjd,b->bhij", q, k, self.window.repeat(B))
            else:
                attn = q @ k.transpose(-2, -1)
            attn = attn * self.scale.exp() + self.bias
            if self.mask is not None:
                attn = attn.view(-1, nw, HEADS, n, n) + self.mask.unsqueeze(1)
                attn = attn.view(-1, HEADS, n, n)
            attn = attn.softmax(-1)
            y = torch.einsum("...ij,...jd->...id", attn, v) if self.how == "einsum" else attn @ v
        y = self.proj(y.transpose(1, 2).reshape(-1, n, C))
        y = y.view(B, h // wh, w // ww, wh, ww, C).permute(0, 1, 3, 2, 4, 5)
        y = y.reshape(B, h, w, C)
        return x + (y.roll(self.shift, dims=2) if self.shift else y)


def model(window=(WH, WW), field=(H, W)) -> nn.Module:
    """Unshifted through ``@``; shifted (a mask per window) through einsum and SDPA; causal."""
    kinds = [(1, 0, "@"), (4, 2, "einsum"), (7, 2, "sdpa"), (10, 0, "causal")]
    return nn.Sequential(*(WindowBlock(*k, window=window, field=field) for k in kinds))


@pytest.fixture(scope="module")
def serial():
    """The serial model, its input and output weights, its output and gradients (once)."""
    torch.manual_seed(0)  # (module scope: before the per-test seed) one model on every rank
    net, full, w = model(), rand((1, H, W, C), 10), rand((1, H, W, C), 11)
    xr = full.clone().requires_grad_()
    want = net(xr)
    (want * w).sum().backward()
    grads = {n: p.grad for n, p in net.named_parameters()}
    return net, full, w, want.detach(), xr.grad, grads


@pytest.fixture(scope="module", params=GRIDS, ids=grid_id)
def bm(request):
    with mpidp.DistributedManager(domain_parallel_size=request.param) as m:
        yield m


def test_window_attention_cut_inside_and_between_windows_equals_serial(bm, serial):
    """Each cut axis by the rule for where it lives: the longitude's windows local, the
    latitude's rows of each window against its keys and values gathered over the column."""
    net, full = serial[0], serial[1]
    dist = model()
    dist.load_state_dict(net.state_dict())
    x = mpidp.shard(full, dim=(1, 2), manager=bm).requires_grad_()
    failed = agreed(mismatches(bm, dist, x, serial[1:]))
    assert not failed, failed


def mismatches(m, dist, x, serial) -> list[str]:
    """This rank's mismatches of ``dist`` on the block ``x`` against ``serial`` (the full
    input, output weights, output, input gradient and parameter gradients): its output
    gathered, the input gradient of its block and every parameter gradient after
    ``mpidp.sync_gradients``. Collective; the caller agrees on them."""
    full, w, want, grad_in, grads = serial
    y = dist(x)
    (y * w).sum().backward()
    got = y.full_tensor()
    mpidp.sync_gradients(dist, m)
    rows, cols = m.block_spec(full.shape, (1, 2)).block(m.domain_rank)
    failed = [] if torch.allclose(got, want, rtol=TOL, atol=TOL) else ["forward"]
    if not torch.allclose(x.local.grad, grad_in[:, rows, cols], rtol=TOL, atol=TOL):
        failed.append("input grad")
    failed += [
        f"grad {n}"
        for n, p in dist.named_parameters()
        if not torch.allclose(p.grad, grads[n], rtol=TOL, atol=TOL)
    ]
    return [f"rank {m.rank} grid {m.grid} {tuple(full.shape)}: {f}" for f in failed]


def _qkv(m):
    """q, k, v of one window block's layout: (windows, heads, tokens, features), the longitude
    cut in the windows, the latitude among each window's tokens."""
    x = mpidp.shard(rand((1, H, W, C), 12), dim=(1, 2), manager=m)
    s = x.view(1, 1, WH, W // WW, WW, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, N, C)
    q = s.reshape(-1, N, HEADS, C // HEADS).transpose(1, 2)
    return q, q.sin(), q.cos(), torch.stack([q, q.sin(), q.cos()])


REFUSED = {
    "the latitude contracted": lambda q, k, v, qkv: q.transpose(-2, -1) @ k,
    "dropout in attention": lambda q, k, v, qkv: F.scaled_dot_product_attention(
        q, k, v, dropout_p=0.5
    ),
    "unbind along a cut": lambda q, k, v, qkv: qkv.unbind(3),
    "einsum contracting the rows": lambda q, k, v, qkv: torch.einsum("bhid,bhjd->bhj", q, k),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_stays_refused_is_refused_on_every_rank(bm, name):
    """Refused on every rank alike, naming the op, the layout (the cut dims) and a fix."""
    q, k, v, qkv = _qkv(bm)
    msg = refusal(lambda: REFUSED[name](q, k, v, qkv), MpidpError)
    ok = msg is not None and "sharded along dim" in msg and "fix:" in msg
    failed = agreed([] if ok else [f"rank {bm.rank} grid {bm.grid}: {msg}"])
    assert not failed, failed
