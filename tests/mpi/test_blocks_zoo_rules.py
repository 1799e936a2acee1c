"""The ShardedTensor rules on latitude x longitude blocks that the third-party zoo needed
(issue 46, "Real models on blocks"; bench/zoo, tests/zoo): each against serial torch on the
full field at every grid that fits the world (bands are the grid (P, 1): the same tests run
on bands too).

* ``F.prelu`` (PhysicsNeMo's SRResNet): its weight runs along the channels (dim 1), so a
  block cut along two spatial dims uses it whole; a cut of the channels is refused on every
  rank.
* adaptive pooling to fewer cells than ranks along a cut dim (CREDIT's U-Net: the
  squeeze-and-excite ``AdaptiveAvgPool2d(1)`` of its decoder): each cell a global mean (max)
  over its window of both cut dims, Replicated.
* reshapes that merge a cut dim with the dims after it or split it (PhysicsNeMo's
  ``PixelShuffle3d`` of SRResNet: ``view`` / ``permute`` / ``view``): the band rule once per
  cut dim, the rows that change owner moved first where a boundary falls off the new unit.

Float64, H = 13 and W = 20 (uneven over every grid here): the output, the input gradient and
the weight's gradient after ``mpidp.sync_gradients``, asserted after every collective.
"""

from __future__ import annotations

import pytest
import torch
from helpers import close, rand, refusal
from torch import nn

import mpidp
from mpidp.errors import MpidpError

pytestmark = pytest.mark.mpi

SHAPE = (2, 4, 13, 20)


def test_prelu_per_channel(gm):
    """A per-channel PReLU on blocks (its weight gradient summed over the blocks by
    ``sync_gradients``), and a PReLU on a tensor cut along its channels refused everywhere."""
    net = nn.PReLU(4).double()
    with torch.no_grad():
        net.weight.copy_(torch.tensor([0.1, -0.3, 0.7, 1.5]))
    full, w = rand(SHAPE, 0), rand(SHAPE, 1)
    fr = full.clone().requires_grad_()
    (net(fr) * w).sum().backward()
    want, want_gx, want_gw = net(full), fr.grad, net.weight.grad.clone()
    net.zero_grad()

    x = mpidp.shard(full, dim=(-2, -1), manager=gm).requires_grad_()
    y = net(x)
    (y * w).sum().backward()
    mpidp.sync_gradients(net, gm)
    by_channels = mpidp.shard(full, dim=(1, 2), manager=gm)
    refused = refusal(lambda: net(by_channels), MpidpError)
    failed = [
        name
        for name, ok in (
            ("forward", close(y.full_tensor(), want)),
            ("input grad", close(x.grad.full_tensor(), want_gx)),
            ("weight grad", close(net.weight.grad, want_gw)),
            ("channel cut refused", refused is not None and "channel" in refused),
        )
        if not ok
    ]
    assert not failed, (gm.grid, failed, refused)


class Pools(nn.Module):
    """Squeeze-and-excite (``x * sigmoid(conv(avgpool_1x1(x)))``) and adaptive pools to
    (2, 3) (max) and (1, 5) (average): fewer cells than ranks along one or both cut dims."""

    def __init__(self) -> None:
        super().__init__()
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(4, 4, 1), nn.Sigmoid())
        self.pools = (nn.AdaptiveMaxPool2d((2, 3)), nn.AdaptiveAvgPool2d((1, 5)))

    def forward(self, x):
        return [x * self.se(x)] + [pool(x) for pool in self.pools]


def test_adaptive_pools_to_few_cells(gm):
    """The squeeze-and-excite output block and the pooled cells (Replicated) equal serial, as
    do the input gradient and the 1x1 conv's gradients."""
    net = Pools().double()
    full = rand(SHAPE, 2)
    ws = [rand(s, 3 + i) for i, s in enumerate([SHAPE, (2, 4, 2, 3), (2, 4, 1, 5)])]
    fr = full.clone().requires_grad_()
    want = net(fr)
    sum((y * w).sum() for y, w in zip(want, ws, strict=True)).backward()
    want_grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad()

    x = mpidp.shard(full, dim=(-2, -1), manager=gm).requires_grad_()
    got = net(x)
    sum((y * w).sum() for y, w in zip(got, ws, strict=True)).backward()
    mpidp.sync_gradients(net, gm)
    whole = [y.full_tensor() if isinstance(y, mpidp.ShardedTensor) else y for y in got]
    failed = [
        f"out[{i}]" for i, (a, b) in enumerate(zip(whole, want, strict=True)) if not close(a, b)
    ]
    failed += ["input grad"] if not close(x.grad.full_tensor(), fr.grad) else []
    failed += [n for n, p in net.named_parameters() if not close(p.grad, want_grads[n])]
    assert not failed, (gm.grid, failed)


class Shuffles(nn.Module):
    """A pixel shuffle by views (x 2 along both cut dims: (13, 2) -> 26 rows, (20, 2) -> 40
    columns), then a split of the rows by 2 and the columns by 4 folded into the channels
    (40 columns by 4: boundaries move at 1 x 4 and 3 ranks), then a conv with halos."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 2, 3, padding=1)

    def forward(self, x):
        b, c, h, w = x.shape
        y = x.view(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)
        y = y.view(b, c // 4, h, 2, w // 2, 4).permute(0, 1, 3, 5, 2, 4)
        return self.conv(y.reshape(b, 8, h, w // 2))


def test_pixel_shuffle_and_split_views(gm):
    """The views' output block, the input gradient and the conv's gradients equal serial."""
    net = Shuffles().double()
    full, w = rand(SHAPE, 6), rand((2, 2, 13, 10), 7)
    fr = full.clone().requires_grad_()
    (net(fr) * w).sum().backward()
    want, want_grads = net(full), {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad()

    x = mpidp.shard(full, dim=(-2, -1), manager=gm).requires_grad_()
    y = net(x)
    (y * w).sum().backward()
    mpidp.sync_gradients(net, gm)
    failed = ["forward"] if not close(y.full_tensor(), want) else []
    failed += ["input grad"] if not close(x.grad.full_tensor(), fr.grad) else []
    failed += [n for n, p in net.named_parameters() if not close(p.grad, want_grads[n])]
    assert not failed, (gm.grid, failed)
