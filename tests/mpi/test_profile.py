"""mpidp.profile at 1-3 ranks (issue 48): each rank's step split into compute, communication
and waiting for the slowest peer, adding up to the step; a slowed rank shows more compute and
its peers more wait; the figures round-trip through JSON and ``mpidp profile-report``; and
``rank_seconds()`` fed to mpidp.rebalance moves rows off the slow rank.

Timings are compared with each other (a slow rank against its peers, with wide margins), never
against constants: the machine is shared."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

import mpidp
from mpidp import cli
from mpidp.comm.timing import TimingTransport
from mpidp.runtime.partition import Balanced
from mpidp.testing import count_traffic

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD
P, ME = WORLD.Get_size(), WORLD.Get_rank()
SLOW = P - 1
H = 24


@pytest.fixture
def m(manager):
    yield manager
    manager.partition = Balanced()


def work(m, seconds: float) -> None:
    """A step: ``seconds`` of compute, then mpidp's gradient-style all-reduce and a halo
    exchange (the communication a training step makes)."""
    time.sleep(seconds)
    x = torch.ones(2, m.spec(H)[m.domain_rank], 4, dtype=torch.float64)
    mpidp.halo_exchange(x, 1, 1, dim=-2, manager=m)
    m.transport().all_reduce(torch.ones(8, dtype=torch.float64), "sum")


def profiled(m, seconds: float, steps: int = 3) -> mpidp.Profile:
    with mpidp.profile(m) as prof:
        for _ in range(steps):
            with prof.step():
                work(m, seconds)
    return prof


def test_parts_add_up_to_the_step(m):
    prof = profiled(m, 0.01)
    report = prof.report()
    assert (report.ranks, report.steps) == (P, 3)
    assert report.step[ME] == tuple(prof.step_seconds)  # the gathered figures are each rank's
    for r, rows in enumerate(report.parts()):
        for k, (compute, comm, wait) in enumerate(rows):
            assert min(compute, comm, wait) >= 0
            assert math.isclose(compute + comm + wait, report.step[r][k], abs_tol=1e-9)
            assert comm + wait == pytest.approx(report.communication[r][k], abs=1e-9)
    # the sleep is compute, not communication
    assert report.means()[ME]["compute"] >= 0.01
    if P == 1:
        assert prof.clock.calls == 0 and all(w == 0 for _, _, w in report.parts()[0])
    else:
        assert prof.clock.calls >= 3 * 2  # the halo exchange and the all-reduce, each step
    assert "compute" in prof.summary() and len(prof.summary().splitlines()) == 2 + P


def test_the_wrappers_go_at_the_end_and_nest(m):
    with count_traffic(m) as traffic, mpidp.profile(m) as prof:
        assert isinstance(m.transport(), TimingTransport)
        with prof.step():
            work(m, 0.0)
    assert not isinstance(m.transport(), TimingTransport)
    assert "transport" not in m.__dict__  # the manager's own method again
    assert (traffic.messages > 0) == (P > 1) and (prof.clock.calls > 0) == (P > 1)


@pytest.mark.mpi(min_size=2)
def test_slow_rank_shows_compute_and_peers_wait(m):
    prof = profiled(m, 0.06 if ME == SLOW else 0.01, steps=3)
    means = prof.report().means()
    slow, fast = means[SLOW], [means[r] for r in range(P) if r != SLOW]
    for f in fast:
        assert slow["compute"] > 2 * f["compute"], means
        assert f["wait"] > 2 * slow["wait"], means
        # most of the 50 ms gap per step is seen as waiting by the fast ranks
        assert f["wait"] > 0.5 * (slow["compute"] - f["compute"]), means


def test_json_round_trip_and_the_report_command(m, capsys):
    prof = profiled(m, 0.005, steps=2)
    folder = Path(WORLD.bcast(tempfile.mkdtemp(prefix="mpidp-profile-") if ME == 0 else None))
    path = folder / "profile.json"
    report = prof.to_json(path)
    WORLD.Barrier()
    again = mpidp.ProfileReport.from_json(path)
    assert again == report and again.means() == report.means()
    if ME == 0:
        png = folder / "profile.png"
        assert cli.main(["profile-report", str(path), "--plot", str(png)]) == 0
        out = capsys.readouterr().out
        assert out.strip() == report.table()
        assert png.stat().st_size > 1000
    WORLD.Barrier()


@pytest.mark.mpi(min_size=2)
def test_rank_seconds_move_rows_off_the_slow_rank(m):
    me = m.domain_rank
    with mpidp.profile(m) as prof:
        for _ in range(3):
            with prof.step():
                rows = m.spec(H)[me]
                work(m, 0.002 * rows * (3 if me == SLOW else 1))
    seconds = prof.rank_seconds()
    assert len(seconds) == P and seconds[SLOW] == max(seconds)
    before = m.spec(H)
    m.set_partition(mpidp.rebalance(m, seconds, rows=H), rows=H)
    after = m.spec(H)
    assert after[SLOW] < before[SLOW], (before, after, seconds)


@pytest.mark.mpi(min_size=2)
def test_waiting_on_a_point_to_point_message_is_communication(m):
    """No collective before it: a rank whose halo message comes late spends the delay in the
    exchange's wait(), which the profile times (posting alone would miss it)."""
    t, late = m.transport(), 0.05
    nxt, prv = (ME + 1) % P, (ME - 1) % P
    with mpidp.profile(m) as prof:
        for _ in range(2):
            with prof.step():
                time.sleep(late if ME == SLOW else 0.0)
                buf = torch.empty(16, dtype=torch.float64)
                m.transport().exchange([(nxt, torch.ones(16, dtype=torch.float64))], [(prv, buf)])
    t.barrier()
    report = prof.report()
    waiter = (SLOW + 1) % P  # receives from the slow rank
    comm = [sum(c) / report.steps for c in report.communication]
    assert comm[waiter] > 0.5 * late and comm[waiter] > 5 * comm[SLOW], comm
