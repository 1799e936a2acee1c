"""Progress of long work, shown by one rank: a bar redrawn in place when stderr is a terminal,
else one plain line every ``every`` units, so a batch log gets whole lines and no carriage
returns.

    bar = Progress(40, every=5, enabled=manager.rank == 0)
    for step in range(1, 41):
        ...
        bar.update(step, f"loss {loss:.6f}")
    bar.close()

Training, inference rollouts, the sample data writer and ``mpidp plan`` use it.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from types import TracebackType
from typing import TextIO

__all__ = ["Progress"]

_BAR = 30


class Progress:
    """``total`` units of work counted in ``update`` calls.

    Parameters
    ----------
    total:
        The units of work (steps, fields, stages).
    label:
        The unit's name, shown before the count and in the rate (``s/step``).
    prefix:
        Text before every line, e.g. ``"mpidp plan: "``.
    every:
        In a batch log, one line every ``every`` units and at the last; 0 gives about ten lines.
    first:
        The count already done (a resumed run): the rate counts the units after it.
    enabled:
        False shows nothing: pass ``manager.rank == 0`` so that one rank prints.
    rate:
        Whether lines end with the seconds per unit.
    stream:
        Where batch lines and messages go (default: stdout). The bar always goes to stderr.
    delay:
        Show nothing before this many seconds, so that quick work stays quiet; the state at
        that moment is shown then, even if no update comes.
    """

    def __init__(
        self,
        total: int,
        *,
        label: str = "step",
        prefix: str = "",
        every: int = 0,
        first: int = 0,
        enabled: bool = True,
        rate: bool = True,
        stream: TextIO | None = None,
        delay: float = 0.0,
    ) -> None:
        self.total, self.label, self.prefix, self.first = total, label, prefix, first
        self.every = every if every > 0 else max(1, math.ceil(total / 10))
        self.enabled, self.rate = enabled, rate
        self.stream = stream
        self.tty = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.delay = delay
        self.done = first
        self._drawn = 0  # the length of the bar on the terminal's current line
        self._pending: tuple[int, str] | None = None  # the last update not shown yet
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        if enabled and delay > 0:
            self._timer = threading.Timer(delay, self._show_pending)
            self._timer.daemon = True
            self._timer.start()

    def update(self, done: int, text: str = "") -> None:
        """``done`` units are done; ``text`` says what (e.g. the loss)."""
        self.done = done
        if not self.enabled:
            return
        with self._lock:
            if time.perf_counter() - self.t0 < self.delay:
                self._pending = (done, text)
                return
            self._pending = None
            self._show(done, text)

    def advance(self, text: str = "") -> None:
        """One more unit is done (or, for stages, begins): ``update(done + 1, text)``."""
        self.update(self.done + 1, text)

    def message(self, text: str) -> None:
        """A line of its own (clears the bar first on a terminal)."""
        if not self.enabled:
            return
        with self._lock:
            self._clear()
            print(self.prefix + text, file=self.stream or sys.stdout, flush=True)

    def close(self) -> None:
        """Ends the bar's line on a terminal; no later update is shown."""
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            if self._drawn:
                sys.stderr.write("\n")
                sys.stderr.flush()
                self._drawn = 0
            self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def line(self, done: int, text: str = "") -> str:
        """The text shown for ``done`` units: ``step    20/40  loss 0.012345  0.104 s/step``."""
        parts = [f"{self.prefix}{self.label} {done:>5}/{self.total}"]
        if text:
            parts.append(text)
        if self.rate:
            seconds = (time.perf_counter() - self.t0) / max(done - self.first, 1)
            parts.append(f"{seconds:.3f} s/{self.label}")
        return "  ".join(parts)

    def _show(self, done: int, text: str) -> None:
        if self.tty:
            filled = int(_BAR * min(max(done, 0), self.total) / max(self.total, 1))
            bar = "#" * filled + "." * (_BAR - filled)
            shown = f"[{bar}] {self.line(done, text)}"
            sys.stderr.write("\r" + shown.ljust(self._drawn))
            sys.stderr.flush()
            self._drawn = len(shown)
        elif done % self.every == 0 or done == self.total:
            print(self.line(done, text), file=self.stream or sys.stdout, flush=True)

    def _show_pending(self) -> None:
        with self._lock:
            if self.enabled and self._pending is not None:
                self._show(*self._pending)
                self._pending = None

    def _clear(self) -> None:
        if self._drawn:
            sys.stderr.write("\r" + " " * self._drawn + "\r")
            sys.stderr.flush()
            self._drawn = 0
