"""The per-call fast paths of ShardedTensor dispatch (issue 47, item 1), each against serial
torch and the general path it stands for:

* a converted layer keeps the plan of its last call's layout (band shape, partition, dim,
  manager): a call of another layout is checked afresh (and makes its own plan); a call of the
  same layout whose output disagrees with the plan still raises on every rank;
* :class:`~mpidp.layers.PeriodicConv2d` fed a ShardedTensor is one dispatched call (its layer:
  one halo exchange), equal to its ops dispatched one by one (the pole rows, the
  concatenation, the circular pad, the convolution) on bands; on blocks, where those ops are
  refused (a flip of a block), the one call is what runs.

Float64, uneven shards, output, input gradient and every parameter gradient (after
``mpidp.sync_gradients``) against the serial module; asserted after every collective.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from helpers import rand, refusal
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.layers.base import band_forward
from mpidp.layers.norm import DomainParallelGroupNorm
from mpidp.layers.periodic import padded_conv2d
from mpidp.runtime.partition import ShardSpec
from mpidp.sharded import ShardedTensor

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
# bands, and one grid of blocks where the world has one with both axes cut
GRIDS = [(WORLD, 1)] + ([(2, WORLD // 2)] if WORLD in (4, 6) else [])
SHAPE = (2, 3, 13, 20)  # 13 rows uneven over 2-6 ranks, 20 columns over 3; W even (polar)


@pytest.fixture(scope="module", params=GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def gm(request):
    with mpidp.DistributedManager(domain_parallel_size=request.param) as m:
        yield m


def _whole(t):
    """The global value of a result or gradient (collective for a ShardedTensor)."""
    if isinstance(t, ShardedTensor):
        t = t.full_tensor()
    return t.detach().as_subclass(torch.Tensor)


def _run(m, fn, module, full, spec=None, dims=(-2, -1)):
    """``fn`` on the ShardedTensor of ``full``: (output, input gradient, parameter gradients
    summed over the domain group), all global. Collective over the domain group."""
    module.zero_grad()
    x = mpidp.shard(full, dims if m._blocks else dims[0], m, spec).detach().requires_grad_()
    y = fn(x)
    w = mpidp.shard(rand(tuple(y.shape), 7), dims if m._blocks else dims[0], m)
    (y * w).sum().backward()
    mpidp.sync_gradients(module, m)
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    return y, _whole(y), _whole(x.grad), grads


def _serial(fn, module, full):
    module.zero_grad()
    x = full.clone().requires_grad_()
    y = fn(x)
    (y * rand(tuple(y.shape), 7)).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def _differs(got, want, tol=1e-10):
    """The names of the parts of ``got`` (:func:`_run`) that differ from ``want`` (serial)."""
    (_, y, gx, gp), (wy, wx, wp) = got, want
    pairs = [("output", y, wy), ("input grad", gx, wx)] + [(f"grad {n}", gp[n], wp[n]) for n in wp]
    return [
        name
        for name, a, b in pairs
        if a.shape != b.shape or not torch.allclose(a, b, rtol=tol, atol=tol)
    ]


PERIODIC = [
    dict(kernel_size=3, pole="polar"),
    dict(kernel_size=3, pole="reflect"),
    dict(kernel_size=(5, 3), stride=2, pole="polar_half"),
]


def _by_ops(weight, bias, args, x):
    return padded_conv2d(x, weight, bias, *args)


def test_fused_periodic_conv_equals_op_by_op_and_serial(gm):
    """A PeriodicConv2d fed a ShardedTensor (one dispatched call, its layer) and, on bands, its
    ops dispatched one by one (:func:`~mpidp.layers.periodic.padded_conv2d`) equal serial; on
    blocks the ops are refused on every rank (ConfigError)."""
    full = rand(SHAPE, 1)
    bad = []
    for i, kwargs in enumerate(PERIODIC):
        torch.manual_seed(10 + i)
        conv = mpidp.PeriodicConv2d(3, 4, **kwargs).double()
        want = _serial(conv, conv, full)
        bad += [f"{kwargs} fused {b}" for b in _differs(_run(gm, conv, conv, full), want)]
        args = (conv.stride, conv.periodic_padding, conv.dilation, conv.groups, conv.pole)
        ops = functools.partial(_by_ops, conv.weight, conv.bias, args)
        if gm._blocks:  # a flip of a block is refused (the fused call is what runs there)
            refused = refusal(functools.partial(_run, gm, ops, conv, full))
            if refused is None or "Tensor.flip" not in refused:
                bad.append(f"{kwargs} op by op on blocks: {refused}")
            continue
        bad += [f"{kwargs} op by op {b}" for b in _differs(_run(gm, ops, conv, full), want)]
    assert not bad


class _Shrinks(DomainParallelGroupNorm):
    """A converted GroupNorm that drops its last row once told to: a layer whose output
    disagrees with the plan its earlier calls made."""

    shrink = False

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = DomainParallelGroupNorm.forward(self, x)
        return y.narrow(2, 0, y.size(2) - 1) if self.shrink else y


def test_layer_plan_follows_the_layout(manager):
    """Converted layers called with one layout twice (the second call takes the plans), then
    a longer field whose cut gives rank 0 the same band shape, then bands cut along another
    dim (the layers' torch forms, op by op), then the first layout again: every call equals
    serial and keeps its input's cut. A layer whose output no longer fits its plan takes the
    general path: refused on every rank (one rank: the output's own length)."""
    torch.manual_seed(20)
    serial = nn.Sequential(
        nn.GroupNorm(1, 3), mpidp.PeriodicConv2d(3, 4, 3, pole="polar"), nn.SiLU()
    ).double()
    net = copy.deepcopy(serial)
    for name, child in list(net.named_children()):  # each layer fed ShardedTensors
        setattr(net, name, mpidp.convert_to_domain_parallel(child, manager))
    p = manager.domain_world_size
    first = manager.partition.spec(13, p)
    same_band = ShardSpec((first.sizes[0], *(n + 1 for n in first.sizes[1:])))
    short, longer = rand(SHAPE, 2), rand((2, 3, same_band.total, 20), 3)
    bad, dims = [], []
    for name, full, spec, cut in [
        ("first", short, None, -2),
        ("first again", short, None, -2),
        ("another length", longer, same_band, -2),
        ("cut along W", short, None, -1),
        ("first once more", short, None, -2),
    ]:
        want = _serial(serial, serial, full)
        got = _run(manager, net, net, full, spec, dims=(cut, -1))
        bad += [f"{name}: {b}" for b in _differs(got, want)]
        dims.append(got[0].shard_dim)
    if dims != [2, 2, 2, 3, 2]:
        bad.append(f"outputs cut along {dims}")
    layer = _Shrinks.from_module(nn.GroupNorm(1, 3).double(), manager)
    x = mpidp.shard(short, -2, manager)
    layer(x), layer(x)
    layer.shrink = True
    try:
        rows = layer(x).shape[2]
        raised = ""
    except mpidp.MpidpError as err:
        rows, raised = None, str(err)
    assert not bad
    if p == 1:  # one rank's band is the whole field, of the layer's length
        assert rows == 12, rows
    else:
        assert "internal error" in raised, raised
