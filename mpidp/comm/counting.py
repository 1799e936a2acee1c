"""A transport that counts what it sends: the communication budget of tests and benchmarks.

:class:`CountingTransport` wraps any transport and records, per primitive, the calls made and
the bytes this rank hands to the backend; everything else is the wrapped transport's. What is
counted is what leaves the public interface for the wire, so a layer that gathers the whole
field shows it however it got there.

* point to point (``exchange``): one message per send to another rank, its bytes;
* collectives: one call each, the bytes this rank contributes (its part for ``all_gather_v``,
  ``gather_v`` and ``all_to_all_v`` without the part kept for itself; the whole tensor for
  ``reduce_scatter_v``, ``all_reduce`` and on the root of ``scatter_v`` / ``broadcast``);
* object collectives: one call each, the pickled size of what this rank passes.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpidp.comm.base import Transport

__all__ = ["CountingTransport", "Traffic"]


@dataclasses.dataclass
class Traffic:
    """What one rank sent: per primitive name, ``[calls or messages, bytes]``."""

    ops: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    def add(self, op: str, count: int, nbytes: int) -> None:
        entry = self.ops.setdefault(op, [0, 0])
        entry[0] += count
        entry[1] += nbytes

    @property
    def messages(self) -> int:
        """Point-to-point messages plus collective calls."""
        return sum(count for count, _ in self.ops.values())

    @property
    def bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.ops.values())

    @property
    def p2p_messages(self) -> int:
        return self.ops.get("exchange", [0, 0])[0]

    @property
    def p2p_bytes(self) -> int:
        return self.ops.get("exchange", [0, 0])[1]

    def collective_calls(self) -> dict[str, int]:
        """Calls per collective (everything but point to point)."""
        return {op: c for op, (c, _) in self.ops.items() if op != "exchange"}

    def clear(self) -> None:
        self.ops.clear()

    def __repr__(self) -> str:
        per_op = ", ".join(f"{op}: {c} x / {b} B" for op, (c, b) in sorted(self.ops.items()))
        return f"Traffic({self.messages} messages, {self.bytes} B; {per_op})"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CountingTransport(Transport):
    """``inner`` with every byte it sends recorded in ``traffic`` (see the module docstring).

    The same rank, size, name and allocator as ``inner``; messages and results are unchanged.
    """

    def __init__(self, inner: Transport, traffic: Traffic | None = None) -> None:
        super().__init__(inner.rank, inner.size)
        self.inner = inner
        self.name = inner.name
        self.traffic = traffic if traffic is not None else Traffic()

    def __repr__(self) -> str:
        return f"CountingTransport({self.inner!r})"

    @property
    def default_device(self) -> torch.device:
        return self.inner.default_device

    def scratch(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        return self.inner.scratch(shape, dtype, device)

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        if self.size > 1:
            self.traffic.add("all_gather_ints", 1, 8 * len(values))
        return self.inner.all_gather_ints(values)

    def all_gather_object(self, obj: Any) -> list[Any]:
        self.traffic.add("all_gather_object", 1, len(pickle.dumps(obj)))
        return self.inner.all_gather_object(obj)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        sent = len(pickle.dumps(obj)) if self.rank == src else 0
        self.traffic.add("broadcast_object", 1, sent)
        return self.inner.broadcast_object(obj, src)

    def barrier(self) -> None:
        self.traffic.add("barrier", 1, 0)
        self.inner.barrier()

    @property
    def reports_everywhere(self) -> bool:  # type: ignore[override]
        return self.inner.reports_everywhere

    # -- backend primitives (group size > 1), counted then delegated -------------------------

    def _row(self, x: torch.Tensor) -> int:
        return _nbytes(x) // x.shape[0] if x.shape[0] else 0

    def _all_gather_v(
        self, x: torch.Tensor, sizes: list[int], problem: str | None = None
    ) -> torch.Tensor:
        self.traffic.add("all_gather_v", 1, _nbytes(x))
        return self.inner._all_gather_v(x, sizes, problem)

    def _gather_v(
        self, x: torch.Tensor, sizes: list[int], dst: int, problem: str | None = None
    ) -> torch.Tensor | None:
        self.traffic.add("gather_v", 1, 0 if self.rank == dst else _nbytes(x))
        return self.inner._gather_v(x, sizes, dst, problem)

    def _scatter_v(
        self,
        x: torch.Tensor | None,
        sizes: list[int],
        src: int,
        rest: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        sent = 0 if x is None else _nbytes(x) - self._row(x) * sizes[self.rank]
        self.traffic.add("scatter_v", 1, sent)
        return self.inner._scatter_v(x, sizes, src, rest, dtype, device)

    def _all_to_all_v(
        self, x: torch.Tensor, send: list[int], recv: list[int], problem: str | None = None
    ) -> torch.Tensor:
        self.traffic.add("all_to_all_v", 1, self._row(x) * (sum(send) - send[self.rank]))
        return self.inner._all_to_all_v(x, send, recv, problem)

    def _reduce_scatter_v(
        self, x: torch.Tensor, sizes: list[int], op: str, problem: str | None = None
    ) -> torch.Tensor:
        self.traffic.add("reduce_scatter_v", 1, _nbytes(x))
        return self.inner._reduce_scatter_v(x, sizes, op, problem)

    def _all_reduce(self, x: torch.Tensor, op: str, src: torch.Tensor | None = None) -> None:
        self.traffic.add("all_reduce", 1, _nbytes(x))
        self.inner._all_reduce(x, op, src)

    def _broadcast(self, x: torch.Tensor, src: int) -> None:
        self.traffic.add("broadcast", 1, _nbytes(x) if self.rank == src else 0)
        self.inner._broadcast(x, src)

    def _start_exchange(
        self,
        sends: list[tuple[int, int, torch.Tensor]],
        recvs: list[tuple[int, int, torch.Tensor]],
    ) -> Callable[[], None]:
        self.traffic.add("exchange", len(sends), sum(_nbytes(t) for _, _, t in sends))
        return self.inner._start_exchange(sends, recvs)
