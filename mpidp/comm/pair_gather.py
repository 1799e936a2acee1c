"""The two-rank ``all_gather_v`` of the MPI transport: one message each way, its rank agreement
in a 16-byte header beside the rows (:meth:`mpidp.comm.mpi.MPITransport._gather`).

Each rank sends its peer one message, its facts' fingerprint and whether its own check failed
(the header) joined to its rows: rank 0 sends header then rows, rank 1 rows then header, so that
the message lands whole in the receiver's result storage, the header just outside the result
(before it on rank 1, which keeps rank 0's rows first; after it on rank 0). Its length depends on
nothing the ranks could disagree on but the rows, so every message meets its receive whatever
the ranks passed (a longer one than expected completes with a truncation error); both ranks
always complete, compare the header and the byte count with their own and raise the same
:class:`~mpidp.CommError` when either differs. One ``Sendrecv``: a single wait, as the raw
``Allgatherv``'s (two messages each way cost a second turn of the scheduler when MPICH sleeps
while it waits: 202 against 129 us for 1 KB at P = 2 here; one message: 136).

Small rows (at most :data:`COPY_BYTES`) are copied into a send buffer kept with the call's
facts, header in place; larger ones travel from the tensor itself, joined to the header by a
datatype made for the call (3 us, no copy).
"""

from __future__ import annotations

import ctypes
import math
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from mpi4py import MPI

from mpidp.comm.agreement import disagreement
from mpidp.comm.deadline import deadline

if TYPE_CHECKING:
    from mpidp.comm.mpi import MPITransport

__all__ = ["PAIR_TAG", "Pair", "pair_gather", "pair_of"]

#: bytes of the header: the fingerprint and the own-check flag, two int64 (a multiple of every
#: dtype's size, so the result storage keeps its elements aligned)
HEADER = 16

#: rows of at most this many bytes are copied into the kept send buffer, larger ones are sent
#: from the tensor by a per-call datatype
COPY_BYTES = 1 << 16

#: the header's bytes read in place (ctypes.string_at is a Python function: a frame a call)
_HEAD = ctypes.c_char * HEADER

#: the message's tag: above every numbered exchange's, within the 32767 MPI guarantees
PAIR_TAG = 32767


class Pair(NamedTuple):
    """What a two-rank ``all_gather_v`` of one call's facts needs, made once (byte offsets are
    from the start of the result's storage)."""

    numel: int  # elements of the result
    small: bool  # whether its storage is small enough for torch.empty (not the buffer cache)
    pad: int  # elements of the header slot in the storage
    strides: tuple[int, ...]  # the result's (contiguous)
    lead: int  # element offset of the result in its storage
    own_at: int  # where this rank's rows go
    mine: int  # their bytes
    recv_at: int  # where the peer's message lands
    recv_n: int  # its bytes: the peer's rows and the header
    head_at: int  # where the peer's header lands
    want: bytes  # the header this rank expects: its own fingerprint, no failed check
    send: Any  # the kept send buffer (MPI.buffer), None for rows sent from the tensor
    rows_at: int  # the address of the rows in the kept send buffer
    head: np.ndarray  # this rank's header (int64 x 2), inside the kept send buffer or alone
    first: bool  # whether this rank's message starts with its header (rank 0)


def pair_of(
    rank: int,
    shape: tuple[int, ...],
    counts: list[int],
    displs: list[int],
    itemsize: int,
    fp: int,
    small_bytes: int,
) -> Pair:
    """The kept plan of a two-rank gather of ``counts`` bytes per rank (``displs`` apart) into a
    result of ``shape``, for the rank ``rank`` whose facts' fingerprint is ``fp`` (storage under
    ``small_bytes`` comes from torch.empty, larger from the transport's buffer cache)."""
    peer, total = 1 - rank, sum(counts)
    pad = HEADER // itemsize
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    lead = pad if rank == 1 else 0
    mine = counts[rank]
    send: Any = None
    rows_at = 0
    if mine <= COPY_BYTES:
        kept = np.zeros(mine + HEADER, dtype=np.uint8)
        head = kept[:HEADER] if rank == 0 else kept[mine:]
        head = head.view(np.int64)
        rows_at = kept.ctypes.data + (HEADER if rank == 0 else 0)
        # the buffer object holds its address only: the header view keeps the array alive
        send = MPI.buffer.fromaddress(kept.ctypes.data, kept.nbytes)
    else:
        head = np.zeros(2, dtype=np.int64)
    head[0] = fp
    return Pair(
        numel=math.prod(shape),
        small=(math.prod(shape) + pad) * itemsize < small_bytes,
        pad=pad,
        strides=tuple(strides),
        lead=lead,
        own_at=lead * itemsize + displs[rank],
        mine=mine,
        recv_at=0 if rank == 1 else displs[peer],
        recv_n=counts[peer] + HEADER,
        head_at=0 if rank == 1 else total,
        want=np.array([fp, 0], dtype=np.int64).tobytes(),
        send=send,
        rows_at=rows_at,
        head=head,
        first=rank == 0,
    )


def pair_gather(
    t: MPITransport,
    p: Pair,
    facts: tuple[Any, ...],
    shape: tuple[int, ...],
    x: torch.Tensor,
    problem: str | None,
) -> torch.Tensor:
    """``x``'s rows and the peer's as ``p`` says, in a new tensor of ``shape``; raises the same
    CommError on both ranks when their facts, row counts or own checks differ."""
    n = p.numel + p.pad
    store = torch.empty(n, dtype=x.dtype) if p.small else t._new((n,), x.dtype)
    base = store.data_ptr()
    src, mine = x.data_ptr(), p.mine  # x has these bytes: its own check made it so
    if mine:
        ctypes.memmove(base + p.own_at, src, mine)
    p.head[1] = problem is not None
    kind = None
    if p.send is not None:
        ctypes.memmove(p.rows_at, src, mine)
        send: Any = p.send
    else:
        blocks, at = [HEADER, mine], [p.head.ctypes.data, src]
        if not p.first:
            blocks.reverse()
            at.reverse()
        kind = MPI.BYTE.Create_hindexed(blocks, at).Commit()
        send = [MPI.BOTTOM, 1, kind]
    peer, status = 1 - t.rank, t._pair_status
    failure = None
    try:
        with deadline(t, "all_gather_v", "collective"):
            t.comm.Sendrecv(
                send,
                peer,
                PAIR_TAG,
                MPI.buffer.fromaddress(base + p.recv_at, p.recv_n),
                peer,
                PAIR_TAG,
                status,
            )
    except MPI.Exception as exc:  # a longer message than expected: truncated
        failure = exc
    finally:
        if kind is not None:
            kind.Free()
    if (
        failure is not None
        or problem is not None
        or status.Get_count(MPI.BYTE) != p.recv_n
        or _HEAD.from_address(base + p.head_at).raw != p.want
    ):
        everyone = t.comm.allgather((facts, problem))
        raise disagreement(t._where(), "all_gather_v", everyone, problem is not None)
    return store.as_strided(shape, p.strides, p.lead)
