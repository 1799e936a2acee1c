"""The group of one rank: what an axis of a domain grid with one rank along it is.

Every primitive of :class:`~mpidp.comm.base.Transport` is the identity on one rank (the base
class answers them without a backend), so code written for a grid runs unchanged on bands: the
longitude row of a band is this rank alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpidp.comm.base import Transport

__all__ = ["SelfTransport"]


class SelfTransport(Transport):
    """Collectives over this rank alone (rank 0 of a group of 1). Local."""

    name = "self"
    reports_everywhere = True

    def __init__(self) -> None:
        super().__init__(0, 1)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        self._root(src, "src")
        return obj

    def barrier(self) -> None:
        return None

    def _never(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a one-rank group answers every collective without a backend")

    _all_gather_v = _gather_v = _scatter_v = _all_to_all_v = _never
    _reduce_scatter_v = _all_reduce = _broadcast = _start_exchange = _never

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        return [[int(v) for v in values]]
