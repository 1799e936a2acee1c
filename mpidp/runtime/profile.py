"""Where each rank's step goes: compute, communication, waiting for the slowest peer.

    with mpidp.profile(manager) as prof:
        for x, y in loader:
            with prof.step():
                ...  # the training step, unchanged
    print(prof.summary())                 # collective: one table, every rank's figures
    policy = mpidp.rebalance(manager, prof.rank_seconds(), rows=lat)

Inside the block the manager hands out :class:`~mpidp.comm.timing.TimingTransport` wrappers
(the mechanism of :func:`mpidp.testing.count_traffic`), so all of mpidp's communication is
timed without a change to the model or the loop; ``prof.step()`` reads the wall clock and the
communication clock at a step's start and end. That is two clock reads per step and per
communication call, and no communication: the ranks exchange their figures only when asked
(:meth:`Profile.report`). How the wait is told from the transfer: :mod:`.profile_report`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from mpidp.comm.timing import HALO_WAIT, CommClock, TimingTransport
from mpidp.runtime.manager import DistributedManager, get_manager
from mpidp.runtime.profile_report import ProfileReport
from mpidp.runtime.transports import wrapped_transports

__all__ = ["Profile", "profile"]


class Profile:
    """Per-step wall and communication seconds of this rank (see the module docstring).

    Enter it once around the training loop and wrap each step in :meth:`step`. ``group``: the
    ranks whose figures :meth:`report` gathers (default the domain group, whose cut
    :func:`mpidp.rebalance` changes). On a CUDA device each step ends with a
    ``torch.cuda.synchronize()`` so that the step's kernels count in its time.
    """

    def __init__(self, manager: DistributedManager | None = None, *, group: Any = None) -> None:
        self.manager = manager or get_manager()
        self.group = group
        self.clock = CommClock()
        self.step_seconds: list[float] = []
        self.comm_seconds: list[float] = []
        #: per step: seconds waiting for overlapped halo messages (manager.overlap), part of comm
        self.halo_wait_seconds: list[float] = []
        self._block: contextlib.ExitStack | None = None
        self._wrappers: dict[int, Any] = {}  # the same wrappers each time the block is entered
        self._cuda = self.manager.device.type == "cuda"

    def __repr__(self) -> str:
        return (
            f"Profile(rank={self.manager.rank}, steps={len(self.step_seconds)}, "
            f"comm_calls={self.clock.calls})"
        )

    def __enter__(self) -> Profile:
        if self._block is not None:
            raise RuntimeError(f"rank {self.manager.rank}: this profile is already entered")
        stack = contextlib.ExitStack()
        stack.enter_context(
            wrapped_transports(
                self.manager, lambda inner: TimingTransport(inner, self.clock), self._wrappers
            )
        )
        self._block = stack
        return self

    def __exit__(self, *exc: object) -> None:
        block, self._block = self._block, None
        if block is not None:
            block.close()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Time one step: its wall seconds, the communication seconds inside it, and of those
        the seconds waiting for overlapped halo messages. Local."""
        c0, w0 = self.clock.seconds, HALO_WAIT.seconds
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._cuda:
                torch.cuda.synchronize(self.manager.device)
            self.step_seconds.append(time.perf_counter() - t0)
            self.comm_seconds.append(self.clock.seconds - c0)
            self.halo_wait_seconds.append(HALO_WAIT.seconds - w0)

    def reset(self) -> None:
        """Forget the steps recorded so far (a new phase: after a warm-up or a new cut)."""
        self.step_seconds.clear()
        self.comm_seconds.clear()
        self.halo_wait_seconds.clear()

    def _transport(self) -> Any:
        # the manager's own transport: the exchange of figures is not a step's communication
        return DistributedManager.transport(self.manager, self.group, "cpu")

    def report(self) -> ProfileReport:
        """Every rank's figures, the same on every rank. Collective over ``group`` (one
        all-gather of two floats per step and rank)."""
        mine = (list(self.step_seconds), list(self.comm_seconds))
        return ProfileReport.of(self._transport().all_gather_object(mine))

    def rank_seconds(self) -> list[float]:
        """Each rank's mean compute seconds per step, the input of :func:`mpidp.rebalance`.
        Collective over ``group``; with the default group and several data-parallel replicas,
        over the whole world: each domain rank's seconds are the slowest replica's (the
        replicas share one cut, and the slowest replica sets the step)."""
        seconds = self.report().rank_seconds()
        if self.group is None and self.manager.dp_world_size > 1:
            every = DistributedManager.transport(self.manager, "dp", "cpu")
            seconds = [max(col) for col in zip(*every.all_gather_object(seconds), strict=True)]
        return seconds

    def summary(self) -> str:
        """The table of mean compute, comm and wait per step, one line per rank. Collective
        over ``group``."""
        return self.report().table()

    def to_json(self, path: str | os.PathLike[str], root: int = 0) -> ProfileReport:
        """Write every rank's figures to ``path`` (by rank ``root`` of ``group``; read back by
        :meth:`ProfileReport.from_json` and ``mpidp profile-report``). Collective over
        ``group``."""
        report = self.report()
        if self._transport().rank == root:
            report.to_json(path)
        return report


def profile(manager: DistributedManager | None = None, *, group: Any = None) -> Profile:
    """A :class:`Profile` of ``manager``'s communication (default: the initialised manager);
    use it as a context manager around the training loop and ``prof.step()`` around each
    step. Entering and timing are local; the figures meet in :meth:`Profile.report`."""
    return Profile(manager, group=group)
