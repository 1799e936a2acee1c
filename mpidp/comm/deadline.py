"""The deadline of every blocking MPI wait: ``with deadline(t, what):`` registers the wait
with one daemon thread per process (:class:`_Watchdog`), which ends the job with a message
naming the call when it outlives the transport's ``timeout`` (``MPIDP_TIMEOUT``), or when
:mod:`mpidp.comm.alarm` learns from a peer that the ranks wait in different calls. A blocked MPI
call cannot be interrupted, so aborting is the only way out of a hang.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from mpidp.comm import alarm
from mpidp.errors import CommError

if TYPE_CHECKING:
    from mpidp.comm.mpi import MPITransport

__all__ = ["DEFAULT_DEADLINE", "Armed", "deadline", "deadline_seconds", "start_watchdog"]

#: Seconds a blocking call waits before the job is aborted, unless the manager or env says.
DEFAULT_DEADLINE = 600.0


def deadline_seconds(default: float = DEFAULT_DEADLINE) -> float:
    """``MPIDP_TIMEOUT`` (seconds) when set, else ``default``."""
    raw = os.environ.get("MPIDP_TIMEOUT", "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise CommError(f"MPIDP_TIMEOUT={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise CommError(f"MPIDP_TIMEOUT={raw!r} must be positive")
    return value


class _Watchdog:
    """One daemon thread per process that ends the job when a blocking MPI call outlives its
    deadline. A blocked MPI call cannot be interrupted, so the thread prints what the call was
    and aborts the job (``MPI_Abort``), like an uncaught error under ``python -m mpi4py``.
    A call costs two attribute writes; the thread looks twice a second."""

    def __init__(self) -> None:
        #: thread -> (began, deadline, what, transport, kind, number, needs): the kind of call
        #: (``collective``, ``exchange``: ``number`` is its tags' number; ``other``) and the
        #: ranks of the group it waits for (None: all), for :mod:`mpidp.comm.alarm`
        self.waits: dict[int, tuple[float, float, object, MPITransport, str, int, Any]] = {}
        #: the registered Armed slots, by id (weakly: a slot goes with the plan that holds it)
        self.slots: dict[int, weakref.ref[Armed]] = {}
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="mpidp-deadline", daemon=True)
                self.thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            waits = list(self.waits.values()) + self._armed(now)
            for began, limit, what, t, _, _, _ in waits:
                if now - began > limit:
                    alarm.end_job(
                        f"mpidp CommTimeout: {t._where()} (MPI group of {t.size}): {what} did not "
                        f"complete after {now - began:.1f} s (deadline {limit:g} s): another "
                        f"rank of the group has not entered the same call (it skipped it, is "
                        f"stuck, or died). Aborting the job. Raise the limit with MPIDP_TIMEOUT "
                        f"or the manager's timeout if such a wait is expected",
                        75,
                    )
            listener = alarm.installed()
            if listener is not None:
                calls = [(w[0], w[1], _call_of(*w[2:])) for w in waits]
                verdict = listener.poll(calls)
                if verdict is not None:
                    t = next(w[3] for w in waits)
                    alarm.end_job(
                        f"mpidp CommDeadlock: {t._where()} (MPI group of {t.size}): {verdict}", 75
                    )

    def _armed(self, now: float) -> list[tuple[float, float, object, MPITransport, str, int, Any]]:
        """The armed slots' waits, each timed from when this thread first saw it armed (at most
        one look, half a second, after it began)."""
        out = []
        for ref in list(self.slots.values()):
            s = ref()
            if s is None:
                continue
            n = s.n
            if n & 1:
                if s.seen != n:
                    s.seen, s.since = n, now
                out.append((s.since, s.t.timeout, s.what, s.t, s.kind, s.number, s.needs))
        return out


_WATCHDOG = _Watchdog()


def start_watchdog() -> None:
    """Start the deadline's thread now (it also listens for :mod:`.alarm`'s messages)."""
    _WATCHDOG.start()


def _call_of(what: object, t: MPITransport, kind: str, number: int, needs: Any) -> alarm.Call:
    """A wait as a peer's report carries it (made only for the watchdog, never per call)."""
    ranks = t.world_ranks if needs is None else tuple(t.world_ranks[r] for r in needs)
    return alarm.Call(t.world_ranks, kind, number, str(what), ranks)


class deadline:
    """``with deadline(t, what):`` runs a blocking MPI wait under ``t``'s deadline (see
    :class:`_Watchdog`). A class, not a generator: it is entered on every call."""

    __slots__ = ("key",)

    def __init__(
        self,
        t: MPITransport,
        what: object,
        kind: str = "other",
        number: int = 0,
        needs: Any = None,
    ) -> None:
        if _WATCHDOG.thread is None:
            _WATCHDOG.start()
        self.key = threading.get_ident()
        _WATCHDOG.waits[self.key] = (time.monotonic(), t.timeout, what, t, kind, number, needs)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        _WATCHDOG.waits.pop(self.key, None)


class Armed:
    """A blocking wait registered once with the watchdog, for a call repeated with the same
    facts: ``slot.n += 1`` before the wait and again after it (the count odd: waiting) arms and
    disarms it with no function call, where :class:`deadline` costs six a wait (1.6 us here).
    The watchdog times an armed wait from its first look at it, so the deadline fires at most
    half a second later than :class:`deadline`'s. Arm it in ``try`` / ``finally``. One wait at
    a time: a slot belongs to a plan that one thread runs at a time (its buffers are kept
    too)."""

    __slots__ = ("__weakref__", "kind", "n", "needs", "number", "seen", "since", "t", "what")

    def __init__(
        self, t: MPITransport, what: object, kind: str = "other", needs: Any = None
    ) -> None:
        self.n = 0  # odd while the wait runs
        self.seen = 0  # the count the watchdog last saw odd, and when it first did
        self.since = 0.0
        self.t, self.what, self.kind = t, what, kind
        #: the exchange's number (its tags'), written before each wait; the ranks it waits
        #: for (None: all): what :mod:`mpidp.comm.alarm` compares between ranks
        self.number, self.needs = 0, needs
        key = id(self)
        slots = _WATCHDOG.slots
        slots[key] = weakref.ref(self, lambda _: slots.pop(key, None))
        if _WATCHDOG.thread is None:
            _WATCHDOG.start()
