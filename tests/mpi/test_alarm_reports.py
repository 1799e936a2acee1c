"""The deadlock detector's reports between two ranks (mpidp.comm.alarm), driven poll by poll on
a channel of their own, with real MPI messages: a report a peer sent from a wait it has left
is never judged as a wait that lasts; two ranks waiting for each other in different calls both
reach the verdict, whichever polls first; two waiting in the same call never do."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from mpi4py import MPI

from mpidp.comm.alarm import Call, _Alarm

pytestmark = pytest.mark.mpi(min_size=2)

RANK = MPI.COMM_WORLD.Get_rank()
LIMIT = 60.0  # every wait below began 10 s ago: past stuck_after(60) = 5 s


@pytest.fixture
def alarm() -> Iterator[_Alarm | None]:
    """A fresh alarm channel over world ranks 0 and 1 (None on the others)."""
    pair = MPI.COMM_WORLD.Split(0 if RANK < 2 else MPI.UNDEFINED, RANK)
    yield None if pair == MPI.COMM_NULL else _Alarm(pair)
    MPI.COMM_WORLD.Barrier()
    if pair != MPI.COMM_NULL:
        status = MPI.Status()
        while pair.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):  # what was left unread
            pair.recv(source=status.Get_source(), tag=status.Get_tag())
        pair.Barrier()
        pair.Free()


def exchange(number: int, rank: int = RANK) -> Call:
    """``rank``'s wait in the pair's halo exchange ``number`` (its tags' number), for the
    other rank."""
    return Call((0, 1), "exchange", number, f"exchange {number}", (1 - rank,))


def poll_until(a: _Alarm, waits: list, seconds: float) -> str | None:
    """Poll every 50 ms until a verdict or ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        verdict = a.poll(waits)
        if verdict is not None:
            return verdict
        time.sleep(0.05)
    return None


def test_a_report_from_a_wait_the_peer_has_left_is_not_a_deadlock(alarm):
    """Rank 1 waited long in the forward's exchange (3) and reported it; rank 0 then arrived,
    the exchange completed, and rank 0 now waits alone in the backward's (4). The report
    reaches rank 0's watchdog only now: it must not be taken for rank 1 waiting in another
    call (it used to be, when it was read after the backward's wait began)."""
    if alarm is None:
        return
    began = time.monotonic() - 10
    if RANK == 1:
        assert alarm.poll([(began, LIMIT, exchange(3))]) is None  # the report goes out
        alarm.comm.Barrier()  # ... and rank 1 leaves the call: no wait any more
        assert poll_until(alarm, [], 1.5) is None
    else:
        alarm.comm.Barrier()
        end = time.monotonic() + 5
        while 1 not in alarm.heard and time.monotonic() < end:
            assert alarm.poll([(began, LIMIT, exchange(4))]) is None
        assert alarm.heard.get(1) == 1, "rank 1's report never arrived"
        assert poll_until(alarm, [(began, LIMIT, exchange(4))], 1.5) is None


@pytest.mark.parametrize("late", [0, 1], ids=["rank0-late", "rank1-late"])
def test_two_ranks_waiting_for_each_other_in_different_calls_both_end_it(alarm, late):
    """Rank 0 in the backward's exchange (4), rank 1 already in the next step's (5): each
    reaches the verdict, naming both calls, even when one of them polls first, judges first
    and stops polling (the real one ends the job)."""
    if alarm is None:
        return
    if RANK == late:
        time.sleep(0.3)
    number = 4 if RANK == 0 else 5  # rank 0: the backward of exchange 1; rank 1: exchange 2
    mine, theirs = exchange(number), exchange(9 - number, 1 - RANK)
    verdict = poll_until(alarm, [(time.monotonic() - 10, LIMIT, mine)], 5.0)
    assert verdict is not None, f"rank {RANK}: no verdict"
    assert f"in {mine.describe()} for rank {1 - RANK}" in verdict, verdict
    assert f"another call: {theirs.describe()}" in verdict, verdict


def test_two_ranks_waiting_in_the_same_call_are_never_judged(alarm):
    """Both in exchange 7 (a third rank is late, say): reports cross and are answered once;
    no verdict, and no message storm."""
    if alarm is None:
        return
    assert poll_until(alarm, [(time.monotonic() - 10, LIMIT, exchange(7))], 1.5) is None
    assert alarm.numbered <= 2, alarm.numbered
