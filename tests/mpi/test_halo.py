"""Halo exchange against the serial reference on the full field, through both transports.

Forward: every rank's extended band equals :func:`mpidp.testing.serial_halo` (torch.cat, flip
and roll on the whole field; itself checked against F.pad in tests/unit). Backward: the input
gradient, gathered, equals autograd through the serial reference of every rank's range at
once. Then gradcheck of the global function, the adjoint identity, double backward, the
asynchronous form, the module, layer geometry end to end and the errors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import _unchecked, on_transports
from mpi4py import MPI

import mpidp
from mpidp.comm import Transport
from mpidp.comm.counting import CountingTransport
from mpidp.errors import CommError, ConfigError
from mpidp.ops.halo_plan import plan
from mpidp.runtime.partition import ShardSpec
from mpidp.testing import assert_matches_serial, halo_traffic, serial_halo

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
BOUNDARIES = [
    "zeros",
    "replicate",
    "reflect",
    "symmetric",
    "circular",
    "polar",
    "polar_half",
    ("zeros", "polar"),
    "none",
]
# Rows beyond the edge each kind can supply (written out here, apart from the library's).
REACH = {"none": 0, "reflect": -1, "polar": -1, "symmetric": 0, "polar_half": 0, "circular": 0}


# What an unservable width is refused with: the rank, and why.
WIDTH_ERROR = (
    r"^rank \d+: (halo widths .* are wider than|widths .* trim more than|halo .* reaches \d+ "
    r"rows beyond the (low|high) edge)"
)


def rand(shape, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def specs(p):
    out = {
        "13": ShardSpec.balanced(13, p),
        "721": ShardSpec.balanced(721, p),
        "thin": ShardSpec.from_sizes([1] * (p - 1) + [4]),  # 1-row shards, halos of 3: hops
        "ones": ShardSpec.from_sizes([1] * p),
    }
    if p > 1:
        out["empty"] = ShardSpec.from_sizes([0] + [1] * (p - 2) + [4])
    return out


SPECS = list(specs(WORLD))


def widths(p):
    """(before, after): equal, asymmetric, negative (trimming) and different on every rank."""
    return [
        (0, 0),
        (1, 1),
        (3, 3),
        (2, 0),
        (0, 3),
        (-1, 2),
        (3, -1),
        ([(r % 3) - 1 for r in range(p)], [3 - r % 4 for r in range(p)]),
    ]


def inner(spec):
    """Halos of 1 between ranks, none at the global edges ('valid' padding; boundary none)."""
    p, h = spec.parts, spec.total
    return [int(spec.start(r) > 0) for r in range(p)], [int(spec.stop(r) < h) for r in range(p)]


def per_rank(w, p):
    return [w] * p if isinstance(w, int) else list(w)


def valid(spec, before, after, boundary) -> bool:
    """Whether the widths can be served (the rule the library must follow, written apart)."""
    h = spec.total
    b = mpidp.Boundary.of(boundary)
    for r in range(spec.parts):
        lo, hi = spec.start(r) - before[r], spec.stop(r) + after[r]
        if hi < lo:  # wider than the field is fine where the boundary supplies the rows
            return False
        for kind, beyond in ((b.low, -lo), (b.high, hi - h)):
            limit = h + REACH[kind] if kind in REACH else None
            if kind == "none":
                limit = 0
            if beyond > 0 and limit is not None and beyond > limit:
                return False
    return True


def field(spec, dim, seed, w=6):
    shape = [2, 3, 4, w]  # (B, C, H, W) with dim -2 sharded; or dim 0 of a 3-d field below
    if dim == 0:
        shape = [spec.total, 3, w]
    else:
        shape[dim] = spec.total
    return rand(tuple(shape), seed)


def agree(t: Transport, problems: list[str]) -> None:
    everyone = t.all_gather_object(problems)
    lines = [f"rank {r}: {m}" for r, ms in enumerate(everyone) for m in ms]
    assert not lines, "\n".join(lines)


def traffic_problems(traffic, spec, before, after, boundary, full, dim, me) -> list[str]:
    """What a forward and backward halo exchange sent, against its plan, plus one agreement
    all-gather (3 ints) and nothing else."""
    pl = plan(spec.sizes, tuple(before), tuple(after), mpidp.Boundary.of(boundary), me)
    want = halo_traffic(pl, full.numel() // full.size(dim) * full.element_size())
    if spec.parts > 1:
        want["all_gather_ints"] = [1, 24]
    got = {op: v for op, v in traffic.ops.items() if v != [0, 0]}
    return [] if got == want else [f"traffic {got} != plan {want}"]


# -- forward and backward against the serial reference --------------------------------------


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("boundary", BOUNDARIES, ids=str)
@pytest.mark.parametrize("dim", [-2, 0])
def test_matches_serial_reference(t, spec_name, boundary, dim):
    spec = specs(t.size)[spec_name]
    p, me = t.size, t.rank
    full = field(spec, dim, 1)
    problems, served = [], 0
    for case, (wb, wa) in enumerate([*widths(p), inner(spec)]):
        before, after = per_rank(wb, p), per_rank(wa, p)
        if not valid(spec, before, after, boundary):
            with pytest.raises(ConfigError, match=WIDTH_ERROR):
                mpidp.halo_exchange(
                    full.narrow(dim, spec.start(me), spec.sizes[me]),
                    wb,
                    wa,
                    dim,
                    spec,
                    boundary=boundary,
                    group=t,
                )
            continue
        served += 1
        x = full.narrow(dim, spec.start(me), spec.sizes[me]).clone().requires_grad_()
        counted = CountingTransport(t)
        out = mpidp.halo_exchange(x, wb, wa, dim, spec, boundary=boundary, group=counted)
        lo, hi = spec.start(me) - before[me], spec.stop(me) + after[me]
        want = serial_halo(full, lo, hi, dim, boundary)
        if not torch.equal(out, want):
            problems.append(f"case {case} ({wb}, {wa}): forward differs")
        # Backward: rank r seeds its output with g_r; serially, the sum over r of
        # <serial_halo(full)[range r], g_r> has the gradient the gathered one must equal.
        grads = [
            rand(
                serial_halo(
                    full, spec.start(r) - before[r], spec.stop(r) + after[r], dim, boundary
                ).shape,
                100 + 10 * case + r,
            )
            for r in range(p)
        ]
        out.backward(grads[me])
        problems += traffic_problems(counted.traffic, spec, before, after, boundary, full, dim, me)
        if spec_name == "13" and case == len(widths(p)):  # one row to each neighbour, and back
            neighbours = int(me > 0) + int(me < p - 1)
            if counted.traffic.p2p_messages != 2 * neighbours:
                problems.append(f"halo of one row: {counted.traffic}, {neighbours} neighbours")
        ref = full.clone().requires_grad_()
        total = sum(
            (
                serial_halo(ref, spec.start(r) - before[r], spec.stop(r) + after[r], dim, boundary)
                * grads[r]
            ).sum()
            for r in range(p)
        )
        total.backward()
        got = mpidp.all_gather_v(x.grad, spec, dim, group=t)
        if not torch.allclose(got, ref.grad, rtol=1e-14, atol=1e-14):
            problems.append(
                f"case {case} ({wb}, {wa}): grad differs by {(got - ref.grad).abs().max():.3e}"
            )
    agree(t, problems)
    assert served > 0


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("boundary", BOUNDARIES, ids=str)
def test_strips_match_serial_reference(t, spec_name, boundary):
    """halo_strips: the rows beyond the band only, forward and backward."""
    spec = specs(t.size)[spec_name]
    p, me = t.size, t.rank
    full = field(spec, -2, 2)
    ragged = ([r % 3 for r in range(p)], [3 - r % 4 for r in range(p)])
    problems, served = [], 0
    for case, (wb, wa) in enumerate([(1, 1), (3, 3), (2, 0), (0, 3), ragged, inner(spec)]):
        before, after = per_rank(wb, p), per_rank(wa, p)
        if not valid(spec, before, after, boundary):
            continue
        served += 1

        def ranges(r, before=before, after=after):
            s, e = spec.start(r), spec.stop(r)
            return (s - before[r], s), (e, e + after[r])

        x = full.narrow(-2, spec.start(me), spec.sizes[me]).clone().requires_grad_()
        low, high = mpidp.halo_strips(x, wb, wa, spec=spec, boundary=boundary, group=t)
        (a, b), (c, d) = ranges(me)
        if not (
            torch.equal(low, serial_halo(full, a, b, -2, boundary))
            and torch.equal(high, serial_halo(full, c, d, -2, boundary))
        ):
            problems.append(f"case {case}: forward differs")
        seeds = [
            [
                rand(serial_halo(full, lo, hi, -2, boundary).shape, 200 + 10 * r + k)
                for k, (lo, hi) in enumerate(ranges(r))
            ]
            for r in range(p)
        ]
        ((low * seeds[me][0]).sum() + (high * seeds[me][1]).sum()).backward()
        ref = full.clone().requires_grad_()
        total = sum(
            (serial_halo(ref, lo, hi, -2, boundary) * seeds[r][k]).sum()
            for r in range(p)
            for k, (lo, hi) in enumerate(ranges(r))
        )
        total.backward()
        got = mpidp.all_gather_v(x.grad, spec, -2, group=t)
        if not torch.allclose(got, ref.grad, rtol=1e-14, atol=1e-14):
            problems.append(f"case {case}: grad differs by {(got - ref.grad).abs().max():.3e}")
    agree(t, problems)
    assert served > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_and_noncontiguous(t, dtype):
    spec = specs(t.size)["13"]
    full = rand((3, 13, 8), 5, dtype).transpose(0, 2)  # (8, 13, 3), non-contiguous
    x = full.narrow(1, spec.start(t.rank), spec.sizes[t.rank])
    assert not x.is_contiguous()
    out = mpidp.halo_exchange(x, 2, 3, 1, spec, boundary="polar", group=t, roll_dim=0)
    want = serial_halo(full, spec.start(t.rank) - 2, spec.stop(t.rank) + 3, 1, "polar", 0)
    assert out.dtype == dtype
    assert torch.equal(out, want)


def test_spec_learned_from_local_sizes(t):
    """spec=None: one all-gather learns it. Two global sizes that give this rank the same
    local size must not be confused (nothing is cached on the local shape)."""
    me, p = t.rank, t.size
    for n in (4 * p + 1, 4 * p + 2, 4 * p + 1):
        spec = ShardSpec.balanced(n, p)
        full = rand((2, n, 4), n)
        x = full.narrow(1, spec.start(me), spec.sizes[me])
        out = mpidp.halo_exchange(x, 2, 1, 1, boundary="reflect", group=t)
        want = serial_halo(full, spec.start(me) - 2, spec.stop(me) + 1, 1, "reflect")
        assert torch.equal(out, want)


def test_manager_picks_the_domain_group(manager):
    spec = manager.spec(13)
    full = rand((1, 2, 13, 4), 6)
    x = mpidp.shard_tensor(full, manager=manager)
    me = manager.domain_rank
    want = serial_halo(full, spec.start(me) - 1, spec.stop(me) + 1, -2, "circular")
    assert torch.equal(mpidp.halo_exchange(x, 1, 1, boundary="circular", manager=manager), want)
    assert torch.equal(mpidp.halo_exchange(x, 1, 1, boundary="circular", group=manager), want)


# -- gradients: gradcheck of the global function, adjoint identity, double backward ---------


def global_fn(t, spec, f):
    """The distributed map as a function of the full field held by every rank: shard, halo,
    gather every rank's band (replicated downstream). gradcheck perturbs every entry."""

    def g(full):
        x = mpidp.shard_tensor(full, 1, spec=spec, group=t)
        y = f(x)
        sizes = [int(n) for n in t.all_gather_object(y.size(1))]
        return mpidp.all_gather_v_replicated(y, sizes, 1, group=t)

    return g


def inside(spec, before, after):
    """Per-rank widths cut so that no halo reaches beyond the field (for boundary none)."""
    b, a = per_rank(before, spec.parts), per_rank(after, spec.parts)
    return (
        [min(b[r], spec.start(r)) for r in range(spec.parts)],
        [min(a[r], spec.total - spec.stop(r)) for r in range(spec.parts)],
    )


@pytest.mark.parametrize(
    ("t", "boundary", "spec_name"),
    on_transports([(b, s) for b in BOUNDARIES for s in ("uneven", "thin")], [("polar", "thin")]),
    indirect=["t"],
    ids=str,
)
def test_gradcheck(t, boundary, spec_name):
    p = t.size
    spec = {
        "uneven": ShardSpec.balanced(2 * p + 1, p),
        "thin": ShardSpec.from_sizes([1] * (p - 1) + [3]),
    }[spec_name]
    wb, wa = ([min(2, r + 1) for r in range(p)], 2) if spec_name == "thin" else (2, 1)
    if boundary == "none":
        wb, wa = inside(spec, wb, wa)
    f = global_fn(
        t, spec, lambda x: mpidp.halo_exchange(x, wb, wa, 1, spec, None, boundary, group=t)
    )
    full = rand((1, spec.total, 2), 7).requires_grad_()  # small: gradcheck is O(numel^2)
    with _unchecked(t):
        assert torch.autograd.gradcheck(f, (full,), eps=1e-6, atol=1e-8, rtol=1e-6)
    if boundary == "polar" and t.name == "mpi":  # fetch and accumulate: each other's backward
        seeded = rand(tuple(f(full).shape), 8).requires_grad_()  # the same on every rank
        assert torch.autograd.gradgradcheck(f, (full,), (seeded,), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize(
    ("t", "boundary"), on_transports(["polar", "circular"], ["polar"]), indirect=["t"]
)
def test_gradcheck_strips(t, boundary):
    p = t.size
    spec = ShardSpec.from_sizes([1] * (p - 1) + [3])

    def strips(x):
        low, high = mpidp.halo_strips(
            x, 2, [r % 3 for r in range(p)], 1, spec, None, boundary, group=t
        )
        return torch.cat([low, high], 1)

    f = global_fn(t, spec, strips)
    full = rand((1, spec.total, 2), 8).requires_grad_()
    with _unchecked(t):
        assert torch.autograd.gradcheck(f, (full,), eps=1e-6, atol=1e-8, rtol=1e-6)
        if t.name == "mpi":
            assert torch.autograd.gradgradcheck(f, (full,), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("boundary", BOUNDARIES, ids=str)
def test_adjoint_identity(t, boundary):
    """<F x, y> = <x, F* y>, both sides summed over ranks, for fetch and for accumulate."""
    spec = specs(t.size)["thin"]
    me = t.rank
    wb, wa = inside(spec, 3, 2) if boundary == "none" else (3, 2)
    x = rand((2, spec.sizes[me], 6), 20 + me).requires_grad_()
    out = mpidp.halo_exchange(x, wb, wa, 1, spec, boundary=boundary, group=t)
    y = rand(out.shape, 30 + me).requires_grad_()
    (acc,) = torch.autograd.grad(out, x, y, create_graph=True)  # F* y, differentiable in y
    lhs = sum(t.all_gather_object(float((out * y).sum().detach())))
    rhs = sum(t.all_gather_object(float((x * acc).sum().detach())))
    assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs))
    # The accumulate's own backward is the fetch again: (F*)* z = F z.
    z = rand(x.shape, 40 + me)
    (fz,) = torch.autograd.grad(acc, y, z)
    assert torch.equal(fz, mpidp.halo_exchange(z, wb, wa, 1, spec, boundary=boundary, group=t))
    lhs2 = sum(t.all_gather_object(float((acc * z).sum().detach())))
    rhs2 = sum(t.all_gather_object(float((y * fz).sum().detach())))
    assert abs(lhs2 - rhs2) <= 1e-12 * max(1.0, abs(lhs2))


# -- asynchronous form and module -----------------------------------------------------------


def test_async_overlap_and_two_in_flight(t):
    spec = specs(t.size)["721"]
    me = t.rank
    full = rand((1, 2, spec.total, 8), 8)
    x = full.narrow(2, spec.start(me), spec.sizes[me]).clone().requires_grad_()
    a = mpidp.start_halo_exchange(x, 3, 3, boundary="polar", spec=spec, group=t)
    b = mpidp.start_halo_exchange(x, 1, 2, boundary="replicate", spec=spec, group=t)
    interior = F.avg_pool2d(x, 3, 1)  # computed while the rows travel
    out_b, out_a = b.wait(), a.wait()
    assert a.length == spec.sizes[me] + 6
    assert torch.equal(out_a, serial_halo(full, spec.start(me) - 3, spec.stop(me) + 3, -2, "polar"))
    assert torch.equal(
        out_b, serial_halo(full, spec.start(me) - 1, spec.stop(me) + 2, -2, "replicate")
    )
    (out_a.sum() + out_b.sum() + interior.sum()).backward()
    sync = x.detach().clone().requires_grad_()
    (
        mpidp.halo_exchange(sync, 3, 3, boundary="polar", spec=spec, group=t).sum()
        + mpidp.halo_exchange(sync, 1, 2, boundary="replicate", spec=spec, group=t).sum()
        + F.avg_pool2d(sync, 3, 1).sum()
    ).backward()
    torch.testing.assert_close(x.grad, sync.grad, rtol=1e-15, atol=1e-14)  # summation order
    with pytest.raises(CommError, match="already called"):
        a.wait()
    s = mpidp.start_halo_exchange(x, 2, 1, boundary="polar", spec=spec, group=t, strips=True)
    low, high = s.wait()
    assert torch.equal(low, out_a[:, :, 1:3]) and torch.equal(high, out_a[:, :, -3:-2])


def test_module(t):
    spec = specs(t.size)["13"]
    me = t.rank
    full = rand((2, 2, 13, 6), 9)
    x = full.narrow(-2, spec.start(me), spec.sizes[me])
    lo, hi = spec.start(me) - 1, spec.stop(me) + 2
    halo = mpidp.HaloExchange((1, 2), boundary="polar_half", group=t)
    assert "before=1, after=2" in repr(halo)
    assert torch.equal(halo(x), serial_halo(full, lo, hi, -2, "polar_half"))
    assert torch.equal(halo.start(x, spec).wait(), halo(x, spec))
    both = mpidp.HaloExchange(2, boundary="reflect", group=t)
    want = serial_halo(full, spec.start(me) - 2, spec.stop(me) + 2, -2, "reflect")
    assert torch.equal(both(x), want)


# -- layer geometry end to end: halo from HaloSpec, then the layer without padding ----------


@pytest.mark.parametrize(
    ("kernel", "stride", "padding", "dilation", "mode"),
    [
        (3, 1, 1, 1, "zeros"),
        (5, 1, "same", 1, "reflect"),
        (3, 2, 1, 1, "zeros"),
        (4, 3, 2, 1, "replicate"),
        (3, 1, 2, 2, "circular"),
        (2, 2, 0, 1, "zeros"),
        (7, 1, 3, 1, "zeros"),
    ],
)
def test_conv_through_halo_spec(manager, kernel, stride, padding, dilation, mode):
    """A Conv2d sharded along H equals the serial one: forward, input and weight gradients."""
    h = 2 * WORLD + 1  # shards of 2-3 rows: a 7-row kernel fetches from two ranks away
    serial = torch.nn.Conv2d(
        2, 3, kernel, stride, padding, dilation, padding_mode=mode, dtype=torch.float64
    )
    in_spec = manager.spec(h)
    halo = mpidp.HaloSpec.for_layer(in_spec, manager.partition, kernel, stride, padding, dilation)
    lo_pad, hi_pad = mpidp.ops.geometry.padding_pair(padding, kernel, stride, dilation)
    dist_conv = torch.nn.Conv2d(2, 3, kernel, (stride, stride), 0, dilation, dtype=torch.float64)
    with torch.no_grad():  # the same weights on every rank
        serial.weight.copy_(rand(serial.weight.shape, 16))
        serial.bias.copy_(rand(serial.bias.shape, 17))
    dist_conv.load_state_dict(serial.state_dict())
    pad_w = (lo_pad, hi_pad)  # W is not sharded: padded locally by the same rule
    w_mode = {"zeros": "constant"}.get(mode, mode)

    def distributed(x):
        ext = mpidp.halo_exchange(
            x, halo.before, halo.after, spec=in_spec, manager=manager, boundary=mode
        )
        return dist_conv(F.pad(ext, (*pad_w, 0, 0), mode=w_mode))

    assert_matches_serial(
        serial, distributed, [rand((2, 2, h, 9), 11)], manager=manager, modules=(serial, dist_conv)
    )


# -- errors: the same exception on every rank, never a hang ----------------------------------


def test_errors_on_every_rank(t):
    p, me = t.size, t.rank
    spec = ShardSpec.balanced(4 * p, p)
    x = rand((2, spec.sizes[me], 6), 12)
    cases = [
        (dict(before=1, after=1, boundary=None), ConfigError, "beyond the low edge"),
        (dict(before=0, after=1, boundary="none"), ConfigError, "beyond the high edge"),
        (
            dict(before=4 * p + 1, after=0, boundary="circular"),
            ConfigError,
            f"supplies {4 * p}",
        ),
        (dict(before=1, after=1, dim=3), CommError, "dim 3 is out of range"),
        (dict(before=[1] * (p + 1), after=1), CommError, f"expecting one per rank \\({p}\\)"),
    ]
    for kwargs, exc, match in cases:
        kwargs = {"dim": 1, "spec": spec, "group": t, **kwargs}
        with pytest.raises(exc, match=match):
            mpidp.halo_exchange(x, **kwargs)
    odd = rand((2, spec.sizes[me], 5), 13)
    with pytest.raises(CommError, match="odd"):
        mpidp.halo_exchange(odd, 1, 1, 1, spec, boundary="polar", group=t)
    with pytest.raises(CommError, match="must be a dim"):
        mpidp.halo_exchange(x, 1, 1, 1, spec, boundary="polar", group=t, roll_dim=1)
    with pytest.raises(ConfigError, match="strips need widths >= 0"):
        mpidp.halo_strips(x, -1, 1, 1, spec, group=t)


def test_size_not_matching_spec_fails_everywhere(t):
    """Only the last rank passes a wrong shard: every rank raises, naming it."""
    p, me = t.size, t.rank
    spec = ShardSpec.balanced(4 * p, p)
    rows = spec.sizes[me] + (1 if me == p - 1 else 0)
    with pytest.raises(CommError, match=f"rank {p - 1}: tensor of shape"):
        mpidp.halo_exchange(rand((2, rows, 6), 14), 1, 1, 1, spec, group=t)
    wrong_parts = ShardSpec.balanced(4 * p, p + 1)
    with pytest.raises(CommError, match=f"shards for a group of {p} ranks"):
        mpidp.halo_exchange(rand((2, spec.sizes[me], 6), 14), 1, 1, 1, wrong_parts, group=t)


@pytest.mark.mpi(min_size=2)
def test_inconsistent_widths_fail_everywhere(t):
    spec = ShardSpec.balanced(4 * t.size, t.size)
    x = rand((2, spec.sizes[t.rank], 6), 15)
    with pytest.raises(CommError, match=r"rank 1: before=.* but rank 0 passed"):
        mpidp.halo_exchange(x, 1 if t.rank == 0 else 2, 1, 1, spec, group=t)
    with pytest.raises(CommError, match=r"rank 1: boundary=.* but rank 0 passed"):
        mpidp.halo_exchange(x, 1, 1, 1, spec, boundary="zeros" if t.rank else "reflect", group=t)
