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
from typing import TYPE_CHECKING, Any

from mpidp.comm import alarm
from mpidp.errors import CommError

if TYPE_CHECKING:
    from mpidp.comm.mpi import MPITransport

__all__ = ["DEFAULT_DEADLINE", "deadline", "deadline_seconds", "start_watchdog"]

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
            waits = list(self.waits.values())
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
