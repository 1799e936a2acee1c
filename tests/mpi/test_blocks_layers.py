"""Converted layers on latitude x longitude blocks (issue 46, item 4): the band layers computing
per cut axis (convolutions, pools, norms, pads, interpolation, pixel shuffles, the periodic and
polar convolution; latitude-weighted losses), each against its serial torch module on the full
field, at every grid that fits the world (bands are the grid (P, 1): the same tests run on
bands too).

Each case converts the torch module (``mpidp.convert_to_domain_parallel``), runs it on this
rank's block (uneven in both dims) and compares, in float64, the output block, the input
gradient and every parameter gradient after ``mpidp.sync_gradients`` with the serial module's;
the checks are asserted only after every collective of a test.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import close, rand, refusal
from torch import nn

import mpidp
from mpidp.ops.training import mean_share
from mpidp.runtime.grid import BlockSpec

pytestmark = pytest.mark.mpi

SHAPE = (2, 4, 9, 13)  # uneven over every grid above


def out_blocks(m, shape):
    """The blocks of a layer's output: the policy's rule for derived lengths, per dim."""
    (p_lat, p_lon), (h, w) = m.grid, shape[-2:]
    return BlockSpec(m.partition.derived(h, p_lat), m.partition.derived(w, p_lon))


def layer_case(m, serial, shape=SHAPE, seed=0, whole=False):
    """The failed checks of ``serial`` converted and run on this rank's block against
    ``serial`` on the full field: output, input gradient, parameter gradients, buffers.
    ``whole``: the layer's output is the whole result on every rank, whose gradient (summed
    over the ranks, as a replicated value's uses are) is seeded on domain rank 0 alone."""
    serial = serial.double()
    layer = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager=m)
    full = rand(shape, seed)
    x = mpidp.shard_tensor(full, dim=(-2, -1), manager=m).detach().requires_grad_()
    y = layer(x)
    fr = full.clone().requires_grad_()
    want = serial(fr)
    w = rand(tuple(want.shape), seed + 1)
    rs, cs = out_blocks(m, want.shape).block(m.domain_rank)
    if whole:
        rs = cs = slice(None)
        (y * w * (m.domain_rank == 0)).sum().backward()
    else:
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


PADS = [
    lambda: nn.ZeroPad2d((1, 2, 2, 1)),
    lambda: nn.ConstantPad2d((2, 1, 1, 3), 0.5),
    lambda: nn.ReflectionPad2d((2, 1, 1, 2)),
    lambda: nn.ReplicationPad2d((3, 1, 2, 1)),
    lambda: nn.CircularPad2d((1, 2, 2, 1)),
    lambda: nn.ZeroPad2d((-1, 2, 1, -2)),  # a crop along one side of each dim
]


def test_pads(gm):
    """Each pad rule along both cut dims (the corners from both), a constant, a crop, and a 3-D
    pad with T padded locally."""
    bad = []
    for i, make in enumerate(PADS):
        bad += layer_case(gm, make(), seed=100 + i)
    bad += layer_case(gm, nn.ReflectionPad3d((1, 2, 2, 1, 1, 1)), (1, 2, 3, 9, 13), seed=110)
    assert not bad


INTERPOLATIONS = [
    lambda: nn.Upsample(scale_factor=2, mode="nearest"),
    lambda: nn.Upsample(size=(17, 20), mode="bilinear", align_corners=True),
    lambda: nn.Upsample(size=(5, 7), mode="bilinear", align_corners=False),
    lambda: nn.Upsample(scale_factor=(1.5, 0.5), mode="nearest-exact"),
    lambda: nn.Upsample(scale_factor=2, mode="bicubic", align_corners=False),
]


def test_interpolate(gm):
    """To a size and by a scale, up and down, nearest and bilinear (align_corners both),
    bicubic: each cut dim interpolated over its own axis's ranks."""
    bad = []
    for i, make in enumerate(INTERPOLATIONS):
        bad += layer_case(gm, make(), seed=120 + i)
    assert not bad


def test_adaptive_pools(gm):
    """Windows cut along both dims; an output shorter than the grid along either cut dim is
    the whole result on every rank."""
    p_lat, p_lon = gm.grid
    bad = []
    for i, (cls, size) in enumerate(
        [
            (nn.AdaptiveAvgPool2d, (5, 7)),
            (nn.AdaptiveMaxPool2d, (4, 6)),
            (nn.AdaptiveAvgPool2d, (None, 4)),
            (nn.AdaptiveAvgPool2d, 1),
            (nn.AdaptiveMaxPool2d, (1, 5)),
        ]
    ):
        out = (size, size) if isinstance(size, int) else (size[0] or SHAPE[-2], size[1])
        whole = gm.domain_world_size > 1 and (out[0] < p_lat or out[1] < p_lon)
        bad += layer_case(gm, cls(size), seed=130 + i, whole=whole)
    assert not bad


def test_pixel_shuffle(gm):
    """Shuffle and unshuffle by 2: the rows and the columns each move to the policy's cut of
    the output over their axis."""
    bad = layer_case(gm, nn.PixelShuffle(2), (2, 8, 9, 13), seed=140)
    bad += layer_case(gm, nn.PixelUnshuffle(2), (2, 2, 10, 14), seed=141)
    assert not bad


PERIODIC = [
    dict(kernel_size=3, pole="reflect"),
    dict(kernel_size=3, pole="polar"),
    dict(kernel_size=(5, 3), stride=2, pole="polar_half"),
    dict(kernel_size=3, dilation=2, pole="polar"),
]
PERIODIC_SHAPE = (2, 3, 9, 14)  # the polar roll needs an even W; 14 is uneven over 3 and 4


def test_periodic_conv(gm):
    """Latitude by the pole (the rows beyond it from the block half a circle away in longitude,
    another rank when P_lon > 1), longitude circular, corners included."""
    bad = []
    for i, kwargs in enumerate(PERIODIC):
        bad += layer_case(gm, mpidp.PeriodicConv2d(3, 4, **kwargs), PERIODIC_SHAPE, seed=150 + i)
    assert not bad


class PolarNet(nn.Module):
    """Padding across the poles, a norm, a stride-2 conv, interpolation to the skip's size and
    a cat."""

    def __init__(self):
        super().__init__()
        self.inp = mpidp.PeriodicConv2d(3, 4, 3, pole="polar")
        self.norm = nn.GroupNorm(2, 4)
        self.down = mpidp.PeriodicConv2d(4, 4, 3, stride=2, pole="polar_half")
        self.pad = nn.CircularPad2d((1, 1, 0, 0))
        self.up = nn.Upsample(size=PERIODIC_SHAPE[-2:], mode="bilinear")
        self.out = mpidp.PeriodicConv2d(8, 2, 3, pole="polar")

    def forward(self, x):
        skip = torch.relu(self.norm(self.inp(x)))
        low = self.down(skip)
        return self.out(torch.cat([skip, self.up(self.pad(low))], 1))


@pytest.mark.parametrize("route", ["layers", "model"])
def test_polar_net(gm, route):
    """The net on blocks against serial: output, input gradient, every parameter gradient;
    its layers converted one by one and run in a row, or the model converted (its forward on
    ShardedTensors: the relu and the cat through dispatch, the layers as its kernels)."""
    torch.manual_seed(3)
    serial = PolarNet().double()
    net = copy.deepcopy(serial)
    if route == "model":
        net = mpidp.convert_to_domain_parallel(net, manager=gm)
    else:
        for name, child in list(net.named_children()):
            setattr(net, name, mpidp.convert_to_domain_parallel(child, manager=gm))
    full = rand(PERIODIC_SHAPE, 160)
    x = mpidp.shard_tensor(full, dim=(-2, -1), manager=gm).detach().requires_grad_()
    y = net(x)
    fr = full.clone().requires_grad_()
    want = serial(fr)
    w = rand(tuple(want.shape), 161)
    rs, cs = out_blocks(gm, want.shape).block(gm.domain_rank)
    (y * w[..., rs, cs]).sum().backward()
    (want * w).sum().backward()
    mpidp.sync_gradients(net, gm)
    irs, ics = gm.block_spec(PERIODIC_SHAPE).block(gm.domain_rank)
    checks = [("forward", close(y, want[..., rs, cs]))]
    checks.append(("input grad", close(x.grad, fr.grad[..., irs, ics])))
    pairs = zip(net.named_parameters(), serial.named_parameters(), strict=True)
    checks += [(f"grad {n}", close(p.grad, q.grad)) for (n, p), (_, q) in pairs]
    assert not [name for name, ok in checks if not ok]


def test_latitude_weighted_loss(gm):
    """Latitude weights of this rank's rows, the area-weighted global loss and the even-band
    loop's mean_share on blocks: loss, input and parameter gradients equal serial."""
    shape = (2, 3, 9, 13)
    conv = nn.Conv2d(3, 3, 3, padding=1, padding_mode="circular").double()
    full, target = rand(shape, 170), rand(shape, 171)
    wf = mpidp.latitude_weights(shape[-2], spec=[shape[-2]])  # the whole column
    fr = full.clone().requires_grad_()
    err = (conv(fr) - target).square()
    wb = torch.broadcast_to(wf, err.shape)
    want = (err * wb).sum() / wb.sum()
    want.backward()
    mean_fr = full.clone().requires_grad_()
    mean_conv = copy.deepcopy(conv)
    (mean_conv(mean_fr) - target).square().mean().backward()

    irs, ics = gm.block_spec(shape).block(gm.domain_rank)
    w = mpidp.latitude_weights(shape[-2], manager=gm)
    checks = [("weights", close(w, wf[irs]))]
    w = wf[irs]  # the loss below on the right rows even where the weights are wrong: no hang
    t = target[..., irs, ics]
    for kind in ("weighted", "mean_share"):
        layer = mpidp.convert_to_domain_parallel(copy.deepcopy(conv), manager=gm)
        x = full[..., irs, ics].clone().requires_grad_()
        if kind == "weighted":
            loss = mpidp.global_mean((layer(x) - t).square(), w, manager=gm)
            checks.append(("weighted loss", close(loss, want)))
            scale, ref, ref_conv = 1, fr, conv
        else:  # each rank's mean over its block, gradients averaged over the ranks
            loss = (mean_share(layer(x), -2, gm) - t).square().mean()
            scale, ref, ref_conv = gm.domain_world_size, mean_fr, mean_conv
        loss.backward()
        mpidp.sync_gradients(layer, gm)
        checks.append((f"{kind} input grad", close(x.grad / scale, ref.grad[..., irs, ics])))
        pairs = zip(layer.parameters(), ref_conv.parameters(), strict=True)
        checks += [(f"{kind} param grad", close(p.grad / scale, q.grad)) for p, q in pairs]
    assert not [name for name, ok in checks if not ok]


def test_not_yet_on_blocks_refuses(gm):
    """1-D layers keep refusing on blocks, on every rank, before any message; on bands they
    run. A polar roll of an odd longitude refuses on both."""
    x = mpidp.shard_tensor(rand(SHAPE, 50), dim=(-2, -1), manager=gm)
    got = {}
    conv1d = mpidp.DomainParallelConv1d.from_module(nn.Conv1d(4, 4, 3).double(), gm, -1)
    got["1-D"] = refusal(lambda: conv1d(x[..., 0, :]))
    pool1d = mpidp.convert_to_domain_parallel(nn.MaxPool1d(3, 1, 1), manager=gm)
    got["1-D pool"] = refusal(lambda: pool1d(x[..., 0, :]))
    up1d = mpidp.convert_to_domain_parallel(nn.Upsample(scale_factor=2), manager=gm)
    got["1-D interpolate"] = refusal(lambda: up1d(x[..., 0, :]))
    polar = mpidp.PeriodicConv2d(4, 4, 3, pole="polar").double()
    polar = mpidp.convert_to_domain_parallel(polar, manager=gm)
    try:  # W = 13: bands refuse in the halo's agreement, blocks before any message
        polar(x)
        odd = None
    except mpidp.MpidpError as err:
        odd = str(err)
    if gm.domain_world_size > 1:
        assert odd is not None and "odd" in odd, odd
    if gm.grid[1] == 1:
        assert got == dict.fromkeys(got)
    else:
        assert "the converted layer DomainParallelConv1d" in got["1-D"], got
        assert "the converted layer DomainParallelMaxPool1d (1-D)" in got["1-D pool"], got
        assert "interpolate of a (B, C, L) input (1-D)" in got["1-D interpolate"], got
