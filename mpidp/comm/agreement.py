"""How a transport's collectives agree on their arguments: the fingerprint of what a rank
passed (the MPI transport all-reduces it, or carries it in a message's header), the checksum of
named facts :meth:`~mpidp.comm.Transport.agree` all-gathers, the weights that let an all-reduce
check an all-to-all's counts, and the one error every rank raises when they differ.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

from mpidp.errors import CommError

__all__ = ["disagreement", "facts_checksum", "fingerprint", "pair_weight"]

_FINGERPRINTS: dict[tuple[Any, ...], int] = {}


def facts_checksum(facts: Mapping[str, Any]) -> int:
    """The checksum :meth:`Transport.agree` all-gathers for ``facts`` (a caller that repeats a
    call may keep it and all-gather the same ints itself)."""
    return zlib.crc32(repr(sorted(facts.items(), key=lambda kv: kv[0])).encode())


def fingerprint(facts: tuple[Any, ...]) -> int:
    """A 31-bit hash of what a rank passed to a collective (cached: calls repeat)."""
    fp = _FINGERPRINTS.get(facts)
    if fp is None:
        fp = zlib.crc32(repr(facts).encode()) & 0x7FFFFFFF
        if len(_FINGERPRINTS) > 4096:  # many distinct calls: start over
            _FINGERPRINTS.clear()
        _FINGERPRINTS[facts] = fp
    return fp


def pair_weight(src: int, dst: int, size: int) -> int:
    """A pseudo-random weight per (sender, receiver): sums of counts weighted by it agree on
    every rank exactly when every receive count matches its send count (all-to-all)."""
    return ((src * size + dst) * 2654435761 + 97) % 1_000_003 + 1


def disagreement(
    where: str, what: str, everyone: list[tuple[Any, str | None]], mine: bool
) -> CommError:
    """The error every rank raises when a collective's fingerprint check fails: ``everyone``
    is each rank's ``(facts, problem)``; ``mine`` says this rank's own check failed."""
    problems = [p for _, p in everyone if p is not None]
    if problems:
        return CommError(
            problems[0]
            if mine and len(problems) == 1
            else f"{where}: {what} cannot run: " + "; ".join(problems)
        )
    lines = "; ".join(f"rank {r}: {f}" for r, (f, _) in enumerate(everyone))
    return CommError(
        f"{where}: the ranks of this group called {what} with different arguments ({lines}); "
        f"every rank must pass the same sizes, dtype and row shape (and matching send and "
        f"receive counts): the result would be garbage"
    )
