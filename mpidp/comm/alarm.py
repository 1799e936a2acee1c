"""Word between the ranks of an MPI job that is about to end badly, on a communicator of its own.

Two kinds of message travel here, never on a call's own path (a call pays nothing for them):

* **An error that ends one rank.** An exception that reaches the top of a rank (uncaught: the
  rank is ending, and under ``python -m mpi4py`` the job with it) is sent to every other rank
  at once; each prints it, naming the rank it came from, so every rank's output says why the
  job ended, not only the output of the rank that raised. The rank that raised lets the job
  end only once its own message is out: at exit it flushes its output, then waits (10 s
  at most) until every other rank has printed its error; a rank ending with an error
  of its own confirms another's only once its own is out, so no rank's abort cuts off the
  message of another that failed at the same time. (Its message may not be out while the
  hook runs: torch.distributed's hook, chained around this one, holds it until it returns.)
  A rank that heard of such an error and is still running a few seconds later (the failed
  rank was not run by ``python -m mpi4py``, which aborts the job, or is slow to exit) aborts
  the job itself: it would wait forever.
* **A wait that has lasted** :func:`stuck_after` **seconds.** The waiting rank tells the ranks
  it waits for which call it is in. A rank that is itself waiting, for the sender, in another
  call (on another communicator, a call of another kind, or an exchange of another number:
  the halo numbers its exchanges in their tags, the backward with its forward's number) knows
  that neither can go on: a rank skipped a call the others made. It ends the job at once,
  naming both calls, instead of at the deadline (600 s by default). A report is believed only
  once it answers this rank's own report of the wait it is in (each report carries the number
  of the last one heard from its receiver, and a waiting rank answers a report it has not yet
  answered): a report sent before this wait began — its sender has left that call since,
  this rank's own arrival in it let it go — is never taken for a wait that lasts.

The deadline's watchdog thread (:mod:`mpidp.comm.mpi`) listens, twice a second. Needs an MPI
with ``MPI_THREAD_MULTIPLE`` (the watchdog thread talks while the main thread waits in MPI);
without it nothing is installed and the deadline alone ends a stuck job.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import NamedTuple

from mpi4py import MPI

__all__ = ["Call", "end_job", "install", "stuck_after"]

TAG_ERROR, TAG_SEEN, TAG_STUCK = 11, 12, 13
#: seconds the rank that failed waits at exit for the others to confirm they printed its error
#: (a live rank does within a second, even on a loaded machine; one that has finished or
#: died never does)
CONFIRM_SECONDS = 10.0
#: seconds a rank that heard of another rank's end waits for the abort before it aborts itself
ABORT_AFTER = 5.0


def end_job(message: str, code: int) -> None:
    """Print ``message``, flush this rank's output, give the launcher a second to forward it
    (it kills every rank, and may drop what it had not read, once one aborts), and abort the
    job with ``code``."""
    print(message, file=sys.stderr, flush=True)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream must not stop the abort
            stream.flush()
    time.sleep(1.0)
    if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def stuck_after(limit: float) -> float:
    """Seconds after which a wait is reported to the ranks it waits for: 5 s, or half the
    deadline when that is shorter."""
    return min(5.0, limit / 2)


class Call(NamedTuple):
    """What a blocking wait is, as a peer's report carries it: the communicator (its world
    ranks), the kind of call (``collective``, ``exchange`` or ``other``), the exchange's number
    (the one its messages' tags carry; 0 for none), what the deadline message calls it, and the
    world ranks whose action it needs. Two communicators over the same ranks look alike: a wait
    in one and a wait in the other may be taken for the same call (then the deadline decides),
    never two waits of one call for different calls."""

    group: tuple[int, ...]
    kind: str
    number: int
    what: str
    needs: tuple[int, ...]

    def same_as(self, other: Call) -> bool | None:
        """Whether two ranks' waits are the same call; None when that cannot be told (two
        collectives, or two unnumbered exchanges, on one communicator: MPI pairs the k-th call
        of each rank, whatever they were)."""
        if self.group != other.group or self.kind != other.kind:
            return False
        if self.kind == "exchange" and self.number and other.number:
            return self.number == other.number
        return None

    def describe(self) -> str:
        if self.kind == "exchange" and self.number:
            # the tags' number is (2 x the halo fetch's count, +1 for its backward) mod 510, + 1
            n = self.number - 1
            step = "the backward of" if n % 2 else ""
            return f"{step} halo exchange {n // 2} (mod 255) with ranks {list(self.needs)}".strip()
        return self.what


class _Alarm:
    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.heard_end: float | None = None
        self.ending = False  # this rank is ending with an uncaught error of its own
        self.ending_out = False  # ... and its own message is out (flushed, at exit)
        #: reports of peers' waits: world rank -> (their call, the report's number, the
        #: number of the last report of this rank's they had heard when they sent it)
        self.reports: dict[int, tuple[Call, int, int]] = {}
        #: this rank's waits reported, by when they began: the number of the first report
        self.reported: dict[float, int] = {}
        self.numbered = 0  # the reports this rank has sent (each one's number: the count)
        self.heard: dict[int, int] = {}  # world rank -> the number of its last report here
        self.acked: dict[int, int] = {}  # world rank -> the number our last report to it had heard
        self.sends: list[MPI.Request] = []
        #: ranks whose error this rank heard while ending with its own, not yet confirmed:
        #: confirmed once this rank's own message is out (at exit)
        self.unconfirmed: list[int] = []
        #: ranks told of this rank's error that have not yet confirmed they printed it
        self.awaited: set[int] = set()
        self.told: list[MPI.Request] = []  # kept: each holds its pickled message until sent
        # held while the watchdog thread talks; closed at exit, before mpi4py finalizes MPI
        # (an MPI call racing MPI_Finalize would abort a job that ended well)
        self.lock = threading.Lock()
        self.closed = False

    def close(self) -> None:
        """At exit (before mpi4py ends MPI, or aborts the job after an uncaught error): when
        this rank is ending with an error, flush its output, confirm the errors it heard and
        wait (:data:`CONFIRM_SECONDS` at most) until every rank it told has printed its error."""
        try:
            if self.ending and not MPI.Is_finalized():
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):
                        stream.flush()
                with self.lock:
                    self.ending_out = True
                    for src in self.unconfirmed:
                        self.comm.send(None, dest=src, tag=TAG_SEEN)
                    self.unconfirmed = []
                self._await_confirmations()
        finally:
            with self.lock:
                self.closed = True

    # -- the watchdog thread ------------------------------------------------------------------

    def poll(self, waits: list[tuple[float, float, Call]]) -> str | None:
        """Read what arrived, report this rank's long waits, and return the message to end the
        job with when a peer's report shows that neither rank can go on. ``waits``: this
        process's blocking waits, ``(began, deadline, call)``."""
        with self.lock:
            if self.closed or MPI.Is_finalized():
                return None
            return self._poll(waits)

    def _poll(self, waits: list[tuple[float, float, Call]]) -> str | None:
        status = MPI.Status()
        while self.comm.Iprobe(MPI.ANY_SOURCE, TAG_ERROR, status):
            src = status.Get_source()
            text = self.comm.recv(source=src, tag=TAG_ERROR)
            if not self.ending:  # a rank ending with its own error has printed that one
                print(
                    f"mpidp: rank {self.rank} of {self.size}: the job ends because rank {src} "
                    f"of {self.size} raised an error that nothing caught:\n{text}",
                    file=sys.stderr,
                    flush=True,
                )
            if self.ending and not self.ending_out:
                self.unconfirmed.append(src)  # confirmed when this rank's own message is out
            else:
                self.comm.send(None, dest=src, tag=TAG_SEEN)
            self.heard_end = self.heard_end or time.monotonic()
        now = time.monotonic()
        if self.heard_end is not None and now - self.heard_end > ABORT_AFTER:
            end_job(
                f"mpidp: rank {self.rank} of {self.size}: the failed rank did not end the job "
                f"within {ABORT_AFTER:g} s (not run by python -m mpi4py, or slow to exit); "
                f"aborting it",
                1,
            )
        while self.comm.Iprobe(MPI.ANY_SOURCE, TAG_STUCK, status):
            src = status.Get_source()
            self.reports[src] = self.comm.recv(source=src, tag=TAG_STUCK)
            self.heard[src] = self.reports[src][1]
        self.sends = [r for r in self.sends if not r.Test()]
        live = {began for began, _, _ in waits}
        self.reported = {b: n for b, n in self.reported.items() if b in live}
        for began, limit, call in waits:
            mine = self.reported.get(began)  # the number of this wait's first report
            peers = [r for r in call.needs if r != self.rank]
            asked, verdict = [], None
            for r in peers:
                if r not in self.reports or self.rank not in self.reports[r][0].needs:
                    continue  # no report from r, or not of a wait for this rank
                theirs, number, seen = self.reports[r]
                if mine is not None and seen >= mine:  # sent while both of us waited
                    if call.same_as(theirs) is False:
                        verdict = verdict or (r, theirs)
                        if number > self.acked.get(r, 0):
                            asked.append(r)  # r judges too once it hears that we heard
                elif number > self.acked.get(r, 0):
                    asked.append(r)  # perhaps stale: r judges by the answer
            if mine is None and now - began >= stuck_after(limit):
                asked = peers  # the wait has lasted: every rank it waits for hears of it
            if asked:
                self.numbered += 1
                self.reported.setdefault(began, self.numbered)
                for r in asked:
                    self.acked[r] = self.heard.get(r, 0)
                    self.sends.append(
                        self.comm.isend((call, self.numbered, self.acked[r]), dest=r, tag=TAG_STUCK)
                    )
            if verdict is not None:
                src, theirs = verdict
                return (
                    f"this rank has waited {now - began:.1f} s in {call.describe()} for "
                    f"rank {src}, which is waiting for this rank in another call: "
                    f"{theirs.describe()}. Neither can go on: the ranks are out of step (a "
                    f"collective, a forward or a backward that ran on some ranks only?). "
                    f"Aborting the job now rather than at the {limit:g} s deadline; fix: "
                    f"make every rank run the same collectives and the same forward and "
                    f"backward, in the same order"
                )
        return None

    # -- the rank that fails ------------------------------------------------------------------

    def announce(self, exc_type: type[BaseException], exc: BaseException) -> None:
        """Send the uncaught error to every other rank, without waiting: :meth:`close` waits
        for their confirmations once this rank's own message is out. Main thread, from
        ``sys.excepthook``."""
        if MPI.Is_finalized():
            return
        text = "".join(traceback.format_exception_only(exc_type, exc)).strip()
        others = [r for r in range(self.size) if r != self.rank]
        self.told += [self.comm.isend(text, dest=r, tag=TAG_ERROR) for r in others]
        self.awaited.update(others)

    def _await_confirmations(self) -> None:
        """Wait until every rank told of this rank's error has printed it, for
        :data:`CONFIRM_SECONDS` at most (an unconfirmed send is left to the abort that
        follows)."""
        end = time.monotonic() + CONFIRM_SECONDS
        status = MPI.Status()
        while self.awaited and time.monotonic() < end:
            if self.comm.Iprobe(MPI.ANY_SOURCE, TAG_SEEN, status):
                self.awaited.discard(status.Get_source())
                self.comm.recv(source=status.Get_source(), tag=TAG_SEEN)
            else:
                time.sleep(0.02)


_ALARM: _Alarm | None = None


def installed() -> _Alarm | None:
    return _ALARM


def install(world: MPI.Comm, start_watchdog: Callable[[], None]) -> None:
    """Open the alarm channel (a duplicate of ``world``) and chain ``sys.excepthook`` to send an
    uncaught error to every rank first. Once per process; collective over ``world`` the first
    time. Nothing when the MPI gives no ``MPI_THREAD_MULTIPLE``."""
    global _ALARM
    if _ALARM is not None or world.Get_size() == 1:
        return
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return
    _ALARM = alarm = _Alarm(world.Dup())
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        alarm.ending = True
        previous(exc_type, exc, tb)  # the rank's own message first
        if not issubclass(exc_type, KeyboardInterrupt):
            try:
                alarm.announce(exc_type, exc)
            except Exception:  # never hide the error being reported behind another
                pass

    sys.excepthook = hook
    # atexit runs its handlers last registered first: this one before mpi4py's MPI_Finalize
    atexit.register(alarm.close)
    start_watchdog()
