"""The per-call fast paths keep every check (issue 47): a call whose key was seen and agreed
before, met on another rank by a call with another key, still fails on every rank; the
element-wise fast path of ShardedTensor dispatch gives what the general path gives; and a
converted conv that learns its partition in its halo's agreement (no all-gather of its own)
computes what the serial conv computes, on the policy's partition and on another."""

from __future__ import annotations

import copy
import re

import pytest
import test_halo as th  # its cases and reference (a module: pytest collects nothing from it)
import torch
from mpi4py import MPI

import mpidp
from mpidp.comm.mpi import MPITransport
from mpidp.errors import CommError, ConfigError
from mpidp.runtime.partition import ShardSpec
from mpidp.testing import serial_halo

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()


def rand(shape, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _twice(call):
    """The call's key seen and agreed (its facts and plan kept) before the mismatch."""
    call()
    call()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("with_spec", [False, True], ids=["learned", "spec"])
def test_halo_other_key_on_one_rank_after_a_kept_one_fails_everywhere(t, with_spec):
    """Rank 0 repeats a call it has made (and kept) before; rank 1 passes another width,
    boundary or dtype: every rank raises the same CommError, none waits."""
    spec = ShardSpec.balanced(4 * t.size, t.size)
    x = rand((2, spec.sizes[t.rank], 6), 1)
    s = spec if with_spec else None
    _twice(lambda: mpidp.halo_exchange(x, 1, 1, 1, s, group=t))
    other = t.rank == 1
    with pytest.raises(CommError, match=r"rank 1: before=.* but rank 0 passed"):
        mpidp.halo_exchange(x, 2 if other else 1, 1, 1, s, group=t)
    with pytest.raises(CommError, match=r"rank 1: boundary=.* but rank 0 passed"):
        mpidp.halo_exchange(x, 1, 1, 1, s, boundary="reflect" if other else "zeros", group=t)
    with pytest.raises(CommError, match=r"rank 1: dtype=.* but rank 0 passed"):
        mpidp.halo_exchange(x.float() if other else x, 1, 1, 1, s, group=t)
    # both keys kept before: each rank repeats a call it has made, but not the same one
    _twice(lambda: mpidp.halo_exchange(x, 2, 1, 1, s, group=t))
    with pytest.raises(CommError, match=r"rank 1: before=.* but rank 0 passed"):
        mpidp.halo_exchange(x, 2 if other else 1, 1, 1, s, group=t)
    # and the kept call still runs
    mpidp.halo_exchange(x, 1, 1, 1, s, group=t)


@pytest.mark.mpi(min_size=2)
def test_halo_wrong_shard_after_a_kept_call_fails_everywhere(t):
    """The same arguments as a kept call, but the last rank's band has a row too many."""
    p, me = t.size, t.rank
    spec = ShardSpec.balanced(4 * p, p)
    _twice(lambda: mpidp.halo_exchange(rand((2, spec.sizes[me], 6), 2), 1, 1, 1, spec, group=t))
    rows = spec.sizes[me] + (1 if me == p - 1 else 0)
    with pytest.raises(CommError, match=f"rank {p - 1}: tensor of shape"):
        mpidp.halo_exchange(rand((2, rows, 6), 2), 1, 1, 1, spec, group=t)


@pytest.mark.mpi(min_size=2)
def test_all_gather_v_other_sizes_after_a_kept_call_fail_everywhere(t):
    """all_gather_v keeps a call's facts by its key; another key on one rank still fails on
    every rank before any data moves."""
    sizes = [3] * t.size
    x = rand((3, 4), 3)
    _twice(lambda: mpidp.all_gather_v(x, sizes, 0, t))
    if t.rank == 1:
        sizes = [3] * (t.size - 1) + [4]
        x = rand((4 if t.size == 2 else 3, 4), 3)
    with pytest.raises(CommError):
        mpidp.all_gather_v(x, sizes, 0, t)


@pytest.mark.mpi(min_size=2)
def test_all_gather_v_disagreements_fail_everywhere(manager):
    """On two ranks the agreement rides in all_gather_v's messages (a header beside the rows):
    after a kept call, rank 1 passing another dtype of the same width (the rows' length
    agrees), another row shape (its rows are longer: a truncated receive), a block too large
    for its own size (its own check fails), or fewer rows for itself, fails on every rank
    with every rank's arguments; the kept call runs after each. On more ranks the check
    all-reduce does the same."""
    t = MPITransport(manager.domain_comm)
    sizes = [3] * t.size
    x = rand((3, 4), 10, torch.float32)
    full = torch.cat([rand((3, 4), 10, torch.float32)] * t.size)
    other = t.rank == 1
    cases = [
        (x.view(torch.int32) if other else x, sizes, r"different arguments.*int32"),
        (rand((3, 5), 10, torch.float32) if other else x, sizes, r"different arguments"),
        (
            rand((4, 4), 10, torch.float32) if other else x,
            sizes,
            r"rank 1 of \d+: tensor of shape \(4, 4\)",
        ),
        (x[:2] if other else x, [3, 2, *sizes[2:]] if other else sizes, r"rank 0: .*rank 1: "),
    ]
    problems = []
    for case, (part, want_sizes, match) in enumerate(cases):
        t.all_gather_v(x, sizes)
        try:
            t.all_gather_v(part, want_sizes)
            problems.append(f"case {case}: no error")
        except CommError as err:
            if not re.search(match, str(err)):
                problems.append(f"case {case}: {err}")
        if not torch.equal(t.all_gather_v(x, sizes), full):
            problems.append(f"case {case}: the kept call differs after")
    everyone = t.all_gather_object(problems)
    assert not any(everyone), everyone


def test_elementwise_fast_path_matches_the_general_path(manager):
    """Same-layout ShardedTensors (and Python numbers) take the fast path; its results, in
    place included, equal the plain ones; mixed layouts still take the general path."""
    a, b = rand((2, 3, 7, 4), 4), rand((2, 3, 7, 4), 5)
    sa, sb = mpidp.shard(a, manager=manager), mpidp.shard(b, manager=manager)
    for got, want in (
        (torch.add(sa, sb), a + b),
        (sa * 2.0 - sb, a * 2.0 - b),
        (torch.mul(sa, sb).float(), (a * b).float()),
        (sa + b, a + b),  # a plain tensor of the global shape: the general path
        (torch.maximum(sa, sb[:, :, :, :1]), torch.maximum(a, b[:, :, :, :1])),
    ):
        assert isinstance(got, type(sa)) and got.spec == sa.spec
        torch.testing.assert_close(got.full_tensor(), want)
    other = mpidp.shard(b, manager=manager, spec=ShardSpec.from_sizes([7] + [0] * (WORLD - 1)))
    torch.testing.assert_close((sa + other).full_tensor(), a + b)
    c = sa.clone()
    assert c.add_(sb) is c
    torch.testing.assert_close(c.full_tensor(), a + b)
    g = a.clone().requires_grad_()
    sg = mpidp.shard(g, manager=manager)
    (sg * sb).sum().backward()  # x.grad holds this rank's rows of the gradient
    start, rows = sa.spec.start(manager.domain_rank), sa.spec.sizes[manager.domain_rank]
    torch.testing.assert_close(g.grad.narrow(-2, start, rows), b.narrow(-2, start, rows))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("spec_name", list(th.specs(WORLD)))
@pytest.mark.parametrize("boundary", th.BOUNDARIES, ids=str)
def test_learned_partition_matches_serial_reference(manager, spec_name, boundary):
    """spec=None over MPI (the agreement beside the neighbours' rows): every width case of
    tests/mpi/test_halo.py, forward (extended band and strips) and backward against the serial
    reference, twice (the second call takes the kept facts); unservable widths refused on every
    rank."""
    t = MPITransport(manager.domain_comm)
    spec, b = th.specs(t.size)[spec_name], boundary
    p, me = t.size, t.rank
    full = th.field(spec, -2, 1)
    problems = []
    for case, (wb, wa) in enumerate([*th.widths(p), th.inner(spec)]):
        before, after = th.per_rank(wb, p), th.per_rank(wa, p)
        band = full.narrow(-2, spec.start(me), spec.sizes[me])
        if not th.valid(spec, before, after, boundary):
            with pytest.raises(ConfigError, match=th.WIDTH_ERROR):
                mpidp.halo_exchange(band, wb, wa, boundary=boundary, group=t)
            continue
        lo, hi = spec.start(me) - before[me], spec.stop(me) + after[me]
        want = serial_halo(full, lo, hi, -2, boundary)
        for _ in range(2):
            x = band.clone().requires_grad_()
            out = mpidp.halo_exchange(x, wb, wa, boundary=boundary, group=t)
            if not torch.equal(out, want):
                problems.append(f"case {case} ({wb}, {wa}): forward differs")
            with torch.no_grad():  # the kept concatenation, without autograd
                if not torch.equal(mpidp.halo_exchange(x, wb, wa, boundary=b, group=t), want):
                    problems.append(f"case {case} ({wb}, {wa}): no-grad forward differs")
            g = rand(out.shape, 50 + case)
            out.backward(g)
            ref = full.clone().requires_grad_()
            seeds = t.all_gather_object((lo, hi, g))
            total = sum((serial_halo(ref, a, b, -2, boundary) * gr).sum() for a, b, gr in seeds)
            total.backward()
            got = mpidp.all_gather_v(x.grad, spec, -2, group=t)
            if not torch.allclose(got, ref.grad, rtol=1e-14, atol=1e-14):
                problems.append(f"case {case} ({wb}, {wa}): grad differs")
        if min(before + after) >= 0:
            low, high = mpidp.halo_strips(band, wb, wa, boundary=boundary, group=t)
            cut = want.size(-2) - after[me]
            if not (
                torch.equal(low, want[..., : before[me], :])
                and torch.equal(high, want[..., cut:, :])
            ):
                problems.append(f"case {case} ({wb}, {wa}): strips differ")
    everyone = t.all_gather_object(problems)
    assert not any(everyone), everyone


@pytest.mark.mpi(min_size=2)
def test_conv_learning_its_partition_in_the_halo_matches_serial(manager):
    """A stride-1 'same' conv on bands of unknown partition: on the policy's partition its
    first halo is the one it needs; on another (rank 0 one row short) every rank learns so in
    the agreement and fetches the right halo. Forward, input and parameter gradients against
    the serial conv, each call made twice (the second takes what was kept)."""
    p, me = WORLD, manager.domain_rank
    torch.manual_seed(0)
    serial = torch.nn.Conv2d(2, 3, (3, 5), padding=(2, 2), dilation=(2, 1), dtype=torch.float64)
    conv = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), manager)
    h = 4 * p + 1
    full = rand((2, 2, h, 6), 7)
    ref = full.clone().requires_grad_()
    want = serial(ref)
    want.backward(torch.ones_like(want))
    problems = []
    for spec in (
        manager.spec(h),
        ShardSpec.from_sizes([3] + [4] * (p - 2) + [h - 3 - 4 * (p - 2)]),
    ):
        out_spec = manager.spec(h)
        for _ in range(2):
            x = full.narrow(-2, spec.start(me), spec.sizes[me]).clone().requires_grad_()
            conv.zero_grad()
            y = conv(x)
            y.backward(torch.ones_like(y))
            mpidp.sync_gradients(conv, manager)
            rows = want.narrow(-2, out_spec.start(me), out_spec.sizes[me])
            grad = ref.grad.narrow(-2, spec.start(me), spec.sizes[me])
            if not torch.allclose(y, rows, rtol=1e-10, atol=1e-12):
                problems.append(f"{spec}: forward differs")
            if not torch.allclose(x.grad, grad, rtol=1e-10, atol=1e-12):
                problems.append(f"{spec}: input gradient differs")
            for name, param in conv.named_parameters():
                ser = dict(serial.named_parameters())[name].grad
                if not torch.allclose(param.grad, ser, rtol=1e-10, atol=1e-12):
                    problems.append(f"{spec}: {name} gradient differs")
    everyone = MPI.COMM_WORLD.allgather(problems)
    assert not any(everyone), everyone


@pytest.mark.mpi(min_size=2)
def test_conv_other_channels_on_one_rank_after_a_kept_call_fail_everywhere(manager):
    """The conv's halo kept its call; rank 1 then passes a band of another channel count:
    the halo's agreement fails on every rank (none waits for the others)."""
    conv = mpidp.convert_to_domain_parallel(torch.nn.Conv2d(2, 2, 3, padding=1), manager)
    n = manager.spec(4 * WORLD).sizes[manager.domain_rank]
    _twice(lambda: conv(rand((1, 2, n, 5), 8, torch.float32)))
    x = rand((1, 3 if manager.domain_rank == 1 else 2, n, 5), 8, torch.float32)
    with pytest.raises(CommError, match=r"rank 1: shape without dim=.* but rank 0 passed"):
        conv(x)


@pytest.mark.mpi(min_size=2)
def test_halo_problem_on_one_rank_after_a_kept_call_fails_everywhere(t):
    """The learned-partition path (on two ranks its agreement is the neighbour messages'
    headers): a rank whose own check fails (a dim out of range), or whose band has another
    shape, after a kept call, fails on every rank, and the kept call runs again after."""
    x = rand((2, 3 + t.rank % 2, 6), 9)
    _twice(lambda: mpidp.halo_exchange(x, 1, 1, 1, group=t))
    other = t.rank == t.size - 1
    with pytest.raises(CommError, match=rf"rank {t.size - 1}: dim 5 is out of range"):
        mpidp.halo_exchange(x, 1, 1, 5 if other else 1, group=t)
    wide = rand((2, x.size(1), 7), 9) if other else x
    with pytest.raises(CommError, match=rf"rank {t.size - 1}: shape without dim=.* but rank 0"):
        mpidp.halo_exchange(wide, 1, 1, 1, group=t)
    assert mpidp.halo_exchange(x, 1, 1, 1, group=t).size(1) == x.size(1) + 2
