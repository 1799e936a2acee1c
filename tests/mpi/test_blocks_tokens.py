"""Tokens of blocks (issue 46, "Real models on blocks"): a patch embedding's ``flatten(2)``, a
cube embedding's ``reshape(B, C, -1)`` and a window partition folding the window grid into the
batch give each rank its block's rows x columns in one dim (``mpidp.sharded.tokens``). An
unchanged model fed ``mpidp.shard(x, dim=(-2, -1))`` against the serial model on the full
field at every grid that fits the world (bands are the grid (P, 1): the same tests run there).

Float64, H = 13 and W = 20 (uneven over every grid here): the output, the input gradient and
every parameter gradient after ``mpidp.sync_gradients``, asserted only after every collective
of a test. Plus the refusals: what mixes tokens in their global order raises on every rank.

Six ranks (the grids 2 x 3 and 3 x 2): ``mpiexec -n 6 ... tests/mpi/test_blocks_tokens.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import rand
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.errors import MpidpError

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
ALL_GRIDS = [(1, 1), (1, 2), (2, 1), (1, 3), (3, 1), (2, 2), (1, 4), (4, 1), (2, 3), (3, 2)]
GRIDS = [g for g in ALL_GRIDS if g[0] * g[1] == WORLD]
B, C, T, H, W = 2, 3, 2, 13, 20
TOL = 1e-10


@pytest.fixture(scope="module", params=GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def gm(request):
    """A manager whose whole world is one domain grid."""
    with mpidp.DistributedManager(domain_parallel_size=request.param) as m:
        yield m


class Patches(nn.Module):
    """AFNO's path: a patch embedding's ``flatten(2).transpose(1, 2)``, a full position
    embedding, per-token layer norm and MLP, a mean over the tokens feeding back (a
    Replicated value meeting tokens), the tokens reshaped to (B, H, W, D) and the head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(C, 8, 3, padding=1)
        self.pos = nn.Parameter(torch.randn(1, H * W, 8))
        self.norm = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.gate = nn.Linear(8, 8)
        self.head = nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.proj(x).flatten(2).transpose(1, 2) + self.pos  # (B, H W, D)
        t = t + self.mlp(self.norm(t))
        t = t * torch.sigmoid(self.gate(t.mean(1)))[:, None, :]
        return self.head(t.reshape(x.shape[0], H, W, 8).permute(0, 3, 1, 2))


class Cube(nn.Module):
    """SwinRNN's and FuXi's path: a cube embedding's ``reshape(B, D, -1)`` (time x rows x
    columns), a position embedding of every step's tokens, a norm, back to (B, D, T, H, W);
    then windows of 1 x 4 folded into the batch
    (``view``, ``permute``, ``reshape(-1, 4, D)``), attention in each window (a linear, the
    heads split off by ``unbind``, ``q @ k.transpose`` plus a mask per window, softmax, ``@ v``,
    and SDPA with the mask by batch), and the windows back; shifted by a roll of the block;
    then the tokens of the windows' cut joined with those of the embedding's (SwinRNN's skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv3d(C, 4, (1, 3, 3), padding=(0, 1, 1))
        self.pos = nn.Parameter(torch.randn(1, T * H * W, 4))
        self.norm = nn.LayerNorm(4)
        self.qkv = nn.Linear(4, 12)
        self.out = nn.Conv2d(8, 2, 1)
        self.register_buffer("mask", torch.randn(H * (W // 4), 4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        e = self.embed(x)  # (B, D, T, H, W)
        t = self.norm(e.reshape(b, 4, -1).transpose(1, 2) + self.pos)  # (B, T H W, D), lead T
        e = t.transpose(1, 2).reshape(b, 4, T, H, W)[:, :, -1]  # the last step: a block
        s = torch.roll(F.pad(e.permute(0, 2, 3, 1), (0, 0) * 3), (-1, -2), (1, 2))  # shifted
        win = s.view(b, H, 1, W // 4, 4, 4).permute(0, 1, 3, 2, 4, 5)
        win = win.reshape(-1, 4, 4)  # (B H W/4, 4, D): windows in the batch
        q, k, v = self.qkv(win).reshape(-1, 4, 3, 2, 2).permute(2, 0, 3, 1, 4).unbind(0)
        n = self.mask.shape[0]  # a mask per window: along the tokens, cut to this rank's
        a = (q @ k.transpose(-2, -1)).view(-1, n, 2, 4, 4) + self.mask[None, :, None]
        mask = self.mask[None, :, None].expand(b, -1, 2, -1, -1).reshape(-1, 2, 4, 4)
        a = a.view(-1, 2, 4, 4).softmax(-1) @ v + F.scaled_dot_product_attention(q, k, v, mask)
        a = a.transpose(1, 2).reshape(b, H, W // 4, 1, 4, 4).permute(0, 1, 3, 2, 4, 5)
        y = torch.roll(a.reshape(b, H, W, 4), (1, 2), (1, 2)).permute(0, 3, 1, 2)
        both = torch.cat([e.reshape(b, 4, -1), y.reshape(b, 4, -1)], 1)  # tokens of two cuts
        return self.out(both.reshape(b, 8, H, W))


class Window(nn.Module):
    """One window over the whole field (SwinRNN's deepest level with window 4, FuXi's field):
    the tokens at dim -2 of the queries, keys and values, ``q @ k.transpose`` (and the same by
    einsum) plus a full (heads, N, N) relative-position bias, softmax, ``@ v`` (and einsum),
    and SDPA with an additive mask of the global (N, N) shape: every rank's queries against
    every token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(C, 4, 3, padding=1)
        self.qkv = nn.Linear(4, 12)
        self.bias = nn.Parameter(torch.randn(2, H * W, H * W))
        self.register_buffer("mask", torch.randn(H * W, H * W))
        self.proj = nn.Linear(4, 4)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        t = self.embed(x).flatten(2).transpose(1, 2)  # (B, N, D)
        q, k, v = self.qkv(t).reshape(b, -1, 3, 2, 2).permute(2, 0, 3, 1, 4).unbind(0)
        s = (q @ k.transpose(-2, -1)) * 0.5 + torch.einsum("bhid,bhjd->bhij", q, k) * 0.25
        p = (s + self.bias).softmax(-1)
        a = p @ v + torch.einsum("...ij,...jd->...id", p, v)  # (B, heads, N, 2)
        a = a + F.scaled_dot_product_attention(q, k, v, self.mask)
        y = self.proj(a.transpose(1, 2).reshape(b, -1, 4))
        return self.head(y.transpose(1, 2).reshape(b, 4, H, W))


def close(a, b):
    if a is None or b is None:  # a parameter the net did not use: no gradient on either side
        return a is b
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=TOL, atol=TOL))


def compare(m, net, shape):
    """The failed checks of the unchanged ``net`` on ``mpidp.shard(x, dim=(-2, -1))``."""
    torch.manual_seed(0)
    net = net.double()
    full, w = rand(shape, 0), rand((B, 2, H, W), 1)
    fr = full.clone().requires_grad_()
    want = net(fr)
    (want * w).sum().backward()
    model = copy.deepcopy(net)
    model.zero_grad(set_to_none=True)
    x = mpidp.shard(full, dim=(-2, -1), manager=m).requires_grad_()
    y = model(x)
    (y * w).sum().backward()
    mpidp.sync_gradients(model, m)
    got, gx = y.full_tensor(), mpidp.shard(fr.grad, dim=(-2, -1), manager=m).local
    found = [("forward", close(got, want)), ("input grad", close(x.local.grad, gx))]
    found += [
        (f"grad {n}", close(p.grad, q.grad))
        for (n, p), q in zip(model.named_parameters(), net.parameters(), strict=True)
    ]
    return [name for name, ok in found if not ok]


def test_patch_tokens(gm):
    """AFNO's patch tokens: position embedding by index, per-token layers, a global mean."""
    failed = compare(gm, Patches(), (B, C, H, W))
    assert not failed, f"rank {gm.rank}: {failed}"


def test_cube_tokens_and_windows(gm):
    """A cube embedding's tokens (lead T) and shifted windows folded into the batch, attention
    in each (windows straddle both cuts at every grid here)."""
    failed = compare(gm, Cube(), (B, C, T, H, W))
    assert not failed, f"rank {gm.rank}: {failed}"


def test_window_over_all_blocks(gm):
    """Attention in one window that spans every rank's block: the keys and values gathered
    whole in their global order, the bias and the mask cut to each rank's queries."""
    failed = compare(gm, Window(), (B, C, H, W))
    assert not failed, f"rank {gm.rank}: {failed}"


def refusal(call):
    """The error message ``call`` raised on this rank, or None."""
    try:
        call()
    except MpidpError as err:
        return str(err)
    return None


def test_refusals(gm):
    """What mixes tokens in their global order other than as the rows of attention, or indexes
    them, raises on every rank."""
    if not gm._blocks:
        pytest.skip("bands: the tokens are a band")
    x = mpidp.shard(rand((B, C, H, W), 0), dim=(-2, -1), manager=gm)
    t = x.flatten(2).transpose(1, 2)  # (B, H W, C)
    calls = [
        lambda: t.transpose(1, 2) @ t,  # the tokens contracted: a sum in block order
        lambda: torch.einsum("bic,bjc->bc", t, t),  # no token letter kept
        lambda: F.scaled_dot_product_attention(t, t.transpose(1, 2), t),  # keys at dim -1
        lambda: F.conv1d(t.transpose(1, 2), torch.ones(3, 3, 3, dtype=t.dtype)),  # over tokens
        lambda: t[:, 5],  # a token by position
        lambda: torch.cumsum(t, 1),  # no rule on tokens
        lambda: t.reshape(B, 20, 13, C),  # tokens split other than into (H, W)
        lambda: x.transpose(-2, -1).reshape(B, C, -1),  # the columns before the rows
    ]
    found = [refusal(c) for c in calls]
    assert all(found), f"rank {gm.rank}: {found}"
