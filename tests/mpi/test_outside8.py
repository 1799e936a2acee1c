"""Holes found running real models outside the zoo (H4, eighth session), in plain torch.

torch-harmonics' SFNO writes the Legendre contraction over latitude (a value every rank holds,
partial) into ``torch.zeros`` by ``xout[..., 0] = einsum(...)``: the plain target kept its
class, so every rank counted the gradients downstream as its own (a parameter's gradient P
times after ``sync_gradients``), and the second write crashed. Writes in place into a partial
value, and ``out=`` of a partial value or a band, gave one rank's summand or part. Each is
exact now or refused on every rank. Float64, 13 x 20 (uneven on every grid), every grid of the
world.
"""

from __future__ import annotations

import pytest
import torch
from helpers import agreed, rand, refusal
from torch import nn

import mpidp
from mpidp.errors import ConfigError, MpidpError
from mpidp.sharded import ShardedTensor, shard

pytestmark = pytest.mark.mpi

B, C, H, W = 2, 3, 13, 20
L, M = 5, 6  # Legendre degrees and longitude modes kept


def _full(t):
    t = t.full_tensor() if isinstance(t, ShardedTensor) else t
    return t.detach().as_subclass(torch.Tensor)


def _compare(gm, model, full):
    """``model`` on ``full`` cut over ``gm``'s grid against serial: output, input gradient and
    every parameter gradient after sync_gradients; the failures (asserted by the caller after
    every collective)."""
    model.zero_grad(set_to_none=True)
    xr = full.clone().requires_grad_()
    yr = model(xr)
    w = rand(tuple(yr.shape), 5)
    (yr * w).sum().backward()
    refs = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    x = shard(full, (-2, -1) if gm.grid[1] > 1 else -2, gm).requires_grad_()
    y = model(x)
    (y * w).sum().backward()
    mpidp.sync_gradients(model, gm)
    got = {"out": _full(y), "grad_in": _full(x.grad)}
    want = {"out": yr.detach(), "grad_in": xr.grad}
    for n, p in model.named_parameters():
        got[n], want[n] = p.grad, refs[n]
    bad = []
    for k, g in got.items():
        e = float((g - want[k]).abs().max() / want[k].abs().max()) if g is not None else 1.0
        if not e <= 1e-10:
            bad.append(f"rank {gm.rank} {k}: rel {e:.3g}")
    return bad


class SpectralNet(nn.Module):
    """torch-harmonics' RealSHT / SpectralConvS2 / InverseRealSHT as their forwards write them:
    rfft over longitude, the Legendre contraction over latitude written into zeros (real and
    imaginary parts, two writes), complex weights per degree, the inverse contraction, irfft;
    then a 1 x 1 convolution and the skip of the input."""

    def __init__(self):
        super().__init__()
        self.register_buffer("fwd", rand((M, L, H), 3))
        self.register_buffer("inv", rand((M, L, H), 4))
        self.spec = nn.Parameter(torch.complex(rand((C, C, L), 7), rand((C, C, L), 8)))
        self.mix = nn.Conv2d(C, C, 1).double()

    def forward(self, x):
        z = torch.view_as_real(torch.fft.rfft(x, dim=-1, norm="forward"))
        out = torch.zeros(*x.shape[:-2], L, M, 2, dtype=x.dtype)
        out[..., 0] = torch.einsum("...km,mlk->...lm", z[..., :M, 0], self.fwd)
        out[..., 1] = torch.einsum("...km,mlk->...lm", z[..., :M, 1], self.fwd)
        c = torch.einsum("...ilm,oil->...olm", torch.view_as_complex(out), self.spec)
        r = torch.view_as_real(c)
        y = torch.stack([torch.einsum("...lm,mlk->...km", r[..., i], self.inv) for i in (0, 1)], -1)
        y = torch.fft.irfft(torch.view_as_complex(y), n=x.shape[-1], dim=-1, norm="forward")
        return self.mix(y) + x


def test_spherical_transform_written_into_zeros_equals_serial(gm):
    """SFNO's spectral layer on bands: exact (it gave every parameter gradient P times, then
    crashed on the second write). On blocks the rfft over the cut longitude alone gives
    blocks of modes, which ``view_as_real`` refuses on every rank."""
    _on_bands(gm, SpectralNet(), rand((B, C, H, W), 1), "view_as_real")


def _on_bands(gm, model, full, refused_op):
    """``model`` exact on bands; on blocks refused at ``refused_op`` on every rank."""
    if gm.grid[1] == 1:
        assert not agreed(_compare(gm, model, full))
        return
    said = agreed([refusal(lambda: _compare(gm, model, full))])
    assert all(s and refused_op in s and "blocks" in s for s in said), said


class Writes(nn.Module):
    """A field's channel means (partial) written in place every way: ``copy_`` into zeros,
    ``+=`` into ones, ``out=``, ``copy_`` into a view (its base is used), and written into
    the partial value itself (``mul_``, ``x[i] = v``) before linear uses of it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(C, C).double()

    def forward(self, x):
        g = x.mean((-2, -1))  # (B, C), partial
        a = torch.zeros(B, C, dtype=x.dtype)
        a.copy_(g)
        b = torch.ones(B, C, dtype=x.dtype)
        b += g
        c = torch.empty(B, C, dtype=x.dtype)
        torch.mul(g.detach(), 3.0, out=c)  # (out= takes no autograd, serial too)
        buf = torch.zeros(2, B, C, dtype=x.dtype)
        buf[1].copy_(g)
        s = x.sum((-2, -1))  # (B, C), partial
        s.mul_(0.5)
        s[..., 0] = 1.0
        h = self.lin(a + b * c + buf.sum(0)) + s * 2.0
        return x * h[..., None, None]


def test_writes_of_a_value_every_rank_holds_equal_serial(gm):
    assert not agreed(_compare(gm, Writes(), rand((B, C, H, W), 2)))


class MaskedWrites(nn.Module):
    """CREDIT's tracer fixer: ``v = y[:, i]; v[v < t] = t`` (a view of the band written through
    a mask of its own shape), and a 0-d tensor value."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Conv2d(C, C, 1).double()

    def forward(self, x):
        y = self.mix(x)
        v = y[:, 1]
        v[v < 0.1] = 0.1
        y[y > 1.0] = torch.tensor(1.0, dtype=y.dtype)
        return y * x


def test_writes_through_a_mask_of_the_whole_shape_equal_serial(gm):
    """They were refused ("tensor, list, bool or None indices")."""
    assert not agreed(_compare(gm, MaskedWrites(), rand((B, C, H, W), 6)))


class Special(nn.Module):
    """``torch.special``'s element-wise names (PhysicsNeMo's ConvResidualBlock gates with
    ``torch.special.expit``): they were refused."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Conv2d(C, C, 1).double()

    def forward(self, x):
        y = self.mix(x)
        return torch.special.expit(y) * torch.special.ndtr(x) + torch.special.xlog1py(y, x.abs())


def test_special_element_wise_functions_equal_serial(gm):
    assert not agreed(_compare(gm, Special(), rand((B, C, H, W), 7)))


class Disco(nn.Module):
    """torch-harmonics' DISCO convolution (its torch path, LSNO's encoder): a plain filter of
    (K, H_out, H * W) times the field flattened to (lat x lon) by ``bmm``, once per output
    longitude, the field rolled along longitude in between, written into zeros; then the
    weights over channels and the K basis functions."""

    K, HO, WO = 3, 5, 4

    def __init__(self, sparse=False):
        super().__init__()
        psi = rand((self.K, self.HO, H * W), 9)
        self.register_buffer("psi", psi.relu().to_sparse() if sparse else psi)
        self.weight = nn.Parameter(rand((C, C, self.K), 10))

    def forward(self, x):
        b, c, h, w = x.shape
        xx = x.reshape(1, b * c, h, w).permute(0, 2, 3, 1).expand(self.K, -1, -1, -1)
        y = torch.zeros(self.WO, self.K, self.HO, b * c, dtype=x.dtype)
        for p in range(self.WO):
            y[p] = torch.bmm(self.psi, xx.reshape(self.K, h * w, -1))
            xx = torch.roll(xx, -(w // self.WO), dims=2)
        y = y.permute(3, 1, 2, 0).reshape(b, c, self.K, self.HO, self.WO)
        return torch.einsum("bckxy,ock->boxy", y, self.weight)


def test_a_plain_filter_times_the_flattened_field_equals_serial(gm):
    """``bmm(plain, band)`` contracting the band: each rank's columns of the filter against
    its rows, a partial sum (it was refused; ``band @ plain`` was exact already). On blocks
    the field's ``expand`` is refused."""
    for sparse in (False, True):  # (torch-harmonics' filter is a sparse COO tensor)
        _on_bands(gm, Disco(sparse), rand((B, C, H, W), 11), "expand")


def test_writes_that_cannot_be_exact_are_refused_on_every_rank(gm):
    """A partial value written into a plain tensor that requires grad (its gradient would be
    counted per rank), and ``out=`` with a band: the same refusal on every rank."""
    x = shard(rand((B, C, H, W), 3), (-2, -1) if gm.grid[1] > 1 else -2, gm)
    p = nn.Parameter(rand((B, C), 4))

    def into_grad():
        t = p * 1.0
        t[0] = x.mean((-2, -1))[0]

    said = [
        refusal(into_grad, ConfigError),
        refusal(lambda: torch.mul(x, 2.0, out=torch.empty(B, C, H, W)), MpidpError),
    ]
    every = agreed([said])
    want = gm.domain_world_size == 1 or all(
        s[0] and "requires grad" in s[0] and s[1] and "out=" in s[1] for s in every
    )
    assert want, every
