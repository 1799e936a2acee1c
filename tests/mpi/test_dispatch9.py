"""The cached paths of the converted model's step (issue 47: a converted U-Net within 1.1x of
plain torch at P = 1), each against serial torch on the full field:

* a converted layer's plan (:func:`mpidp.sharded.modules.run_layer`) is taken only by a call
  of its facts: a call of another dtype, length, cut, grad mode, or on a new manager after
  the first was shut down, is checked afresh and equals serial, its output on the call's
  manager;
* a kept rule (:mod:`mpidp.sharded.kept`) is taken only by a call of its values: slices of
  one length from other starts, a keyword tensor (``weight=``) of another value, a ``cat``
  of its tensors in the other order;
* a module computing on bands as it is that changes the channels (a 1x1 convolution) and an
  element-wise product that broadcasts a band into more channels keep the band's cut, and
  the wrapper answers ``size()`` with the global sizes.

Float64, uneven bands, output, input gradient and every parameter gradient (after
``mpidp.sync_gradients``) against serial; asserted after every collective.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import rand
from mpi4py import MPI
from test_dispatch_cache import SHAPE, _differs, _run, _serial
from torch import nn

import mpidp
from mpidp.runtime.partition import ShardSpec

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()


def _net():
    torch.manual_seed(90)
    return nn.Sequential(
        mpidp.PeriodicConv2d(3, 4, 3, pole="polar"), nn.GroupNorm(2, 4), nn.SiLU()
    ).double()


def test_layer_plans_take_no_stale_fact():
    """Converted layers (bound to the call's manager) called with one layout twice (the second
    call takes the plans), then a longer field, another cut that leaves rank 0 its band,
    another dtype, no gradients, and the first layout on a new manager after the first was
    shut down: each equals serial, on the call's manager."""
    serial = _net()
    net = copy.deepcopy(serial)
    for name, child in list(net.named_children()):  # each layer fed ShardedTensors
        setattr(net, name, mpidp.convert_to_domain_parallel(child))
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as m:  # shut down at its end
        first = m.partition.spec(SHAPE[2], WORLD)
        # rank 0's band again, the others one row longer (one rank: one row longer)
        same_band = ShardSpec((first.sizes[0] + (WORLD == 1), *(n + 1 for n in first.sizes[1:])))
        full, longer = rand(SHAPE, 1), rand((2, 3, same_band.total, SHAPE[3]), 2)
        bad = []
        for name, x, spec in [
            ("first", full, None),
            ("again", full, None),
            ("longer", longer, None),
            ("another cut", longer, same_band),
            ("first once more", full, None),
        ]:
            got = _run(m, net, net, x, spec)
            bad += [f"{name}: {b}" for b in _differs(got, _serial(serial, serial, x))]
        # another dtype, the same layers: float32 against serial float32 (other kernels' rounding)
        y32 = net.float()(mpidp.shard(full.float(), -2, m)).full_tensor()
        want32 = serial.float()(full.float()).detach()
        net.double(), serial.double()
        if y32.dtype != torch.float32 or not torch.allclose(y32, want32, rtol=1e-5, atol=1e-6):
            bad.append("float32")
        with torch.no_grad():
            quiet = net(mpidp.shard(full, -2, m))
        if quiet.requires_grad or not torch.allclose(
            quiet.full_tensor(), serial(full), 1e-10, 1e-10
        ):
            bad.append("no grad")
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as m2:
        got = _run(m2, net, net, full)
        bad += [f"new manager: {b}" for b in _differs(got, _serial(serial, serial, full))]
        if got[0].manager is not m2:
            bad.append("new manager: the output is on the old one")
    assert not bad


class _Calls(nn.Module):
    """Kept rules whose signatures differ in a value only: slices of one length, a 1x1
    convolution's keyword weight, the two orders of a ``cat``."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(rand((4, 3, 1, 1), 3))
        self.w2 = nn.Parameter(rand((4, 3, 1, 1), 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x[..., 1:9], x[..., 2:10]  # one length, other starts
        a, b = F.conv2d(a, weight=self.w1), F.conv2d(b, weight=self.w2)
        ab, ba = torch.cat([a, b], 1), torch.cat([b, a], 1)
        return torch.cat([ab, ba * 2], 1)


def test_kept_rules_take_no_stale_value(manager):
    """Called twice (the second call takes the kept rules), each value of the signature is
    its own call's: output and gradients equal serial."""
    module = _Calls()
    full = rand(SHAPE, 5)
    want = _serial(module, module, full)
    bad = [
        f"call {i}: {b}"
        for i in range(2)
        for b in _differs(_run(manager, module, module, full), want)
    ]
    assert not bad


class _Channels(nn.Module):
    """A band broadcast into more channels, and a 1x1 convolution (a module the conversion
    hands the band as it is); the global shapes its forward sees, in ``seen``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(rand((1, 5, 1, 1), 6))
        self.mix = nn.Conv2d(5, 2, 1).double()
        self.seen: list[tuple] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = x[:, :1] * self.scale
        y = self.mix(p)
        self.seen.append((tuple(x.size()), x.size(-2), x.size(dim=1), p.size(), y.shape))
        return y


def test_outputs_with_other_channels_keep_the_cut(manager):
    """The converted model, twice (the model's own convention: this rank's band in and out):
    its broadcast product and 1x1 convolution give bands of the input's cut, output and
    gradients equal to serial."""
    serial = _Channels()
    net = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager)
    full = rand(SHAPE, 7)
    want = _serial(serial, serial, full)
    spec = manager.partition.spec(SHAPE[2], WORLD)
    bad = []
    for i in range(2):
        net.zero_grad()
        x = mpidp.shard(full, -2, manager).local.detach().requires_grad_()
        y = net(x)  # this rank's band of the output
        w = mpidp.shard(rand((2, 2, *SHAPE[2:]), 7), -2, manager).local
        (y * w).sum().backward()
        mpidp.sync_gradients(net, manager)
        got = [
            mpidp.ShardedTensor.from_local(t, dim=-2, spec=spec, manager=manager)
            for t in (y, x.grad)
        ]
        grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        mine = (None, *(g.full_tensor().detach() for g in got), grads)
        bad += [f"call {i}: {b}" for b in _differs(mine, want)]
    n, c, h, w = SHAPE
    if net.seen != [(SHAPE, h, c, (n, 5, h, w), (n, 2, h, w))] * 2:
        bad.append(f"global sizes {net.seen}")
    assert not bad
