"""The ``all_gather_v`` of the MPI transport on three and four ranks: the rank agreement in
messages of its own beside the rows, one wait, instead of a check all-reduce before the
``Allgatherv`` (:meth:`mpidp.comm.mpi.MPITransport._gather`; two ranks:
:mod:`mpidp.comm.pair_gather`).

The headers cannot ride in the ``Allgatherv`` itself: with counts that disagree between ranks
(the case the check exists for) the collective is erroneous MPI, and whether every rank then
sees every header is not defined. Point-to-point messages are defined whatever their lengths:
each rank sends every peer its 16-byte header (its facts' fingerprint and whether its own check
failed) and then its rows, and receives the same from every peer, the rows straight into the
result. A header is 16 bytes whatever the ranks passed, so every rank receives every peer's; a
rows message of another length than expected completes short or truncated, never unmatched.
When any two ranks' facts differ, each rank's own fingerprint differs from at least one of the
two it received, so every rank finds the disagreement, and all raise the same
:class:`~mpidp.CommError`; a rows message of the wrong length implies such a difference (or a
failed own check, whose flag every rank reads). ``2 (P - 1)`` messages each way: meant for
small groups (:data:`FEW`), where the check all-reduce's extra round costs more.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from mpi4py import MPI

from mpidp.comm.agreement import disagreement
from mpidp.comm.deadline import Armed
from mpidp.comm.pair_gather import PAIR_TAG

if TYPE_CHECKING:
    from mpidp.comm.mpi import MPITransport

__all__ = ["FEW", "Few", "few_gather", "few_of"]

#: the largest group that gathers this way (more: the check all-reduce, then ``Allgatherv``)
FEW = 4


class Few(NamedTuple):
    """What an ``all_gather_v`` of one call's facts on a few ranks needs, made once."""

    like: torch.Tensor  # a memoryless tensor of the result's shape and dtype (torch.empty_like)
    small: bool  # whether the result is small enough for torch.empty (not the buffer cache)
    counts: list[int]  # bytes of each rank's rows
    displs: list[int]  # where they go in the result
    peers: list[int]  # every rank but this one
    head: np.ndarray  # this rank's header (int64 x 2)
    heads: np.ndarray  # every rank's header as received (this rank's row: the expected one)
    views: list[np.ndarray]  # each peer's row of ``heads``
    want: bytes  # ``heads`` when every rank agrees
    statuses: list[MPI.Status]  # each request's (peer i's rows message's: 2 i + 1)
    armed: Armed  # the deadline of the plan's wait


def few_of(
    t: MPITransport,
    x: torch.Tensor,
    shape: tuple[int, ...],
    counts: list[int],
    displs: list[int],
    fp: int,
) -> Few:
    """The kept plan of ``t``'s gather of ``counts`` bytes per rank (``displs`` apart) into a
    result of ``shape`` and ``x``'s dtype, for this rank, whose facts' fingerprint is ``fp``."""
    peers = [j for j in range(t.size) if j != t.rank]
    heads = np.zeros((t.size, 2), dtype=np.int64)
    heads[:, 0] = fp
    return Few(
        like=torch.empty((), dtype=x.dtype).expand(shape),
        small=sum(counts) < t.buffers.min_bytes,
        counts=counts,
        displs=displs,
        peers=peers,
        head=np.array([fp, 0], dtype=np.int64),
        heads=heads,
        views=[heads[j] for j in range(t.size)],
        want=heads.tobytes(),
        statuses=[MPI.Status() for _ in range(4 * len(peers))],
        armed=Armed(t, "all_gather_v", "collective"),
    )


def few_gather(
    t: MPITransport, f: Few, facts: tuple[Any, ...], x: torch.Tensor, problem: str | None = None
) -> torch.Tensor:
    """Every rank's rows in a new tensor, as ``f`` says; raises the same CommError on every
    rank when their facts, row counts or own checks differ. ``problem`` (this rank's own check
    failed) only with a plan made for the call: it is written into the plan's header."""
    out = torch.empty_like(f.like) if f.small else t._new(f.like.shape, f.like.dtype)
    base, src, me = out.data_ptr(), x.data_ptr(), t.rank
    mine = f.counts[me]  # x has these bytes: its own check made it so
    if mine:
        ctypes.memmove(base + f.displs[me], src, mine)
    if problem is not None:
        f.head[1] = 1
    comm, rows = t.comm, MPI.buffer.fromaddress(src, mine)
    # the header first on both sides: each peer's two messages meet their receives in order
    reqs = []
    for j in f.peers:
        reqs.append(comm.Irecv(f.views[j], j, PAIR_TAG))
        reqs.append(
            comm.Irecv(MPI.buffer.fromaddress(base + f.displs[j], f.counts[j]), j, PAIR_TAG)
        )
    for j in f.peers:
        reqs.append(comm.Isend(f.head, j, PAIR_TAG))
        reqs.append(comm.Isend(rows, j, PAIR_TAG))
    failure = None
    armed = f.armed
    armed.n += 1
    try:
        MPI.Request.Waitall(reqs, f.statuses)
    except MPI.Exception as exc:  # a longer rows message than expected: truncated
        failure = exc
        for req in reqs:  # any the failed wait left pending (completed ones are null now)
            try:
                req.Wait()
            except MPI.Exception:
                pass
    finally:
        armed.n += 1
    bad = failure is not None or problem is not None or f.heads.tobytes() != f.want
    for i, j in enumerate(f.peers):
        bad = bad or f.statuses[2 * i + 1].Get_count(MPI.BYTE) != f.counts[j]
    if bad:
        everyone = t.comm.allgather((facts, problem))
        raise disagreement(t._where(), "all_gather_v", everyone, problem is not None)
    return out
