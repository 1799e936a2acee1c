"""Communication hidden behind compute: the overlapped convolution (halo in flight while the
interior rows are computed, forward and backward) against serial torch and against the
blocking path, and the bucketed gradient sync started from gradient hooks against the blocking
sync and serial gradients. float64, uneven bands (13 rows), every rank position."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpidp
from mpidp.comm.timing import HALO_WAIT
from mpidp.testing import assert_matches_serial

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
F64 = torch.float64


def rand(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=F64)


@contextlib.contextmanager
def overlap(manager, on=True):
    was, manager.overlap = manager.overlap, on
    try:
        yield
    finally:
        manager.overlap = was


def _run(manager, dist, x, g, on):
    """This rank's output, input gradient and parameter gradients, with the overlap on or off."""
    for p in dist.parameters():
        p.grad = None
    xd = x.clone().requires_grad_()
    with overlap(manager, on):
        y = dist(xd)
        (y * g).sum().backward()
    return [y.detach(), xd.grad, *(p.grad for p in dist.parameters())]


def _worst(a, b):
    if not b.numel():
        return 0.0
    scale = max(float(b.abs().max()), 1e-300)
    return float((a - b).abs().max()) / scale


# (kernel, stride, padding, dilation, padding_mode, groups): a 3x3 conv, strides, dilation with
# an asymmetric 'same', each padding mode (the W dim padded as torch pads it), groups
CONVS = [
    (3, 1, 1, 1, "zeros", 1),
    (3, 2, 1, 1, "circular", 1),
    (4, 1, "same", 2, "reflect", 1),
    (5, 1, 2, 1, "replicate", 2),
    ((5, 3), (3, 2), (2, 1), (2, 1), "zeros", 1),
]


@pytest.mark.parametrize("geometry", CONVS, ids=str)
def test_overlapped_conv(manager, geometry):
    """Serial torch (forward, input gradient, every parameter gradient) with the overlap on,
    and the blocking path's results to 1e-12; the overlapped path ran (its waits counted)."""
    k, s, p, d, mode, g = geometry
    serial = nn.Conv2d(4, 6, k, s, p, d, groups=g, padding_mode=mode).to(F64)
    dist = mpidp.DomainParallelConv2d.from_module(copy.deepcopy(serial), manager)
    waits = HALO_WAIT.waits
    with overlap(manager):
        assert_matches_serial(
            serial, dist, [rand((2, 4, 13, 9), 1)], manager=manager, modules=(serial, dist)
        )
    ran = HALO_WAIT.waits > waits
    r = manager.domain_rank
    spec = manager.spec(13)
    x = rand((2, 4, 13, 9), 2).narrow(-2, spec.start(r), spec.sizes[r])
    y = dist(x)
    g_out = rand(tuple(y.shape), 3)
    on = _run(manager, dist, x, g_out, True)
    off = _run(manager, dist, x, g_out, False)
    worst = max(_worst(a, b) for a, b in zip(on, off, strict=True))
    assert worst <= 1e-12, f"overlapped vs blocking: {worst:.2e}"
    # the overlapped path ran, except where a rank has no output rows (the blocking one then)
    rows = serial(rand((2, 4, 13, 9), 1)).size(-2)
    assert ran == (WORLD > 1 and min(manager.partition.derived(rows, WORLD).sizes) > 0)


def test_converted_conv_stack(manager):
    """A converted model (its forward on ShardedTensors) with the overlap on: serial torch."""
    serial = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular"),
    ).to(F64)
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager)
    waits = HALO_WAIT.waits
    with overlap(manager):
        assert_matches_serial(
            serial, dist, [rand((1, 3, 13, 8), 4)], manager=manager, modules=(serial, dist)
        )
    # two convs, a wait in the forward and one in the backward each (the input needs a gradient)
    assert HALO_WAIT.waits - waits == (4 if WORLD > 1 else 0)


# dp > 1 at every rank count above 1 (the whole world as dp): an average over dp that became a
# sum would pass with dp = 1
SYNC_DOMAINS = [WORLD, 1] if WORLD > 1 else [1]


@pytest.mark.parametrize("domain", SYNC_DOMAINS, ids=lambda d: f"domain{d}")
def test_gradient_sync_overlapping_the_backward(manager, domain):
    """GradientSync (buckets of one or two parameters, started from the hooks; the convs'
    overlap on) gives the blocking sync's gradients and the serial ones, twice in a row (its
    state is reset by wait) with a blocking step between (its hooks paused)."""
    with contextlib.ExitStack() as stack:
        if domain != WORLD:
            manager = stack.enter_context(mpidp.DistributedManager(domain_parallel_size=domain))
        stack.enter_context(overlap(manager))
        worst = _sync_errors(manager)
    assert max(worst) <= 1e-12, worst


def _sync_errors(manager):
    """This rank's largest relative gap: GradientSync against serial, against the blocking
    sync, and a second GradientSync step against the first; gathered over the world."""
    torch.manual_seed(0)
    p, dp = manager.domain_world_size, manager.dp_world_size
    serial = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.GroupNorm(1, 3), nn.Conv2d(3, 2, 3, padding=1)
    ).to(F64)
    batch = rand((2 * dp, 2, 2 * p + 3, 6), 4)
    mpidp.broadcast_parameters(serial, manager)
    dist = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager)
    serial(batch).square().mean().backward()
    spec = manager.spec(batch.size(-2))
    mine = batch.narrow(0, 2 * manager.dp_rank, 2)
    mine = mine.narrow(-2, spec.start(manager.domain_rank), spec.sizes[manager.domain_rank])
    sync = mpidp.GradientSync(dist, manager, bucket_bytes=200)

    def step(blocking):
        for q in dist.parameters():
            q.grad = None
        sync.pause(blocking)
        mpidp.global_mean(dist(mine).square(), manager=manager).backward()
        if blocking:
            mpidp.sync_gradients(dist, manager)
        else:  # every parameter has a gradient: the hooks started every bucket
            started.append(sync.started)
            sync.wait()
        return [q.grad.clone() for q in dist.parameters()]

    started = []
    first, blocking, second = step(False), step(True), step(False)
    sync.remove()
    # several buckets, every one started by the hooks (else the gap is reported infinite)
    hooked = len(sync.buckets) > 2 and started == [len(sync.buckets)] * 2
    want = [q.grad for q in serial.parameters()]
    worst = [
        max(_worst(a, b) for a, b in zip(got, ref, strict=True))
        for got, ref in ((first, want), (first, blocking), (second, first))
    ]
    return manager.transport("world").all_gather_object(max(worst) if hooked else float("inf"))
