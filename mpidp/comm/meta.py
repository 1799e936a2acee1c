"""The transport of meta tensors: shapes move, values do not (what ``mpidp explain`` runs on).

A model run on meta ShardedTensors (``torch.device("meta")``: shapes and dtypes, no storage)
calls the same collectives as a real run; :class:`MetaTransport` answers each with a meta
tensor of the shape the real call would return on this rank, computed from the sizes every
rank passes, and sends nothing. Objects and integers (the agreement steps, which carry shapes
and checks, not tensor values) go through the CPU transport of the same group, so every rank
still sees every other rank's facts. Wrapped in a
:class:`~mpidp.comm.counting.CountingTransport`, it counts the bytes the real call would send.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpidp.comm.base import Transport

__all__ = ["MetaTransport", "SoloTransport"]


def _meta(rows: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty((rows, *like.shape[1:]), dtype=like.dtype, device="meta")


class MetaTransport(Transport):
    """Shape-only collectives over ``inner``'s group; ``inner`` carries the objects."""

    name = "meta"

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner.rank, inner.size)
        self.inner = inner

    def __repr__(self) -> str:
        return f"MetaTransport({self.inner!r})"

    @property
    def default_device(self) -> torch.device:
        return torch.device("meta")

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        return self.inner.all_gather_ints(values)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.inner.all_gather_object(obj)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.inner.broadcast_object(obj, src)

    def barrier(self) -> None:
        self.inner.barrier()

    def _all_gather_v(
        self, x: torch.Tensor, sizes: list[int], problem: str | None = None
    ) -> torch.Tensor:
        return _meta(sum(sizes), x)

    def _gather_v(
        self, x: torch.Tensor, sizes: list[int], dst: int, problem: str | None = None
    ) -> torch.Tensor | None:
        return _meta(sum(sizes), x) if self.rank == dst else None

    def _scatter_v(
        self,
        x: torch.Tensor | None,
        sizes: list[int],
        src: int,
        rest: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        return torch.empty((sizes[self.rank], *rest), dtype=dtype, device="meta")

    def _all_to_all_v(
        self, x: torch.Tensor, send: list[int], recv: list[int], problem: str | None = None
    ) -> torch.Tensor:
        return _meta(sum(recv), x)

    def _reduce_scatter_v(
        self, x: torch.Tensor, sizes: list[int], op: str, problem: str | None = None
    ) -> torch.Tensor:
        return _meta(sizes[self.rank], x)

    def _all_reduce(self, x: torch.Tensor, op: str, src: torch.Tensor | None = None) -> None:
        return None

    def _broadcast(self, x: torch.Tensor, src: int) -> None:
        return None

    def _start_exchange(
        self,
        sends: list[tuple[int, int, torch.Tensor]],
        recvs: list[tuple[int, int, torch.Tensor]],
    ) -> Callable[[], None]:
        return lambda: None


class SoloTransport(Transport):
    """One rank of a group of ``size``, simulated alone in this process (a dry run of every
    rank in turn): the agreement steps answer as a consistent run does (every rank passed what
    this one passes), objects come back as this rank's; tensors never move (wrap it in a
    :class:`MetaTransport`, which answers collectives of meta tensors with their shapes)."""

    name = "solo"

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        return [list(values)] * self.size

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj] * self.size

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        return None

    def _no_data(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a simulated rank moves no data: wrap it in a MetaTransport")

    _all_gather_v = _gather_v = _scatter_v = _all_to_all_v = _no_data
    _reduce_scatter_v = _all_reduce = _broadcast = _start_exchange = _no_data
