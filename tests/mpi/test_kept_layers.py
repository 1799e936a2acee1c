"""A converted convolution's repeated call on a band of known partition takes the call kept
by its facts (issue 47: :meth:`~mpidp.layers.base.DomainParallel._kept_call`,
:class:`~mpidp.layers.base.Repeat`, :func:`~mpidp.ops.halo_band.kept_fetch`), each against
serial torch and against the general path it stands for:

* planned, then kept, with and without a gradient, a convolution (same padding, stride 2,
  circular padding) and a PeriodicConv2d (polar, polar_half with stride 2) equal serial on
  uneven bands and, from 3 ranks, with an empty band;
* a call of another partition (the same local rows on some ranks), another grad mode, a
  replaced weight, the agreement's set replaced, or inside a counting block is not served by
  a stale kept call: each equals serial, and the counting block sees every halo message;
* a deep copy of a layer with kept calls computes the same and keeps none of them.

Float64; output, input gradient and every parameter gradient (after ``mpidp.sync_gradients``)
against serial; asserted after every collective.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import agreed, rand
from mpi4py import MPI
from test_dispatch_cache import _differs, _run, _serial
from torch import nn

import mpidp
from mpidp.layers.base import KeptCalls, Repeat
from mpidp.layers.periodic import PeriodicConv2d
from mpidp.runtime.partition import ShardSpec
from mpidp.testing import count_traffic

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
SHAPE = (2, 3, 13, 20)

LAYERS = {
    "conv": lambda: nn.Conv2d(3, 4, 3, padding=1),
    "conv stride 2": lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1),
    "conv circular": lambda: nn.Conv2d(3, 4, (3, 5), padding=(1, 2), padding_mode="circular"),
    "conv no bias": lambda: nn.Conv2d(3, 4, 3, padding=1, bias=False),
    "periodic polar": lambda: PeriodicConv2d(3, 4, 3, pole="polar"),
    "periodic polar_half stride 2": lambda: PeriodicConv2d(3, 4, (5, 3), 2, pole="polar_half"),
}


def _with_empty():
    """13 rows with rank 1's band empty: 5, 0, then 8 over the other ranks."""
    rest = [8 // (WORLD - 2)] * (WORLD - 2)
    rest[-1] += 8 - sum(rest)
    return ShardSpec((5, 0, *rest))


#: uneven bands, and from 3 ranks one band empty
SPECS = [None] + ([_with_empty()] if WORLD >= 3 else [])


@pytest.fixture(scope="module")
def m():
    with mpidp.DistributedManager(domain_parallel_size=WORLD) as manager:
        yield manager


def _made(name):
    torch.manual_seed(3)
    serial = LAYERS[name]().double()
    return serial, copy.deepcopy(serial)


def _kept(layer):
    """The layer's kept calls (in the converted model, the layer itself)."""
    return [v for v in layer.__dict__.get("_kept_calls", {}).values() if isinstance(v, Repeat)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "uneven" if s is None else "empty")
@pytest.mark.parametrize("name", list(LAYERS))
def test_planned_then_kept_calls_equal_serial(m, name, spec):
    """Three calls with a gradient and two without: the first plans, the others are served by
    the kept call (found on every rank), all equal serial."""
    serial, layer = _made(name)
    conv = mpidp.convert_to_domain_parallel(layer, m)
    full = rand(SHAPE, 1)
    want = _serial(serial, serial, full)
    bad = []
    for i in range(3):
        bad += [f"grad call {i}: {b}" for b in _differs(_run(m, conv, conv, full, spec), want)]
    with torch.no_grad():
        for i in range(2):
            x = mpidp.shard(full, 2, m, spec)
            got = conv(x).full_tensor().as_subclass(torch.Tensor)
            if not torch.allclose(got, want[0], rtol=1e-10, atol=1e-12):
                bad.append(f"no-grad call {i}: output")
    kinds = {(v.kept.fetch.__class__.__name__) for v in _kept(conv)}
    if WORLD > 1 and len(_kept(conv)) != 2:  # one per grad mode
        bad.append(f"kept calls {len(_kept(conv))}, kinds {kinds}")
    bad = agreed(bad)
    assert not bad, bad


@pytest.mark.skipif(WORLD == 1, reason="one rank: no band is empty")
def test_an_empty_output_band_is_kept_as_computed(m):
    """A stride-2 convolution of 2 * WORLD - 2 rows gives WORLD - 1 output rows: one rank's
    output band is empty (its kept call pads its halo'd rows as the general path does)."""
    serial, layer = _made("conv stride 2")
    conv = mpidp.convert_to_domain_parallel(layer, m)
    full = rand((2, 3, max(2 * WORLD - 2, 2), 8), 7)
    want = _serial(serial, serial, full)
    bad = []
    for i in range(3):
        conv.zero_grad()
        x = mpidp.shard(full, 2, m).detach().requires_grad_()
        y = conv(x)
        (y * mpidp.shard(rand(tuple(y.shape), 7), 2, m, y.spec)).sum().backward()
        mpidp.sync_gradients(conv, m)
        whole = [t.full_tensor().as_subclass(torch.Tensor) for t in (y, x.grad)]
        grads = {n: p.grad for n, p in conv.named_parameters()}
        bad += [f"call {i}: {b}" for b in _differs((y, *whole, grads), want)]
    if not _kept(conv):
        bad.append("no kept call")
    bad = agreed(bad)
    assert not bad, bad


def test_a_band_fed_twice_takes_the_kept_call(m):
    """The band API: a plain band whose partition the first call learned is known to the
    next call on the same tensor (the per-call benchmark's case): kept, equal serial."""
    serial, layer = _made("conv")
    conv = mpidp.convert_to_domain_parallel(layer, m)
    full = rand(SHAPE, 2)
    band = full[..., m.spec(13).slice(m.domain_rank), :]
    with torch.no_grad():
        want = serial(full)[..., m.spec(13).slice(m.domain_rank), :]
        got = [conv(band) for _ in range(3)]
    bad = [f"call {i}" for i, y in enumerate(got) if not torch.allclose(y, want, rtol=1e-10)]
    if WORLD > 1 and not _kept(conv):
        bad.append("no kept call")
    bad = agreed(bad)
    assert not bad, bad


def test_another_partition_is_not_served_by_a_stale_call(m):
    """The same layer on 2 * WORLD + 3 rows, then 2 * WORLD + 4, then the first again: some
    ranks hold as many rows in both (their band's shape alone does not tell the calls apart),
    a stride-2 convolution needs other halos; every call equals serial."""
    serial, layer = _made("conv stride 2")
    conv = mpidp.convert_to_domain_parallel(layer, m)
    bad = []
    for rows in (2 * WORLD + 3, 2 * WORLD + 4, 2 * WORLD + 3):
        full = rand((1, 3, rows, 8), rows)
        want = _serial(serial, serial, full)
        for _ in range(2):
            bad += [f"{rows} rows: {b}" for b in _differs(_run(m, conv, conv, full), want)]
    bad = agreed(bad)
    assert not bad, bad


def test_replaced_weight_lapsed_agreement_and_counting_take_effect(m):
    """A kept call reads the layer's weight at each call; once the transport's agreed set is
    replaced it lapses (the general path agrees anew, on every rank, and keeps a new call);
    inside ``count_traffic`` the general path runs and every halo message is counted."""
    serial, layer = _made("conv")
    conv = mpidp.convert_to_domain_parallel(layer, m)
    full = rand(SHAPE, 4)
    bad = []
    _run(m, conv, conv, full)
    _run(m, conv, conv, full)
    with torch.no_grad():
        w = rand(tuple(serial.weight.shape), 5)
        serial.weight.copy_(w)
    conv.weight = nn.Parameter(w.clone())
    want = _serial(serial, serial, full)
    bad += [f"new weight: {b}" for b in _differs(_run(m, conv, conv, full), want)]
    if WORLD > 1:  # (one rank: the torch layer, no halo)
        t = m.transport(None, "cpu")
        old = t.__dict__["_halo_agreed"]
        t.__dict__["_halo_agreed"] = set()
        bad += [f"lapsed: {b}" for b in _differs(_run(m, conv, conv, full), want)]
        if any(r.kept.agreed is old for r in _kept(conv)) or not t.__dict__["_halo_agreed"]:
            bad.append("the lapsed call was kept or nothing was agreed anew")
    x = mpidp.shard(full, 2, m)
    with torch.no_grad():
        conv(x)
        conv(x)  # kept without a gradient too
        with count_traffic(m) as traffic:
            conv(x)
    if WORLD > 1 and not traffic.ops.get("exchange"):
        bad.append(f"counting saw no halo message: {traffic.ops}")
    bad = agreed(bad)
    assert not bad, bad


def test_a_deep_copy_keeps_no_calls_and_computes_the_same(m):
    serial, layer = _made("periodic polar")
    conv = mpidp.convert_to_domain_parallel(layer, m)
    full = rand(SHAPE, 6)
    want = _serial(serial, serial, full)
    _run(m, conv, conv, full)
    _run(m, conv, conv, full)
    twin = copy.deepcopy(conv)
    bad = [] if type(twin.__dict__.get("_kept_calls", KeptCalls())) is KeptCalls else ["type"]
    if twin.__dict__.get("_kept_calls"):
        bad.append("the copy holds kept calls")
    bad += [f"copy: {b}" for b in _differs(_run(m, twin, twin, full), want)]
    bad = agreed(bad)
    assert not bad, bad


@pytest.mark.skipif(WORLD == 1, reason="one rank: one partition")
def test_another_partition_policy_is_not_served_by_a_stale_call(m):
    """The manager's policy changes between calls: a stride-2 convolution's output is cut by
    the new policy (a kept call serves only under the policy it was kept with)."""
    serial, layer = _made("conv stride 2")
    conv = mpidp.convert_to_domain_parallel(layer, m)
    full = rand((1, 3, 8 * WORLD, 8), 8)
    want = _serial(serial, serial, full)
    bad = []
    try:
        for policy in (mpidp.Balanced(), mpidp.Weighted(tuple(range(1, WORLD + 1)))):
            m.partition = policy
            for _ in range(2):
                got = _run(m, conv, conv, full, ShardSpec.balanced(8 * WORLD, WORLD))
                bad += [f"{policy}: {b}" for b in _differs(got, want)]
                if got[0].spec != policy.spec(4 * WORLD, WORLD):
                    bad.append(f"{policy}: output cut {got[0].spec}")
    finally:
        m.partition = mpidp.Balanced()
    bad = agreed(bad)
    assert not bad, bad


#: the layers whose halo pieces are plain copies (zeros, circular): their kept exchange is the
#: prepared one (halo_band._Fast), with a gradient through halo_band._KeptFetch
LEAN = ["conv", "conv stride 2", "conv circular", "conv no bias"]


@pytest.fixture
def fetches(monkeypatch):
    """Counts of the general fetch's forwards, and the numbers the halo's backwards got (the
    general accumulate's, and the prepared one's: ``lean``)."""
    from mpidp.ops import halo_band

    seen = {"general": 0, "backward": [], "lean": 0}
    fetch, accumulate = halo_band._HaloFetch.forward, halo_band._HaloAccumulate.forward
    back = halo_band._Back.__call__

    def general(ctx, *args):
        seen["general"] += 1
        return fetch(ctx, *args)

    def backward(ctx, op, x_shape, number, *gs):
        seen["backward"].append(number)
        return accumulate(ctx, op, x_shape, number, *gs)

    def lean(self, g, number):
        seen["lean"] += 1
        run = self.exchange.run

        def sent(n=0):  # the number its messages carry: the fetch's + 1
            seen["backward"].append(n - 1)
            return run(n)

        self.exchange.run = sent
        try:
            return back(self, g, number)
        finally:
            del self.exchange.run

    monkeypatch.setattr(halo_band._HaloFetch, "forward", staticmethod(general))
    monkeypatch.setattr(halo_band._HaloAccumulate, "forward", staticmethod(backward))
    monkeypatch.setattr(halo_band._Back, "__call__", lean)
    return seen


@pytest.mark.skipif(WORLD == 1, reason="one rank: the torch layer, no halo")
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "uneven" if s is None else "empty")
@pytest.mark.parametrize("name", LEAN)
def test_kept_training_calls_take_the_prepared_exchange(m, name, spec, fetches):
    """A kept call with a gradient makes its exchange through the prepared one (no general
    fetch), its backward's too where the halo surrounds the whole band (halo_band._Back), and
    equals serial (output, input gradient, every parameter gradient); its backward is numbered
    as the forward's exchange (2 x the transport's count) + 1, the numbering the deadlock
    detector reads (mpidp.comm.alarm)."""
    serial, layer = _made(name)
    conv = mpidp.convert_to_domain_parallel(layer, m)
    full = rand(SHAPE, 9)
    want = _serial(serial, serial, full)
    t = m.transport(None, "cpu")
    bad = [f"first call: {b}" for b in _differs(_run(m, conv, conv, full, spec), want)]
    for i in range(2):
        conv.zero_grad()
        fetches.update(general=0, backward=[], lean=0)
        x = mpidp.shard(full, 2, m, spec).detach().requires_grad_()
        y = conv(x)
        number = 2 * t.fetches
        (y * mpidp.shard(rand(tuple(y.shape), 7), 2, m, y.spec)).sum().backward()
        mpidp.sync_gradients(conv, m)
        whole = [v.full_tensor().as_subclass(torch.Tensor) for v in (y, x.grad)]
        grads = {n: p.grad.clone() for n, p in conv.named_parameters()}
        bad += [f"kept call {i}: {b}" for b in _differs((y, *whole, grads), want)]
        if fetches["general"]:
            bad.append(f"kept call {i}: {fetches['general']} general fetches")
        # (input and output cut alike: the halo around the whole band, the prepared backward;
        # cut otherwise (the empty band, a stride), a rank may take part of its band: general)
        if spec is None and "stride" not in name and fetches["lean"] != 1:
            bad.append(f"kept call {i}: {fetches['lean']} prepared backwards, not 1")
        if fetches["backward"] != [number]:
            bad.append(f"kept call {i}: backward numbered {fetches['backward']}, not [{number}]")
    bad = agreed(bad)
    assert not bad, bad


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "uneven" if s is None else "empty")
@pytest.mark.parametrize("name", ["conv", "periodic polar"])
def test_kept_training_calls_differentiate_twice(m, name, spec):
    """The input gradient of a kept call (the band API: one band tensor fed again), taken
    with ``create_graph``, differentiated again (its halo's backward is a Function then): the
    input gradient and the weight's second-order gradient equal serial's, on every call."""
    serial, layer = _made(name)
    conv = mpidp.convert_to_domain_parallel(layer, m)
    full, w, v = rand(SHAPE, 10), rand((2, 4, 13, 20), 11), rand(SHAPE, 12)
    rows = (spec or m.spec(13)).slice(m.domain_rank)
    out = m.spec(13).slice(m.domain_rank)  # (the output is cut by the manager's policy)

    def second(module, x, w_, v_):
        module.zero_grad()
        (gx,) = torch.autograd.grad((module(x) * w_).sum(), x, create_graph=True)
        (gx * v_).sum().backward()
        return gx.detach()

    want_gx = second(serial, full.clone().requires_grad_(), w, v)[..., rows, :]
    want = {n: p.grad.clone() for n, p in serial.named_parameters() if p.grad is not None}
    x = full[..., rows, :].clone().requires_grad_()  # (the same band: its partition known)
    bad = []
    for i in range(3):
        gx = second(conv, x, w[..., out, :], v[..., rows, :])
        mpidp.sync_gradients(conv, m)
        got = dict(conv.named_parameters())
        if not torch.allclose(gx, want_gx, rtol=1e-10, atol=1e-12):
            bad.append(f"call {i}: input gradient")
        bad += [
            f"call {i}: second-order grad {n}"
            for n in want
            if got[n].grad is None or not torch.allclose(got[n].grad, want[n], rtol=1e-10)
        ]
    if WORLD > 1 and not _kept(conv):
        bad.append("no kept call")
    bad = agreed(bad)
    assert not bad, bad
