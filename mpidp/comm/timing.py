"""A transport that times its communication: what :func:`mpidp.profile` reads.

:class:`TimingTransport` wraps any transport and adds to one :class:`CommClock` the wall
seconds this rank spends inside the backend: every collective and object collective, the
posting of a point-to-point exchange and its ``wait()`` (the computation between the two, the
overlap, is not communication). Only the backend primitives are timed, so checks and copies
made by :class:`~mpidp.comm.base.Transport` count as compute, and nested public calls are not
counted twice. Two ``perf_counter`` calls per primitive: cheap enough to stay on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpidp.comm.base import PendingExchange, Transport

__all__ = ["HALO_WAIT", "CommClock", "HaloWait", "TimingTransport"]


@dataclasses.dataclass
class CommClock:
    """Seconds spent communicating and the calls that spent them (one rank, local)."""

    seconds: float = 0.0
    calls: int = 0


@dataclasses.dataclass
class HaloWait:
    """Seconds this process spent in the waits of overlapped halo exchanges
    (:mod:`mpidp.ops.halo_overlap`: the communication the interior rows did not hide), and how
    many waits."""

    seconds: float = 0.0
    waits: int = 0


#: the process's clock of overlapped halo waits; a step's share is the difference of two reads
#: (:meth:`mpidp.runtime.profile.Profile.step` records it)
HALO_WAIT = HaloWait()


class TimingTransport(Transport):
    """``inner`` with the seconds of every backend call added to ``clock`` (see the module
    docstring). The same rank, size, name and allocator as ``inner``; results are unchanged."""

    def __init__(self, inner: Transport, clock: CommClock | None = None) -> None:
        self.inner = inner
        kept = inner.fetches
        super().__init__(inner.rank, inner.size)
        inner.fetches = kept  # the exchange numbers go on where they were (see fetches)
        self.name = inner.name
        self.whole = inner.whole
        self.clock = clock if clock is not None else CommClock()

    def __repr__(self) -> str:
        return f"TimingTransport({self.inner!r})"

    def _timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.clock.seconds += time.perf_counter() - t0
            self.clock.calls += 1

    @property
    def fetches(self) -> int:
        """The inner transport's count: halo exchanges made with and without the wrapper
        keep one numbering, as on the peers."""
        return self.inner.fetches

    @fetches.setter
    def fetches(self, value: int) -> None:
        self.inner.fetches = value

    @property
    def default_device(self) -> torch.device:
        return self.inner.default_device

    @property
    def reports_everywhere(self) -> bool:  # type: ignore[override]
        return self.inner.reports_everywhere

    def scratch(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        return self.inner.scratch(shape, dtype, device)

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        if self.size == 1:  # no message (as the base class): not communication
            return self.inner.all_gather_ints(values)
        return self._timed(self.inner.all_gather_ints, values)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self._timed(self.inner.all_gather_object, obj)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self._timed(self.inner.broadcast_object, obj, src)

    def barrier(self) -> None:
        self._timed(self.inner.barrier)

    def all_gather_v(
        self, tensor: torch.Tensor, sizes: Sequence[int], dim: int = 0
    ) -> torch.Tensor:
        # the inner transport's own public call: the MPI one keeps a fast path for repeats
        return self._timed(self.inner.all_gather_v, tensor, sizes, dim)

    # -- backend primitives (group size > 1), timed then returned ------------------------------

    def _all_gather_v(
        self, x: torch.Tensor, sizes: list[int], problem: str | None = None
    ) -> torch.Tensor:
        return self._timed(self.inner._all_gather_v, x, sizes, problem)

    def _gather_v(
        self, x: torch.Tensor, sizes: list[int], dst: int, problem: str | None = None
    ) -> torch.Tensor | None:
        return self._timed(self.inner._gather_v, x, sizes, dst, problem)

    def _scatter_v(
        self,
        x: torch.Tensor | None,
        sizes: list[int],
        src: int,
        rest: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        return self._timed(self.inner._scatter_v, x, sizes, src, rest, dtype, device)

    def _all_to_all_v(
        self, x: torch.Tensor, send: list[int], recv: list[int], problem: str | None = None
    ) -> torch.Tensor:
        return self._timed(self.inner._all_to_all_v, x, send, recv, problem)

    def _reduce_scatter_v(
        self, x: torch.Tensor, sizes: list[int], op: str, problem: str | None = None
    ) -> torch.Tensor:
        return self._timed(self.inner._reduce_scatter_v, x, sizes, op, problem)

    def _all_reduce(self, x: torch.Tensor, op: str, src: torch.Tensor | None = None) -> None:
        self._timed(self.inner._all_reduce, x, op, src)

    def start_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> PendingExchange:
        # the inner transport's (the MPI one does not block); its posting and wait timed
        pending = self._timed(self.inner.start_all_reduce, tensor, op)
        return PendingExchange(lambda: self._timed(pending.wait))

    def _broadcast(self, x: torch.Tensor, src: int) -> None:
        self._timed(self.inner._broadcast, x, src)

    def _start_exchange(
        self,
        sends: list[tuple[int, int, torch.Tensor]],
        recvs: list[tuple[int, int, torch.Tensor]],
    ) -> Callable[[], None]:
        waiter = self._timed(self.inner._start_exchange, sends, recvs)

        def wait() -> None:
            self._timed(waiter)

        return wait
