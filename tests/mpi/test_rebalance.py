"""Rebalancing while training (issue 48): the policy from measured costs agreed on every rank,
the switch at a step boundary, rows that change owner moved (and only those), and a run that
rebalances twice giving the losses and weights of one that never does and of the serial run."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from mpi4py import MPI

import mpidp
from mpidp.errors import ConfigError
from mpidp.runtime.partition import Balanced, ShardSpec, Weighted
from mpidp.testing import count_traffic

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
F64 = torch.float64


@pytest.fixture
def m(manager):
    """The module's manager, its partition restored after each test."""
    yield manager
    manager.partition = Balanced()


def rand(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def band(full, spec, rank, dim=-2):
    return full.narrow(dim, spec.start(rank), spec[rank])


def test_bad_or_different_costs_fail_on_every_rank(m):
    me = m.domain_rank
    cases = [
        ([1.0] * (WORLD + 1), "values"),
        ([1.0] * (WORLD - 1) + [float("nan")], "NaN"),
        ([-1.0] * WORLD, "negative"),
    ]
    if WORLD > 1:  # every rank passes its own vector: a difference, never a hang
        cases.append(([1.0 + me] * WORLD, "rank_seconds="))
    for seconds, match in cases:
        with pytest.raises(ConfigError, match=match):
            mpidp.rebalance(m, seconds, rows=4 * WORLD + 1)
        assert m.partition == Balanced()
    if WORLD > 1:
        with pytest.raises(ConfigError, match="policy="):
            m.set_partition(Weighted((1.0,) * (WORLD - 1) + (1.0 + me,)))
        assert m.partition == Balanced()
        with pytest.raises(ConfigError, match="cannot cut the input"):  # 3 rows over P > 3
            m.set_partition(Weighted((1.0,) * WORLD), rows=WORLD - 1)
        assert m.partition == Balanced()
    with pytest.raises(ConfigError, match=f"{WORLD + 1} weights for {WORLD}"):
        m.set_partition(Weighted((1.0,) * (WORLD + 1)))


def test_rebalance_then_set_partition(m):
    h = 37
    old = m.spec(h)
    seconds = [n * (3.0 if r == 0 else 1.0) for r, n in enumerate(old)]  # rank 0 3x slower
    policy = mpidp.rebalance(m, seconds, rows=h)
    m.set_partition(policy, rows=h)
    new = m.spec(h)
    assert m.partition is policy and new.total == h
    if WORLD > 1:
        assert new[0] < old[0]
        predicted = max(n * seconds[r] / old[r] for r, n in enumerate(new))
        assert predicted < max(seconds)


def _pairs(p):
    """Partition pairs of 4p+3 rows: grow and shrink the first band, an uneven cut, a band
    going empty and coming back."""
    n = 4 * p + 3
    even = ShardSpec.balanced(n, p)
    grown = ShardSpec.from_sizes([n - 2 * (p - 1)] + [2] * (p - 1)) if p > 1 else even
    uneven = Weighted(tuple(range(1, p + 1))).spec(n, p)
    empty = ShardSpec.from_sizes([*ShardSpec.balanced(n, p - 1), 0]) if p > 1 else even
    return {
        "grow": (even, grown),
        "shrink": (grown, even),
        "uneven": (even, uneven),
        "empty": (uneven, empty),
        "back": (empty, even),
    }


@pytest.mark.parametrize("kind", ["grow", "shrink", "uneven", "empty", "back"])
def test_repartition_moves_the_rows_that_change_owner(m, kind):
    """mpidp.repartition moves a tensor that lives across steps to the new cut: the new cut's
    band of the same tensor, sending (rows of this rank that change owner) x row bytes."""
    old, new = _pairs(WORLD)[kind]
    me = m.domain_rank
    full = rand((2, 3, old.total, 5), 7)
    with count_traffic(m) as traffic:
        out = mpidp.repartition(band(full, old, me), old, new, -2, group=m)
    assert torch.equal(out, band(full, new, me))
    leaving = sum(hi - lo for r, lo, hi in new.overlaps(old.start(me), old.stop(me)) if r != me)
    row_bytes = 2 * 3 * 5 * 8
    assert traffic.ops.get("all_to_all_v", [0, 0])[1] == leaving * row_bytes
    if WORLD > 1 and kind != "back":
        assert m.transport().all_gather_object(leaving) != [0] * WORLD


def _train(m, serial, steps, h, w, rebalance_at=(), seed=0):
    """Losses and final state_dict of ``steps`` SGD steps of the converted ``serial``; the
    input is the data plus a state band that lives across steps (moved at each rebalance)."""
    model = mpidp.convert_to_domain_parallel(copy.deepcopy(serial), m)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    me, specs, losses = m.domain_rank, [], []
    state_full = rand((1, 3, h, w), seed + 1)
    spec = m.spec(h)
    state = band(state_full, spec, me)
    for step in range(steps):
        if step in rebalance_at:  # synthetic costs: one rank slower per row than the others
            slow = rebalance_at.index(step) * (WORLD - 1)
            cost = [n * (2.5 if r == slow else 1.0) for r, n in enumerate(spec)]
            m.set_partition(mpidp.rebalance(m, cost, rows=h), rows=h)
            state = mpidp.repartition(state, spec, m.spec(h), -2, group=m)
            spec = m.spec(h)
        specs.append(spec.sizes)
        x, y = rand((1, 3, h, w), 100 + step), rand((1, 3, h, w), 200 + step)
        opt.zero_grad()
        out = model(band(x, spec, me) + state)
        lat = mpidp.latitude_weights(h, manager=m)
        loss = mpidp.global_mean((out - band(y, spec, me)).square(), lat, manager=m)
        loss.backward()
        mpidp.sync_gradients(model, m)
        opt.step()
        state = 0.5 * state + out.detach()
        losses.append(float(loss.detach()))
    return losses, model.state_dict(), specs


def _serial(serial, steps, h, w, seed=0):
    opt = torch.optim.SGD(serial.parameters(), lr=0.05, momentum=0.9)
    lat = torch.cos(torch.deg2rad(torch.linspace(90, -90, h, dtype=F64))).unsqueeze(-1)
    lat = lat / lat.mean()
    state, losses = rand((1, 3, h, w), seed + 1), []
    for step in range(steps):
        x, y = rand((1, 3, h, w), 100 + step), rand((1, 3, h, w), 200 + step)
        opt.zero_grad()
        out = serial(x + state)
        loss = ((out - y).square() * lat).mean()
        loss.backward()
        opt.step()
        state = 0.5 * state + out.detach()
        losses.append(float(loss.detach()))
    return losses, serial.state_dict()


def _gap(a, b):
    return max(abs(x - y) / max(abs(y), 1e-300) for x, y in zip(a, b, strict=True))


def _weights_gap(a, b):
    return max(float(((a[k] - b[k]).abs() / b[k].abs().max().clamp_min(1e-300)).max()) for k in b)


def test_training_with_two_rebalances_matches_fixed_and_serial(m):
    """10 SGD steps of the U-Net on (1, 3, 37, 16), rebalanced at steps 3 and 7 (two different
    cuts), against 10 steps on the balanced cut and against the serial run: losses and final
    weights equal to 1e-10 (relative, float64)."""
    from mpidp.models import WeatherUNet

    h, w = 37, 16
    serial = WeatherUNet(3, 3, (h, w), width=4).to(F64)
    mpidp.broadcast_parameters(serial, m)
    fixed_losses, fixed_weights, fixed_specs = _train(m, serial, 10, h, w)
    moved_losses, moved_weights, specs = _train(m, serial, 10, h, w, rebalance_at=(3, 7))
    m.set_partition(Balanced())
    serial_losses, serial_weights = _serial(serial, 10, h, w)
    if WORLD > 1:  # three different cuts: before step 3, from 3 to 6, from 7 on
        assert len({specs[0], specs[3], specs[7]}) == 3, specs
        assert set(fixed_specs) == {specs[0]}
    gaps = (
        _gap(moved_losses, fixed_losses),
        _gap(moved_losses, serial_losses),
        _weights_gap(moved_weights, fixed_weights),
        _weights_gap(moved_weights, serial_weights),
    )
    everyone = m.transport().all_gather_object(gaps)
    assert all(g < 1e-10 for row in everyone for g in row), everyone


@pytest.mark.skipif(WORLD != 4, reason="dp 2 x domain 2 needs 4 ranks")
def test_replicas_must_agree_on_the_costs():
    """dp 2 x domain 2: the replicas share one cut, so each rank's costs must be the same in
    both replicas (a clear error on every rank of both, the partition kept); the profile's
    rank_seconds give every rank the slowest replica's seconds, which rebalance takes."""
    with mpidp.DistributedManager(domain_parallel_size=2) as dm:
        d, rep = dm.domain_rank, dm.dp_rank
        seconds = [1.0, 1.0 + rep]  # replica 1's domain rank 1 is slower
        try:
            mpidp.rebalance(dm, seconds, rows=13)
            error = ""
        except ConfigError as err:
            error = str(err)
        with mpidp.profile(dm) as prof:
            for _ in range(2):
                with prof.step():
                    time.sleep(0.01 * (1 + 4 * (rep == 1 and d == 1)))
                    dm.transport().barrier()
        reduced = prof.rank_seconds()
        before = dm.spec(13)
        dm.set_partition(mpidp.rebalance(dm, reduced, rows=13), rows=13)
        after = dm.spec(13)
        facts = dm.transport("world").all_gather_object((error, reduced, after.sizes))
    assert all("replicas share one cut" in e and "rank_seconds=" in e for e, _, _ in facts), facts
    assert all(r == facts[0][1] for _, r, _ in facts) and reduced[1] > 2 * reduced[0], facts
    assert all(s == after.sizes for _, _, s in facts) and after[1] < before[1], facts
