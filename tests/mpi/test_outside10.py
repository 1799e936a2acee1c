"""Holes found running real models outside the zoo (H2, tenth session), in plain torch.

PhysicsNeMo's HEALPix padding builds each face's corner patch as ``ret = zeros_like(top)[...,
:p, :p]`` and writes single elements into it, ``ret[..., -1, -1] = 0.5 * top[..., -1, 0] +
0.5 * lft[..., 0, -1]``: a write at one row of the cut dim. Only the rank that holds that row
wrote; on the others the patch did not require grad, so their backward skipped the value's
history, whose messages (the reads of another rank's row it was made from) every rank takes
part in: the HEALPix U-Net's backward failed with ranks calling all_to_all_v with different
arguments (a silent pairing with the wrong message where the arguments happen to agree).
Float64, 13 x 20 (uneven bands), on bands of every size of the world.

Reading ``.grad`` of two bands of one shape, the second without a gradient, was an internal
error: the kept rules (mpidp.sharded.kept) replayed the first read.
"""

from __future__ import annotations

import pytest
import torch
from helpers import agreed, rand, refusal
from torch import nn

import mpidp
from mpidp.sharded import ShardedTensor, shard

pytestmark = pytest.mark.mpi

B, C, H, W = 2, 3, 13, 20


def _full(t):
    t = t.full_tensor() if isinstance(t, ShardedTensor) else t
    return t.detach().as_subclass(torch.Tensor)


class Corners(nn.Module):
    """HEALPix's corner patches (``HEALPixPadding.tl`` / ``.br``, p = 2) of a convolved field,
    joined to the field's border rows along the cut dim (``pe``'s ``torch.cat(..., dim=-2)``):
    single elements written at the first and the last row, a row slice and a column."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Conv2d(C, C, 3, padding=1).double()
        self.scale = nn.Parameter(torch.tensor([0.5, 1.5], dtype=torch.float64))

    def forward(self, x):
        y = self.mix(x)
        p = 2
        top = torch.zeros_like(y)[..., :p, :p]  # rows 0, 1: the first rank's
        top[..., -1, -1] = self.scale[0] * y[..., -1, 0] + 0.5 * x[..., 0, -1]
        top[..., -2, -1:] = y[..., -2, :1]
        bot = torch.zeros_like(y)[..., -p:, -p:]  # the last rows: the last rank's
        bot[..., 0, 0] = self.scale[1] * y[..., 0, -1] * x[..., -1, 0]
        bot[..., 1, :1] = y[..., 1, -1:]
        side = torch.cat((top, y[..., :p], bot), dim=-2)  # H + 2 p rows
        return torch.cat((side, torch.cat((y[..., -p:, :], y, y[..., :p, :]), dim=-2)), dim=-1)


def test_writes_at_one_row_of_the_cut_dim_keep_every_ranks_gradient(manager):
    model = Corners()
    full = rand((B, C, H, W), 3)
    xr = full.clone().requires_grad_()
    yr = model(xr)
    w = rand(tuple(yr.shape), 5)
    (yr * w).sum().backward()
    refs = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    x = shard(full, -2, manager).requires_grad_()
    y = model(x)
    (y * w).sum().backward()
    mpidp.sync_gradients(model, manager)
    got = {"out": _full(y), "grad_in": _full(x.grad)}
    want = {"out": yr.detach(), "grad_in": xr.grad}
    for n, p in model.named_parameters():
        got[n], want[n] = p.grad, refs[n]
    bad = []
    for k, g in got.items():
        e = float((g - want[k]).abs().max() / want[k].abs().max()) if g is not None else 1.0
        if not e <= 1e-12:
            bad.append(f"rank {manager.rank} {k}: rel {e:.3g}")
    assert not agreed(bad)


def test_a_band_written_at_one_row_is_refused_on_every_rank(manager):
    """``field[..., 0, :] = band`` (a band along the field's columns written into one of its
    rows): the rank that holds the row refused it; the others went on, and waited."""
    field = shard(torch.zeros(B, C, H, H, dtype=torch.float64), -2, manager)
    band = shard(rand((B, C, H), 4), -1, manager)

    def write():
        field[..., 0, :] = band

    err = refusal(write, mpidp.MpidpError)
    assert all(agreed([err is not None and "a band written across the sharded dim" in err]))


def test_reading_grad_of_bands_of_one_shape_gives_each_its_own(manager):
    """``[x.grad for x in inputs]`` where one input took no part in the loss: the first read
    was kept as a replay of the band's ``.grad``, and the second (None) was an internal
    error."""
    xs = [shard(rand((B, C, H, W), 8 + i), -2, manager).requires_grad_() for i in range(3)]
    (xs[1] * 2.0).sum().backward()
    got = [x.grad for x in xs]
    bad = [] if got[0] is None and got[2] is None else ["unused inputs have a gradient"]
    if got[1] is None or not torch.equal(_full(got[1]), torch.full((B, C, H, W), 2.0).double()):
        bad.append(f"rank {manager.rank}: the used input's gradient is not 2")
    assert not agreed(bad)
