"""Kept rules of the general dispatch path (issue 47, :mod:`mpidp.sharded.kept`), each against
serial torch and the full rule they stand for:

* a call whose rule is one torch call on the bands (a circular pad along the longitude, a
  slice, the skip ``cat``, a 1x1 convolution: the converted U-Net's upsampling path) gives,
  kept, what the full rule gave when it was planned, on uneven bands and on 2 x 1 / 1 x 2
  blocks;
* a call of another layout, value or grad mode is checked by the full rule afresh (and kept
  anew); a call that repeats a tensor is not kept with slots that would mix them up;
* a refused call keeps nothing: its second call is refused again, and a kept signature of the
  same function beside it still computes.

Float64, uneven shards, output, input gradient and every parameter gradient (after
``mpidp.sync_gradients``) against the serial module; asserted after every collective.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import rand, refusal
from mpi4py import MPI
from test_dispatch_cache import SHAPE, _differs, _run, _serial
from torch import nn

import mpidp
from mpidp.errors import MpidpError
from mpidp.runtime.partition import ShardSpec
from mpidp.sharded import kept

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
# uneven bands, and at 2 ranks blocks cut along one axis each way
GRIDS = [WORLD] + ([(2, 1), (1, 2)] if WORLD == 2 else [])


@pytest.fixture(scope="module", params=GRIDS, ids=str)
def gm(request):
    with mpidp.DistributedManager(domain_parallel_size=request.param) as m:
        yield m


class Skip(nn.Module):
    """:class:`~mpidp.models.PeriodicUpsample`'s pad and slice, the U-Net's skip ``cat`` and
    a 1x1 convolution."""

    def __init__(self, wrap: int = 2) -> None:
        super().__init__()
        self.wrap = wrap
        self.conv = nn.Conv2d(2 * SHAPE[1], 4, 1).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = F.pad(x, (self.wrap, self.wrap, 0, 0), mode="circular")
        s = p[..., self.wrap - 1 : p.size(-1) - self.wrap - 1]
        return self.conv(torch.cat([s, x], 1))


def _kinds(funcs):
    """The kinds of the kept rules of ``funcs``."""
    return {type(r).__name__ for s, r in kept.KEPT.items() if s[0] in funcs}


@pytest.fixture(scope="module")
def skip():
    torch.manual_seed(0)
    net = Skip()
    return net, _serial(net, net, rand(SHAPE, 1))


def test_kept_rule_equals_the_full_rule_and_serial(gm, skip):
    """Planned (the full rules) and then kept, the skip block's output and gradients equal
    serial and each other; on bands the cat and the 1x1 convolution are kept rules."""
    net, want = skip
    full = rand(SHAPE, 1)
    kept.forget()
    planned = _run(gm, net, net, full)
    again = _run(gm, net, net, full)
    bad = [f"planned {b}" for b in _differs(planned, want)]
    bad += [f"kept {b}" for b in _differs(again, want)]
    if not torch.equal(planned[0].local, again[0].local):
        bad.append("kept output differs from the full rule's")
    if not gm._blocks and _kinds({torch.cat, F.conv2d}) != {"Kept"}:
        bad.append(f"not kept: {_kinds({torch.cat, F.conv2d})}")
    assert not bad


def test_another_layout_or_value_is_checked_afresh(gm, skip):
    """Kept calls interleaved with calls of another partition (bands), another pad width and
    another global length: each equals serial."""
    net, want = skip
    full = rand(SHAPE, 1)
    bad = [f"first {b}" for b in _differs(_run(gm, net, net, full), want)]
    if not gm._blocks and WORLD > 1:  # another cut of the same rows
        sizes = [1] * (WORLD - 1) + [SHAPE[2] - WORLD + 1]
        got = _run(gm, net, net, full, spec=ShardSpec(tuple(sizes)))
        bad += [f"spec {sizes} {b}" for b in _differs(got, want)]
    net.wrap = 3  # another value
    bad += [f"wrap 3 {b}" for b in _differs(_run(gm, net, net, full), _serial(net, net, full))]
    net.wrap = 2
    # another length: one more row, which leaves rank 0 its rows (not its band's cut)
    longer = rand((SHAPE[0], SHAPE[1], SHAPE[2] + 1, SHAPE[3]), 2)
    got = _run(gm, net, net, longer)
    bad += [f"H + 1 {b}" for b in _differs(got, _serial(net, net, longer))]
    bad += [f"again {b}" for b in _differs(_run(gm, net, net, full), want)]
    assert not bad


def test_grad_mode_and_repeated_tensors(gm):
    """A rule kept with gradients runs anew without (its result needs no gradient); a cat of
    one tensor twice, before and after a cat of two, takes the tensors it is given."""
    a, b = rand(SHAPE, 3), rand(SHAPE, 4)
    dims = (-2, -1) if gm._blocks else -2
    xa, xb = (mpidp.shard(t, dims, gm).requires_grad_() for t in (a, b))
    kept.forget()
    outs = [torch.cat([xa, xa], 1), torch.cat([xa, xb], 1), torch.cat([xb, xb], 1)]
    with torch.no_grad():
        quiet = torch.cat([xa, xb], 1)
    wants = [torch.cat(p, 1) for p in ((a, a), (a, b), (b, b), (a, b))]
    got = [o.full_tensor() for o in (*outs, quiet)]
    bad = [i for i, (g, w) in enumerate(zip(got, wants, strict=True)) if not torch.equal(g, w)]
    if quiet.requires_grad or not outs[1].requires_grad:
        bad.append("grad mode")
    assert not bad


def test_refused_call_is_refused_again(gm):
    """``torch.cumsum`` across the channels is kept; along the rows, which the bands cut, it is
    refused, on its second call too, and the kept signature still computes."""
    full = rand(SHAPE, 5)
    x = mpidp.shard(full, (-2, -1) if gm._blocks else -2, gm)
    got = [torch.cumsum(x, 1).full_tensor() for _ in range(2)]
    refused = [refusal(lambda: torch.cumsum(x, 2), MpidpError) for _ in range(2)]
    got.append(torch.cumsum(x, 1).full_tensor())
    bad = [i for i, g in enumerate(got) if not torch.equal(g, torch.cumsum(full, 1))]
    bad += [f"call {i}: {r}" for i, r in enumerate(refused) if r is None or "cumsum" not in r]
    assert not bad
