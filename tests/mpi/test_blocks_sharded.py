"""The ShardedTensor front end on latitude x longitude blocks (issue 46, item 4): an unchanged
model fed ``mpidp.shard(x, dim=(-2, -1))`` and the same model converted
(``mpidp.convert_to_domain_parallel``) fed this rank's plain block, each against the serial
model on the full field at every grid that fits the world (bands are the grid (P, 1): the same
tests run on bands too).

Float64, H = 13 and W = 20 (uneven over every grid here): the output, the input gradient and
every parameter gradient after ``mpidp.sync_gradients``; the checks are asserted only after
every collective of a test. Plus the refusals: a function no rule knows on blocks raises on
every rank, never computing on the block as if it were a band.

Six ranks (the grids 2 x 3 and 3 x 2): ``mpiexec -n 6 ... tests/mpi/test_blocks_sharded.py``.
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

pytestmark = pytest.mark.mpi

SHAPE = (2, 3, 13, 20)


class Net(nn.Module):
    """A U-Net step: zero- and circular-padded convs, a stride-2 conv, a ceil-mode pool,
    GroupNorm, back up to the skip's size (F.interpolate, or a transposed conv of strides
    (3, 4) when ``up`` is False) and a cat with the skip along the channels."""

    def __init__(self, circular: bool = True, up: bool = True) -> None:
        super().__init__()
        self.up = up
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular" if circular else "zeros")
        self.down = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.pool = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.norm = nn.GroupNorm(2, 4)
        self.t = nn.ConvTranspose2d(4, 4, 4, stride=(3, 4))
        self.out = nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.b(torch.relu(self.a(x)))
        y = self.norm(self.pool(self.down(skip))) * 0.5 + 1.0  # (4, 5) rows x columns
        if self.up:
            y = F.interpolate(y, size=skip.shape[-2:], mode="nearest")
        else:  # (4, 5) -> (13, 20)
            y = self.t(y)
        return self.out(torch.cat([y, skip], 1))


def serial_run(net, full, w):
    """The serial output and gradients of ``(net(full) * w).sum()``."""
    fr = full.clone().requires_grad_()
    want = net(fr)
    (want * w).sum().backward()
    return want, fr.grad, {n: p.grad for n, p in net.named_parameters()}


def checks(m, model, serial, got, x_grad, out_spec):
    """The failed checks: output block, input gradient block, parameter gradients."""
    mpidp.sync_gradients(model, m)
    y, gx, grads = serial
    rs, cs = out_spec.block(m.domain_rank)
    irs, ics = m.block_spec(SHAPE).block(m.domain_rank)
    found = [("forward", close(got, y[..., rs, cs]))]
    found += [("input grad", close(x_grad, gx[..., irs, ics]))]
    found += [(f"grad {n}", close(p.grad, grads[n])) for n, p in model.named_parameters()]
    return [name for name, ok in found if not ok]


def blocks_of(y):
    """A ShardedTensor's blocks (a band's: its rows by the whole width)."""
    return y.grid or BlockSpec(y.spec, ShardSpec((y.shape[-1],)))


def front_end(m, net):
    """The unchanged ``net`` on ``mpidp.shard(x, dim=(-2, -1))``."""
    net = net.double()
    full, w = rand(SHAPE, 0), rand((2, 2, 13, 20), 1)
    model = copy.deepcopy(net)
    x = mpidp.shard(full, dim=(-2, -1), manager=m).requires_grad_()
    y = model(x)
    (y * w).sum().backward()  # a plain weight of the global shape: cut to this rank's block
    return checks(m, model, serial_run(net, full, w), y.local, x.local.grad, blocks_of(y))


def converted(m, net):
    """``net`` converted, on this rank's plain block."""
    net = net.double()
    full, w = rand(SHAPE, 0), rand((2, 2, 13, 20), 1)
    model = mpidp.convert_to_domain_parallel(copy.deepcopy(net), manager=m)
    x = mpidp.shard_tensor(full, dim=(-2, -1), manager=m).detach().requires_grad_()
    y = model(x)
    (p_lat, p_lon), part = m.grid, m.partition
    out = BlockSpec(part.derived(13, p_lat), part.derived(20, p_lon))
    rs, cs = out.block(m.domain_rank)
    (y * w[..., rs, cs]).sum().backward()
    return checks(m, model, serial_run(net, full, w), y, x.grad, out)


def test_front_end(gm):
    """Zero padding, a stride-2 conv, a ceil-mode pool, GroupNorm, a transposed conv and a cat
    through the ShardedTensor front end."""
    torch.manual_seed(0)
    failed = front_end(gm, Net(circular=False, up=False))
    assert not failed, f"rank {gm.rank}: {failed}"


def test_converted(gm):
    """The net with circular padding, converted."""
    torch.manual_seed(0)
    failed = converted(gm, Net(circular=True, up=False))
    assert not failed, f"rank {gm.rank}: {failed}"


def test_whole_net(gm):
    """Circular padding (F.pad of a block) and interpolate to the skip's size, both routes."""
    torch.manual_seed(0)
    failed = front_end(gm, Net()) + converted(gm, Net())
    assert not failed, f"rank {gm.rank}: {failed}"


class Sliced(nn.Module):
    """Slices along both cut dims (each rank keeps its own rows and columns: uneven cuts), a
    sum and a cat of tensors sliced differently (their blocks moved to one cut), a narrow."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 2, 3, padding=1)
        self.out = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)  # (13, 20)
        inner = y[:, :, 1:12, 3:18:2] * 2.0  # (11, 8)
        other = y[..., 2:13, 0:15:2] + inner  # a different cut of the same shape
        both = torch.cat([inner, other.narrow(-1, 0, 8)], 1)
        return self.out(both)


def test_slices(gm):
    """Slices and narrows along the cut dims, and blocks cut differently meeting, both routes."""
    torch.manual_seed(0)
    net = Sliced().double()
    full, w = rand(SHAPE, 0), rand((2, 2, 11, 8), 1)
    model = copy.deepcopy(net)
    x = mpidp.shard(full, dim=(-2, -1), manager=gm).requires_grad_()
    y = model(x)
    (y * w).sum().backward()
    failed = checks(gm, model, serial_run(net, full, w), y.local, x.local.grad, blocks_of(y))
    assert not failed, f"rank {gm.rank}: {failed}"


def test_refusals(gm):
    """A function no rule knows on blocks (or a rule refuses) raises on every rank."""
    if not gm._blocks:
        pytest.skip("bands")
    x = mpidp.shard(rand(SHAPE, 0), dim=(-2, -1), manager=gm)
    calls = [
        lambda: torch.cumsum(x, -1),  # no rule on blocks
        lambda: torch.flip(x, (-1,)),  # a band rule that does not know blocks
        lambda: x.sum(-2),  # over one cut dim alone
        lambda: x.transpose(-2, -1).reshape(2, 3, 260),  # merges the cut dims, columns first
        lambda: mpidp.shard(rand(SHAPE, 0), dim=-2, manager=gm),  # a band of a grid
    ]
    found = [refusal(c, MpidpError) for c in calls]
    assert all(found), f"rank {gm.rank}: {found}"
