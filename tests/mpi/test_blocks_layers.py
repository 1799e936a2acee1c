"""Converted layers on latitude x longitude blocks (issue 46, item 4, first layers): the band
layers computing per cut axis, each against its serial torch module on the full field, at every
grid that fits the world (bands are the grid (P, 1), so the same tests run on bands too).

Each case converts the torch module (``mpidp.convert_to_domain_parallel``), runs it on this
rank's block (uneven in both dims) and compares, in float64, the output block, the input
gradient and every parameter gradient after ``mpidp.sync_gradients`` with the serial module's;
the checks are asserted only after every collective of a test.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import rand, refusal
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.runtime.grid import BlockSpec

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
ALL_GRIDS = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (1, 3), (3, 1)]
GRIDS = [g for g in ALL_GRIDS if g[0] * g[1] == WORLD]
SHAPE = (2, 4, 9, 13)  # uneven over every grid above


@pytest.fixture(scope="module", params=GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def gm(request):
    """A manager whose whole world is one domain grid."""
    with mpidp.DistributedManager(domain_parallel_size=request.param) as m:
        yield m


def close(a, b, tol=1e-10):
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=tol, atol=tol))


def out_blocks(m, shape):
    """The blocks of a layer's output: the policy's rule for derived lengths, per dim."""
    (p_lat, p_lon), (h, w) = m.grid, shape[-2:]
    return BlockSpec(m.partition.derived(h, p_lat), m.partition.derived(w, p_lon))


def layer_case(m, serial, shape=SHAPE, seed=0):
    """The failed checks of ``serial`` converted and run on this rank's block against
    ``serial`` on the full field: output, input gradient, parameter gradients, buffers."""
    serial = serial.double()
    layer = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager=m)
    full = rand(shape, seed)
    x = mpidp.shard_tensor(full, dim=(-2, -1), manager=m).detach().requires_grad_()
    y = layer(x)
    fr = full.clone().requires_grad_()
    want = serial(fr)
    w = rand(tuple(want.shape), seed + 1)
    rs, cs = out_blocks(m, want.shape).block(m.domain_rank)
    (y * w[..., rs, cs]).sum().backward()
    (want * w).sum().backward()
    mpidp.sync_gradients(layer, m)
    irs, ics = m.block_spec(shape).block(m.domain_rank)
    name = repr(serial)
    checks = [
        (f"{name} forward", close(y, want[..., rs, cs])),
        (f"{name} input grad", close(x.grad, fr.grad[..., irs, ics])),
    ]
    pairs = zip(layer.named_parameters(), serial.named_parameters(), strict=True)
    checks += [(f"{name} grad {n}", close(p.grad, q.grad)) for (n, p), (_, q) in pairs]
    buffers = zip(layer.named_buffers(), serial.named_buffers(), strict=True)
    checks += [(f"{name} buffer {n}", close(b.double(), c.double())) for (n, b), (_, c) in buffers]
    return [name for name, ok in checks if not ok]


# (kernel, stride, padding, dilation): kernel 1/3/5, stride 1 and 2, dilation 2, int / 'same' /
# 'valid' padding, a kernel and stride that differ per dim
CONVS = [
    (3, 1, 1, 1),
    (1, 2, 0, 1),
    (5, 1, "same", 1),
    (3, 2, 1, 1),
    (3, 1, "same", 2),
    (5, 2, 2, 2),
    (3, 1, "valid", 1),
    ((3, 5), (2, 1), (1, 2), (1, 2)),
]
MODES = ["zeros", "circular", "reflect", "replicate"]


@pytest.mark.parametrize("mode", MODES)
def test_conv2d(gm, mode):
    bad = []
    for i, (k, s, p, d) in enumerate(CONVS):
        if p == "same" and s != 1:
            continue
        conv = nn.Conv2d(4, 6, k, s, p, d, groups=2 if i % 3 == 0 else 1, padding_mode=mode)
        bad += layer_case(gm, conv, seed=i)
    assert not bad


def test_conv_transpose(gm):
    """Transposed convolutions: stride 2 with output_padding, a kernel wider than the stride,
    dilation and groups, a kernel and stride that differ per dim, a 3-D one."""
    bad = []
    for i, args in enumerate(
        [
            dict(kernel_size=3, stride=2, padding=1, output_padding=1),
            dict(kernel_size=4, stride=2, padding=1, groups=2, bias=False),
            dict(kernel_size=3, stride=1, padding=2, dilation=2),
            dict(kernel_size=(3, 5), stride=(1, 3), padding=(0, 2), output_padding=(0, 1)),
        ]
    ):
        bad += layer_case(gm, nn.ConvTranspose2d(4, 2, **args), seed=80 + i)
    conv = nn.ConvTranspose3d(3, 2, 3, (1, 2, 2), 1, output_padding=(0, 1, 1))
    bad += layer_case(gm, conv, (1, 3, 3, 9, 13), seed=90)
    assert not bad


def test_conv3d_and_pointwise(gm):
    """A Conv3d (T padded locally, H and W cut) and convolutions local along one axis only: a
    kernel (1, 3) conv is local along H but not W, so on blocks it is converted."""
    bad = layer_case(gm, nn.Conv3d(3, 2, 3, 1, 1, padding_mode="circular"), (1, 3, 4, 9, 13))
    for k, p in (((1, 3), (0, 1)), ((3, 1), (1, 0)), (1, 0)):
        bad += layer_case(gm, nn.Conv2d(4, 3, k, 1, p, padding_mode="circular"), seed=5)
    assert not bad


NORMS = [
    lambda: nn.GroupNorm(2, 4),
    lambda: nn.InstanceNorm2d(4, affine=True),
    lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
    lambda: nn.BatchNorm2d(4),
    lambda: nn.LayerNorm([4, 9, 13]),
    lambda: nn.LayerNorm([9, 13]),
    lambda: nn.LayerNorm(13),  # over W alone: the longitude row's statistics on blocks
]


def test_norms(gm):
    """Statistics over every rank holding a part of the normalised dims; running statistics
    updated as torch updates them; a conv after a norm (the gradient through both)."""
    bad = []
    for i, make in enumerate(NORMS):
        norm = make()
        for p in norm.parameters():  # not torch's ones and zeros: the gradients show the cut
            p.data = rand(tuple(p.shape), 30 + i).float()
        bad += layer_case(gm, norm, seed=10 + i)
    net = nn.Sequential(nn.GroupNorm(2, 4), nn.Conv2d(4, 4, 3, 2, 1, padding_mode="circular"))
    net = net.double()
    for j, layer in enumerate(net):  # convert the layers, run them as bare layers in a row
        net[j] = mpidp.convert_to_domain_parallel(layer, manager=gm)
    full = rand(SHAPE, 40)
    x = mpidp.shard_tensor(full, dim=(-2, -1), manager=gm)
    y = net[1](net[0](x))
    serial = nn.Sequential(nn.GroupNorm(2, 4), nn.Conv2d(4, 4, 3, 2, 1, padding_mode="circular"))
    serial.double().load_state_dict(net.state_dict())
    want = serial(full)
    rs, cs = out_blocks(gm, want.shape).block(gm.domain_rank)
    bad += [] if close(y, want[..., rs, cs]) else ["norm then conv"]
    assert not bad


POOLS = [
    lambda: nn.MaxPool2d(3, 2, 1),
    lambda: nn.MaxPool2d(2, ceil_mode=True),
    lambda: nn.MaxPool2d((3, 2), (2, 3), (1, 0), dilation=(2, 1), ceil_mode=True),
    lambda: nn.AvgPool2d(3, 2, 1),
    lambda: nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False),
    lambda: nn.AvgPool2d(2, ceil_mode=True),
    lambda: nn.AvgPool2d((2, 3), 1, (1, 1), divisor_override=5),
]


def test_pools(gm):
    """Windows cut along both dims: ceil_mode windows past the end, the divisor per dim
    (count_include_pad), a 3-D pool with T pooled locally."""
    bad = []
    for i, make in enumerate(POOLS):
        bad += layer_case(gm, make(), seed=60 + i)
    bad += layer_case(gm, nn.AvgPool3d(3, 2, 1, ceil_mode=True), (1, 2, 5, 9, 13), seed=70)
    assert not bad


def test_not_yet_on_blocks_refuses(gm):
    """Layers without a block form keep refusing on blocks, on every rank, before any
    message; on bands they run."""
    x = mpidp.shard_tensor(rand(SHAPE, 50), dim=(-2, -1), manager=gm)
    layers = {
        "DomainParallelInterpolate": nn.Upsample(scale_factor=2, mode="bilinear"),
        "DomainParallelAdaptiveAvgPool2d": nn.AdaptiveAvgPool2d(3),
    }
    got = {}
    for name, layer in layers.items():
        layer = mpidp.convert_to_domain_parallel(layer.double(), manager=gm)
        got[name] = refusal(lambda layer=layer: layer(x))
    conv1d = mpidp.DomainParallelConv1d.from_module(nn.Conv1d(4, 4, 3).double(), gm, -1)
    got["1-D"] = refusal(lambda: conv1d(x[..., 0, :]))
    pool1d = mpidp.convert_to_domain_parallel(nn.MaxPool1d(3, 1, 1), manager=gm)
    got["1-D pool"] = refusal(lambda: pool1d(x[..., 0, :]))
    if gm.grid[1] == 1:
        assert got == dict.fromkeys(got)
    else:
        assert all(f"the converted layer {n}" in got[n] for n in layers), got
        assert "the converted layer DomainParallelConv1d" in got["1-D"], got
        assert "the converted layer DomainParallelMaxPool1d (1-D)" in got["1-D pool"], got
