"""Domain-parallel layers against their torch modules: output, input gradient, every parameter
gradient, float64, uneven partitions, every rank position (the oracle gathers all ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import gradcheck_global
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.ops.halo_plan import plan
from mpidp.testing import assert_matches_serial, count_traffic, halo_traffic

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
F64 = torch.float64


def rand(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=F64)


def check(manager, serial, wrapper, shape, shard_dim=-2, seed=0):
    serial = serial.to(F64)
    dist = wrapper.from_module(copy.deepcopy(serial), manager, shard_dim)
    assert_matches_serial(
        serial, dist, [rand(shape, seed)], manager=manager, dim=shard_dim, modules=(serial, dist)
    )


# (kernel, stride, padding, dilation, padding_mode, groups, bias)
CONV2D = [
    (3, 1, 1, 1, "zeros", 1, True),
    (1, 1, 0, 1, "zeros", 1, True),
    (2, 1, "same", 1, "zeros", 1, False),
    (4, 1, "same", 2, "reflect", 1, True),
    (5, 1, 2, 1, "replicate", 2, True),
    (3, 2, 1, 1, "zeros", 1, True),
    (3, 2, 1, 1, "circular", 1, True),
    (4, 2, 1, 1, "reflect", 2, False),
    (5, 3, 2, 2, "zeros", 1, True),
    (3, 3, 0, 1, "zeros", 1, True),
    (2, 2, 0, 1, "zeros", 1, True),
    (5, 1, "valid", 1, "zeros", 1, True),
    (3, 1, 2, 2, "circular", 2, True),
    ((3, 5), (2, 1), (1, 2), (1, 1), "replicate", 1, True),
    ((5, 3), (1, 2), (2, 1), (2, 1), "reflect", 1, True),
]


@pytest.mark.parametrize("geometry", CONV2D, ids=str)
@pytest.mark.parametrize("h", [13, 37])
def test_conv2d(manager, geometry, h):
    k, s, p, d, mode, g, bias = geometry
    conv = nn.Conv2d(4, 6, k, s, p, d, groups=g, bias=bias, padding_mode=mode)
    # fewer output rows than ranks (13 rows, stride 2, dilation 2 at 4 ranks): the last ranks'
    # bands are empty, the policy's rule for lengths a model derives
    check(manager, conv, mpidp.DomainParallelConv2d, (2, 4, h, 10))


@pytest.mark.parametrize(
    "geometry",
    [
        (3, 1, 1, 1, "zeros"),
        (5, 2, 2, 1, "circular"),
        (4, 3, "valid", 2, "zeros"),
        (3, 1, "same", 2, "reflect"),
    ],
    ids=str,
)
def test_conv1d_along_its_length(manager, geometry):
    k, s, p, d, mode = geometry
    conv = nn.Conv1d(3, 5, k, s, p, d, padding_mode=mode)
    check(manager, conv, mpidp.DomainParallelConv1d, (2, 3, 29), shard_dim=-1)


@pytest.mark.parametrize(
    "geometry",
    [
        (3, 1, 1, 1, "zeros"),
        ((3, 5, 3), (1, 2, 2), (1, 2, 0), 1, "zeros"),
        (3, 1, 1, 1, "replicate"),
    ],
    ids=str,
)
def test_conv3d_along_h(manager, geometry):
    k, s, p, d, mode = geometry
    conv = nn.Conv3d(2, 3, k, s, p, d, padding_mode=mode)
    check(manager, conv, mpidp.DomainParallelConv3d, (1, 2, 4, 17, 6))


# (kernel, stride, padding, output_padding, dilation, groups)
CONV_T = [
    (2, 2, 0, 0, 1, 1),
    (3, 2, 1, 1, 1, 1),
    (4, 2, 1, 0, 1, 2),
    (3, 1, 1, 0, 1, 1),
    (1, 3, 0, 2, 1, 1),
    (5, 3, 2, 1, 2, 1),
    (3, 2, 0, 1, 2, 1),
    (4, 4, 0, 0, 1, 1),
    ((3, 2), (2, 1), (1, 0), (1, 0), (1, 1), 1),
]


@pytest.mark.parametrize("geometry", CONV_T, ids=str)
@pytest.mark.parametrize("h", [13, 19])
def test_conv_transpose2d(manager, geometry, h):
    k, s, p, op, d, g = geometry
    conv = nn.ConvTranspose2d(4, 6, k, s, p, op, groups=g, dilation=d)
    check(manager, conv, mpidp.DomainParallelConvTranspose2d, (2, 4, h, 7))


def test_conv_transpose3d_and_1d(manager):
    conv3 = nn.ConvTranspose3d(2, 3, 3, (1, 2, 2), 1, (0, 1, 1))
    check(manager, conv3, mpidp.DomainParallelConvTranspose3d, (1, 2, 3, 11, 5))
    conv1 = nn.ConvTranspose1d(2, 3, 4, 2, 1)
    check(manager, conv1, mpidp.DomainParallelConvTranspose1d, (2, 2, 15), shard_dim=-1)


def test_thin_shards_multi_hop(manager):
    """A 7-row kernel over shards of 2-3 rows: the halo comes from two ranks away."""
    conv = nn.Conv2d(2, 2, 7, 1, 3, padding_mode="reflect")
    check(manager, conv, mpidp.DomainParallelConv2d, (1, 2, 2 * WORLD + 3, 5))


def test_state_dict_keys_unchanged(manager):
    conv = nn.ConvTranspose2d(2, 3, 3, 2, 1).to(F64)
    dist = mpidp.DomainParallelConvTranspose2d.from_module(copy.deepcopy(conv), manager)
    assert list(dist.state_dict()) == list(conv.state_dict())
    assert isinstance(dist, nn.ConvTranspose2d)


# -- normalisations: statistics over the whole field ------------------------------------------


def check_buffers(manager, serial, dist):
    """Running statistics after the step equal the serial ones on every rank."""
    t = manager.transport()
    bad = [
        name
        for name, buf in dist.named_buffers()
        if not torch.allclose(
            buf.double(), dict(serial.named_buffers())[name].double(), 1e-12, 1e-13
        )
    ]
    everyone = t.all_gather_object(bad)
    assert not any(everyone), f"buffers differ: {everyone}"


def check_norm(manager, serial, wrapper, shape, h_dim=-2, seed=0, train=True):
    serial = serial.to(F64).train(train)
    dist = wrapper.from_module(copy.deepcopy(serial), manager, h_dim)
    assert_matches_serial(
        serial, dist, [rand(shape, seed)], manager=manager, dim=h_dim, modules=(serial, dist)
    )
    check_buffers(manager, serial, dist)


@pytest.mark.parametrize(("groups", "affine"), [(1, True), (2, True), (6, False), (3, True)])
@pytest.mark.parametrize("h", [13, 37])
def test_group_norm(manager, groups, affine, h):
    norm = nn.GroupNorm(groups, 6, affine=affine)
    if affine:  # not the identity initialisation: the affine gradients must show
        with torch.no_grad():
            norm.weight.copy_(rand((6,), 1))
            norm.bias.copy_(rand((6,), 2))
    check_norm(manager, norm, mpidp.DomainParallelGroupNorm, (2, 6, h, 5), seed=h)


def test_group_norm_5d_and_large_mean(manager):
    """5-D input, and a field far from zero: sum-of-squares statistics would lose 4 digits
    there (the offset is small enough that the input itself keeps 1e-14)."""
    norm = nn.GroupNorm(2, 4)
    serial = norm.to(F64)
    dist = mpidp.DomainParallelGroupNorm.from_module(copy.deepcopy(serial), manager)
    x = rand((2, 4, 3, 2 * WORLD + 1, 4), 3) + 1e2
    assert_matches_serial(serial, dist, [x], manager=manager, modules=(serial, dist))


@pytest.mark.parametrize(
    ("affine", "track", "train"),
    [(True, False, True), (False, True, True), (True, True, False)],
)
def test_instance_norm(manager, affine, track, train):
    norm = nn.InstanceNorm2d(3, affine=affine, track_running_stats=track)
    if track:
        with torch.no_grad():
            norm.running_mean.copy_(rand((3,), 4))
            norm.running_var.copy_(rand((3,), 5).abs())
    check_norm(manager, norm, mpidp.DomainParallelInstanceNorm2d, (2, 3, 19, 6), train=train)


def test_instance_norm3d(manager):
    norm = nn.InstanceNorm3d(2, affine=True)
    check_norm(manager, norm, mpidp.DomainParallelInstanceNorm3d, (2, 2, 3, 17, 4))


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("train", [True, False])
def test_batch_norm(manager, momentum, train):
    norm = nn.BatchNorm2d(3, momentum=momentum)
    with torch.no_grad():
        norm.weight.copy_(rand((3,), 6))
        norm.running_var.copy_(rand((3,), 7).abs())
    check_norm(manager, norm, mpidp.DomainParallelBatchNorm2d, (3, 3, 23, 5), train=train)


def test_batch_norm3d_without_running_stats(manager):
    norm = nn.BatchNorm3d(2, track_running_stats=False)
    check_norm(manager, norm, mpidp.DomainParallelBatchNorm3d, (2, 2, 3, 13, 4), train=False)


def test_thin_and_empty_shards_norm(manager):
    """Statistics weighted by counts: 1-row shards and a partition with an empty shard."""
    norm = nn.GroupNorm(2, 4).to(F64)
    dist = mpidp.DomainParallelGroupNorm.from_module(copy.deepcopy(norm), manager)
    for sizes in ([1] * WORLD, [0] + [2] * (WORLD - 1) if WORLD > 1 else [3]):
        x = rand((2, 4, sum(sizes), 3), 8)
        assert_matches_serial(
            norm, dist, [x], manager=manager, sizes=sizes, out_sizes=sizes, modules=(norm, dist)
        )


@pytest.mark.parametrize("kind", ["group", "instance"])
def test_norm_gradcheck(manager, kind):
    """The fused norm Function's Jacobian (gradcheck: its four-pass backward and the
    all-reduce of the cross-rank sums) and its create_graph path (gradgradcheck), on an uneven
    cut with a 1-row shard, communication included."""
    norm = nn.GroupNorm(2, 4) if kind == "group" else nn.InstanceNorm2d(4, affine=True)
    norm = norm.to(F64)
    with torch.no_grad():
        norm.weight.copy_(rand((4,), 14))
        norm.bias.copy_(rand((4,), 15))
    wrapper = (
        mpidp.DomainParallelGroupNorm if kind == "group" else mpidp.DomainParallelInstanceNorm2d
    )
    dist = wrapper.from_module(norm, manager)
    shapes = [(1, 4, 1 if r == 0 else r + 1, 2) for r in range(WORLD)]
    gradcheck_global(manager.transport(), shapes, dist)


# -- interpolation ------------------------------------------------------------------------------

INTERP = [
    ("nearest", None, None, 2),
    ("nearest", None, (23, 9), None),
    ("nearest", None, None, (1.7, 0.6)),
    ("bilinear", False, None, 2),
    ("bilinear", True, None, 2),
    ("bilinear", False, (29, 11), None),
    ("bilinear", True, (7, 5), None),
    ("bilinear", False, None, (0.5, 1.5)),
    ("bicubic", False, None, 2),
    ("bicubic", True, (31, 7), None),
    ("bicubic", False, None, (2.5, 0.75)),
]


@pytest.mark.parametrize(("mode", "align", "size", "scale"), INTERP, ids=str)
@pytest.mark.parametrize("h", [13, 19])
def test_interpolate(manager, mode, align, size, scale, h):
    up = nn.Upsample(size=size, scale_factor=scale, mode=mode, align_corners=align)
    check(manager, up, mpidp.DomainParallelInterpolate, (2, 3, h, 6))


# -- pooling ------------------------------------------------------------------------------------

POOLS = [
    (nn.MaxPool2d, dict(kernel_size=2)),
    (nn.MaxPool2d, dict(kernel_size=3, stride=2, padding=1)),
    (nn.MaxPool2d, dict(kernel_size=(3, 2), stride=(1, 2), padding=(1, 0), dilation=(2, 1))),
    (nn.MaxPool2d, dict(kernel_size=5, stride=3, padding=2)),
    (nn.AvgPool2d, dict(kernel_size=2)),
    (nn.AvgPool2d, dict(kernel_size=3, stride=2, padding=1)),
    (nn.AvgPool2d, dict(kernel_size=3, stride=1, padding=1, count_include_pad=False)),
    (nn.AvgPool2d, dict(kernel_size=(5, 3), stride=(2, 1), padding=(2, 1), divisor_override=4)),
]
WRAP = {nn.MaxPool2d: mpidp.DomainParallelMaxPool2d, nn.AvgPool2d: mpidp.DomainParallelAvgPool2d}


@pytest.mark.parametrize(("cls", "kwargs"), POOLS, ids=str)
@pytest.mark.parametrize("h", [13, 37])
def test_pool(manager, cls, kwargs, h):
    check(manager, cls(**kwargs), WRAP[cls], (2, 3, h, 8))


@pytest.mark.parametrize("size", [(7, 3), (5, None), (37, 4), 4])
def test_adaptive_avg_pool(manager, size):
    check(manager, nn.AdaptiveAvgPool2d(size), mpidp.DomainParallelAdaptiveAvgPool2d, (2, 3, 37, 9))


# -- periodic convolution on the sphere --------------------------------------------------------


@pytest.mark.parametrize("pole", ["reflect", "polar", "polar_half"])
@pytest.mark.parametrize(("k", "s", "d"), [(3, 1, 1), (5, 2, 1), (3, 1, 2)])
def test_periodic_conv(manager, pole, k, s, d):
    conv = mpidp.PeriodicConv2d(3, 4, k, s, dilation=d, pole=pole)
    check(manager, conv, mpidp.DomainParallelPeriodicConv2d, (2, 3, 2 * WORLD + 9, 8))


def test_periodic_conv_serial_is_what_it_says():
    """The serial module itself: circular in W, and across the pole the rolled mirror row."""
    conv = mpidp.PeriodicConv2d(1, 1, 3, pole="polar", bias=False).to(F64)
    with torch.no_grad():
        conv.weight.zero_()
        conv.weight[0, 0, 0, 1] = 1.0  # output row i, column j = input row i - 1, column j
    x = rand((1, 1, 5, 8), 9)
    y = conv(x)
    assert torch.equal(y[0, 0, 1:], x[0, 0, :-1])
    assert torch.equal(y[0, 0, 0], x[0, 0, 1].roll(4, 0))  # row -1 is row 1, half way round


@pytest.mark.parametrize(
    ("shape", "affine", "bias"),
    [((13, 6), True, True), ((3, 13, 6), True, False), ((13, 6), False, False)],
)
def test_layer_norm_over_the_sharded_dim(manager, shape, affine, bias):
    norm = nn.LayerNorm(shape, elementwise_affine=affine, bias=bias)
    if affine:
        with torch.no_grad():
            norm.weight.copy_(rand(shape, 10))
            if bias:
                norm.bias.copy_(rand(shape, 11))
    check(manager, norm, mpidp.DomainParallelLayerNorm, (2, 3, 13, 6))


def test_layer_norm_over_the_last_dim_is_left_alone(manager):
    model = mpidp.convert_to_domain_parallel(nn.Sequential(nn.LayerNorm(6)), manager)
    assert type(model[0]) is nn.LayerNorm


@pytest.mark.parametrize("sizes", ["balanced", "thin"])
def test_conv_sends_what_its_halo_plan_says(manager, sizes):
    """Bytes and messages at the transport, forward and backward, equal the halo plan's: no
    gathering, no extra rows; the only collectives are the two 1-int agreements."""
    h = 2 * WORLD + 3 if sizes == "thin" else 37
    conv = nn.Conv2d(3, 2, 5, 1, 2, padding_mode="reflect").to(F64)
    dist = mpidp.DomainParallelConv2d.from_module(copy.deepcopy(conv), manager)
    spec = manager.spec(h)
    me = manager.domain_rank
    x = rand((2, 3, h, 6), 1).narrow(-2, spec.start(me), spec.sizes[me]).requires_grad_()
    with count_traffic(manager) as traffic:
        dist(x).sum().backward()
    halo = mpidp.HaloSpec.for_layer(spec, spec, 5, 1, (2, 2), 1)
    pl = plan(spec.sizes, halo.before, halo.after, mpidp.Boundary.of("reflect"), me)
    want = halo_traffic(pl, 2 * 3 * 6 * 8)
    if WORLD > 1:
        want["all_gather_ints"] = [2, 8 + 24]
    got = {op: v for op, v in traffic.ops.items() if v != [0, 0]}
    everyone = manager.transport().all_gather_object(got == want or f"{got} != plan {want}")
    assert all(v is True for v in everyone), everyone


# -- a partition axis and a dtype axis over one layer of every family --------------------------

# name -> (serial module factory, wrapper, input shape, keeps its input's partition)
FAMILIES = {
    "conv3x3": (lambda: nn.Conv2d(3, 4, 3, 1, 1), mpidp.DomainParallelConv2d, False),
    "conv_s2_circular": (
        lambda: nn.Conv2d(3, 4, 3, 2, 1, padding_mode="circular"),
        mpidp.DomainParallelConv2d,
        False,
    ),
    "conv5_dilated_reflect": (
        lambda: nn.Conv2d(3, 2, 5, 1, "same", 2, padding_mode="reflect"),
        mpidp.DomainParallelConv2d,
        False,
    ),
    "conv_transpose_s2": (
        lambda: nn.ConvTranspose2d(3, 2, 3, 2, 1, 1),
        mpidp.DomainParallelConvTranspose2d,
        False,
    ),
    "group_norm": (lambda: nn.GroupNorm(3, 3), mpidp.DomainParallelGroupNorm, True),
    "batch_norm": (lambda: nn.BatchNorm2d(3), mpidp.DomainParallelBatchNorm2d, True),
    "bilinear": (
        lambda: nn.Upsample(scale_factor=2, mode="bilinear"),
        mpidp.DomainParallelInterpolate,
        False,
    ),
    "bicubic_size": (
        lambda: nn.Upsample(size=(31, 7), mode="bicubic", align_corners=True),
        mpidp.DomainParallelInterpolate,
        False,
    ),
    "max_pool": (lambda: nn.MaxPool2d(3, 2, 1), mpidp.DomainParallelMaxPool2d, False),
    "avg_pool": (lambda: nn.AvgPool2d(2), mpidp.DomainParallelAvgPool2d, False),
    "adaptive_avg_pool": (
        lambda: nn.AdaptiveAvgPool2d((7, 3)),
        mpidp.DomainParallelAdaptiveAvgPool2d,
        False,
    ),
    "periodic_polar": (
        lambda: mpidp.PeriodicConv2d(3, 2, 3, pole="polar"),
        mpidp.DomainParallelPeriodicConv2d,
        False,
    ),
}


def cuts(p):
    """Partitions: (policy, input sizes or None for the policy's). Each one differs from the
    balanced cut at this rank count (at one rank there is only one cut)."""
    if p == 1:
        return {"balanced": (mpidp.Balanced(), None)}
    return {
        "balanced": (mpidp.Balanced(), None),
        "weighted": (mpidp.Weighted(tuple(range(p, 0, -1))), None),
        "thin": (mpidp.Weighted((1,) * (p - 1) + (3 * p,)), None),
        "empty_first": (mpidp.Weighted((0,) + (1,) * (p - 1), allow_empty=True), None),
        "skewed_input": (mpidp.Balanced(), lambda h: (1,) * (p - 1) + (h - p + 1,)),
    }


@pytest.fixture(params=list(cuts(WORLD)))
def cut(request, manager):
    """The manager's partition policy for one test, and the input partition."""
    policy, sizes = cuts(WORLD)[request.param]
    old, manager.partition = manager.partition, policy
    yield sizes
    manager.partition = old


def family_check(manager, family, input_sizes, dtype, h=23):
    make, wrapper, keeps = FAMILIES[family]
    torch.manual_seed(7)
    serial = make().to(dtype)
    with torch.no_grad():
        for q in serial.parameters():  # not the identity initialisation of the norms
            q.copy_(rand(q.shape, 12).to(dtype))
    dist = wrapper.from_module(copy.deepcopy(serial), manager)
    sizes = input_sizes(h) if input_sizes is not None else manager.spec(h).sizes
    return assert_matches_serial(
        serial,
        dist,
        [rand((2, 3, h, 8), 13).to(dtype)],
        manager=manager,
        sizes=sizes,
        out_sizes=sizes if keeps else None,
        modules=(serial, dist),
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_partition(manager, family, cut):
    family_check(manager, family, cut, F64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_low_precision(manager, family, dtype):
    family_check(manager, family, None, dtype)
