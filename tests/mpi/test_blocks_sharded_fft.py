"""torch.fft and attention of unchanged models on block ShardedTensors (issue 46, item 4: an
FNO spectral layer through the ShardedTensor front end), against the serial model on the full
field at every grid that fits the world (bands are the grid (P, 1): the same tests run there).

``mpidp.shard(x, dim=(-2, -1))`` of a (2, 3, 13, 20) field (uneven over every grid here),
float64: the output, the input gradient and every parameter gradient after
``mpidp.sync_gradients``, asserted only after every collective of a test. The spectrum of a
block is a band of modes over the domain group (``ShardedTensor.spectral``); the refusals
show it is never taken for a block or a field, and that attention over tokens made by
flattening a block is refused on every rank, naming the fix.

Six ranks (the grids 2 x 3 and 3 x 2): ``mpiexec -n 6 ... tests/mpi/test_blocks_sharded_fft.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import close, rand, refusal
from torch import nn

import mpidp
from mpidp.errors import MpidpError
from mpidp.runtime.grid import BlockSpec
from mpidp.runtime.partition import ShardSpec
from tests.mpi.zoo_models import AFNO, FNOSpectral  # plain torch, as their projects write them

pytestmark = pytest.mark.mpi

SHAPE = (2, 3, 13, 20)
H, W = SHAPE[-2:]


class Transforms(nn.Module):
    """Each transform and its inverse with a learned filter between: rfft2 / irfft2 with s=
    (complex weights of the global mode shape; modes truncated by a slice and zero-padded
    back by F.pad), fft2 / ifft2, rfftn / irfftn over the two cut
    dims, a 1-D transform along each cut dim, a 1-D transform along the modes of a spectrum,
    and an fft2 of a spectrum reduced to one number."""

    def __init__(self) -> None:
        super().__init__()
        self.w2 = nn.Parameter(torch.randn(3, H, W // 2 + 1, 2))
        self.w_lon = nn.Parameter(torch.randn(W // 2 + 1, 2))
        self.w_lat = nn.Parameter(torch.randn(H, 1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        X = torch.fft.rfft2(x, norm="ortho")
        y = torch.fft.irfft2(X * torch.view_as_complex(self.w2), s=(H, W), norm="ortho")
        kept = F.pad(X[..., 1:, 1:6], (1, 5, 1, 0))  # modes truncated, zero-padded back
        y = y + torch.fft.irfft2(kept * torch.view_as_complex(self.w2), s=(H, W))
        y = y + torch.fft.ifft2(torch.fft.fft2(x) * 0.5j).real
        Z = torch.fft.rfftn(x, dim=(-2, -1))
        y = y + torch.fft.irfftn(torch.fft.ifft(torch.fft.fft(Z, dim=-1), dim=-1), s=(H, W))
        lon = torch.fft.rfft(x, dim=-1) * torch.view_as_complex(self.w_lon)
        y = y + torch.fft.irfft(lon, n=W, dim=-1)
        lat = torch.fft.fft(x, dim=-2) * torch.view_as_complex(self.w_lat)
        y = y + torch.fft.ifft(lat, dim=-2).imag
        return y + torch.fft.fft2(X, dim=(-2, -1)).abs().pow(2).mean() * 1e-3


class Spectral(nn.Module):
    """The FNO spectral layer as neuraloperator and PhysicsNeMo write it (modes kept in both
    dims, written into a zero spectrum, complex weights by einsum, back with irfft2 s=), twice
    with different modes, then FourCastNet's AFNO filter on channels-last tokens (a transform
    over dims (1, 2), a block-diagonal complex MLP by einsum, a mode mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = FNOSpectral(c=3, modes1=3, modes2=4)
        self.b = FNOSpectral(c=3, modes1=2, modes2=7)
        self.afno = AFNO((H, W), c=4, blocks=2, keep=5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.afno(self.b(self.a(x)))


def blocks_of(y):
    """A ShardedTensor's blocks (a band's: its rows by the whole width)."""
    return y.grid or BlockSpec(y.spec, ShardSpec((y.shape[-1],)))


def front_end(m, net):
    """The failed checks of the unchanged ``net`` on ``mpidp.shard(x, dim=(-2, -1))`` against
    ``net`` on the full field: output block, input gradient block, parameter gradients."""
    net = net.double()
    full = rand(SHAPE, 0)
    model = copy.deepcopy(net)
    x = mpidp.shard(full, dim=(-2, -1), manager=m).requires_grad_()
    y = model(x)
    w = rand(tuple(y.shape), 1)
    (y * w).sum().backward()  # a plain weight of the global shape: cut to this rank's block
    mpidp.sync_gradients(model, m)
    fr = full.clone().requires_grad_()
    want = net(fr)
    (want * w).sum().backward()
    rs, cs = blocks_of(y).block(m.domain_rank)
    irs, ics = m.block_spec(SHAPE).block(m.domain_rank)
    found = [("forward", close(y.local, want[..., rs, cs]))]
    found += [("input grad", close(x.local.grad, fr.grad[..., irs, ics]))]
    pairs = zip(model.named_parameters(), net.named_parameters(), strict=True)
    found += [(f"grad {n}", close(p.grad, q.grad)) for (n, p), (_, q) in pairs]
    return [name for name, ok in found if not ok]


def test_transforms(gm):
    """Every transform of a block and back, with learned filters, through the front end."""
    torch.manual_seed(0)
    failed = front_end(gm, Transforms())
    assert not failed, f"rank {gm.rank}: {failed}"


def test_fno_spectral_layers(gm):
    """FNO and AFNO spectral layers unchanged: mode truncation by slicing, einsum with
    complex weights, zeros then setitem, a mode mask, irfft2 with s=."""
    torch.manual_seed(0)
    failed = front_end(gm, Spectral())
    assert not failed, f"rank {gm.rank}: {failed}"


def test_spectrum_is_never_a_block_or_field(gm):
    """The spectrum of a block is a band of modes (spectral), and what would take it for a
    block or a field, or mixes it with one, raises on every rank, naming the fix. (Attention
    over the tokens of a flattened block, torch's module and causal too, is exact:
    tests/mpi/test_tokens_mha.py.)"""
    if not gm._blocks:
        pytest.skip("bands")
    x = mpidp.shard(rand(SHAPE, 0), dim=(-2, -1), manager=gm)
    X = torch.fft.rfft2(x)
    conv = nn.Conv2d(3, 3, 3, padding=1).double()
    calls = [  # each with a word its refusal must hold (the reason, not an incidental error)
        (lambda: X.real[..., :10] + x[..., :10], "spectrum"),  # a spectrum meets a block
        (lambda: F.conv2d(X.real, conv.weight), "spectrum"),  # a layer reads a field
        (lambda: conv(X.real), "spectrum"),  # a module too
        (lambda: F.pad(X, (1, 1), mode="reflect"), "spectrum"),  # a field's pad of the modes
        (lambda: torch.cumsum(X, -1), "spectrum"),  # no rule on a spectrum
        (lambda: torch.fft.irfft2(x), "inverse transform of a block"),
        (lambda: torch.fft.fft2(x, dim=(-1, -2)), "in that order"),  # the other order
        (lambda: torch.fft.fftn(x, dim=(1, 2, 3)), "n-D transform"),  # more than the cut dims
    ]
    found = [(refusal(c, MpidpError) or "") for c, _ in calls]
    wrong = [f for f, (_, word) in zip(found, calls, strict=True) if word not in f]
    is_band = X.spectral and X.grid is None and X.spec.parts == gm.domain_world_size
    assert is_band and not wrong, f"rank {gm.rank}: {X!r} {wrong}"
