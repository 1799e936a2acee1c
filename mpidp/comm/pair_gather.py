"""The two-rank ``all_gather_v`` of the MPI transport: one message each way, its rank agreement
in a 16-byte header beside the rows (:meth:`mpidp.comm.mpi.MPITransport._gather`).

Each rank sends its peer one message, its facts' fingerprint and whether its own check failed
(the header) joined to its rows: rank 0 sends rows then header, rank 1 header then rows, so that
the message lands whole in the receiver's result, the header in the slot of the receiver's own
rows (which it writes there once it has read the header): the result needs no spare bytes, and
is one ``torch.empty_like`` of a kept, memoryless template (0.6 us here, against 3 us for
``torch.empty`` and a view past spare bytes). A rank whose own rows are shorter than the header
keeps 16 spare bytes beside the result for it (before it on rank 0, after it on rank 1) and
views the result out of its storage. Its length depends on
nothing the ranks could disagree on but the rows, so every message meets its receive whatever
the ranks passed (a longer one than expected completes with a truncation error); both ranks
always complete, compare the header and the byte count with their own and raise the same
:class:`~mpidp.CommError` when either differs. One ``Sendrecv``: a single wait, as the raw
``Allgatherv``'s, under the deadline of an :class:`~mpidp.comm.deadline.Armed` slot kept with
the plan (two messages each way cost a second turn of the scheduler when MPICH sleeps
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
from mpidp.comm.deadline import Armed

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

    shape: tuple[int, ...]  # the result's
    like: torch.Tensor  # a memoryless tensor of the storage's shape and dtype (torch.empty_like)
    small: bool  # whether the storage is small enough for torch.empty (not the buffer cache)
    pad: int  # elements of the spare header slot in the storage (0: the header needs none)
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
    armed: Armed  # the deadline of the plan's wait


def pair_of(
    t: MPITransport,
    shape: tuple[int, ...],
    counts: list[int],
    displs: list[int],
    dtype: torch.dtype,
    fp: int,
) -> Pair:
    """The kept plan of ``t``'s two-rank gather of ``counts`` bytes per rank (``displs`` apart)
    into a result of ``shape`` and ``dtype``, for this rank, whose facts' fingerprint is ``fp``
    (storage under the buffer cache's ``min_bytes`` comes from torch.empty, larger from the
    cache)."""
    rank = t.rank
    peer = 1 - rank
    itemsize = torch.empty((), dtype=dtype).element_size()
    mine = counts[rank]
    pad = HEADER // itemsize if mine < HEADER else 0
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    lead = pad if rank == 0 else 0
    at = lead * itemsize  # the result's first byte in its storage
    # rank 0 receives header + rows 1 ending at the result's end, rank 1 rows 0 + header
    # from its start: either way the header lands where the receiver's own rows go
    recv_at = at + displs[peer] - HEADER if rank == 0 else at
    send: Any = None
    rows_at = 0
    if mine <= COPY_BYTES:
        kept = np.zeros(mine + HEADER, dtype=np.uint8)
        head = kept[mine:] if rank == 0 else kept[:HEADER]
        head = head.view(np.int64)
        rows_at = kept.ctypes.data + (0 if rank == 0 else HEADER)
        # the buffer object holds its address only: the header view keeps the array alive
        send = MPI.buffer.fromaddress(kept.ctypes.data, kept.nbytes)
    else:
        head = np.zeros(2, dtype=np.int64)
    head[0] = fp
    numel = math.prod(shape) + pad
    store = (numel,) if pad else shape
    return Pair(
        shape=shape,
        like=torch.empty((), dtype=dtype).expand(store),
        small=numel * itemsize < t.buffers.min_bytes,
        pad=pad,
        strides=tuple(strides),
        lead=lead,
        own_at=at + displs[rank],
        mine=mine,
        recv_at=recv_at,
        recv_n=counts[peer] + HEADER,
        head_at=recv_at if rank == 0 else at + counts[0],
        want=np.array([fp, 0], dtype=np.int64).tobytes(),
        send=send,
        rows_at=rows_at,
        head=head,
        armed=Armed(t, "all_gather_v", "collective"),
    )


def pair_gather(
    t: MPITransport,
    p: Pair,
    facts: tuple[Any, ...],
    x: torch.Tensor,
    problem: str | None = None,
) -> torch.Tensor:
    """``x``'s rows and the peer's as ``p`` says, in a new tensor; raises the same CommError on
    both ranks when their facts, row counts or own checks differ. ``problem`` (this rank's own
    check failed) only with a plan made for the call: it is written into the plan's header."""
    if p.small:
        store = torch.empty_like(p.like)
    else:
        store = t._new(p.like.shape, p.like.dtype)
    base = store.data_ptr()
    src, mine = x.data_ptr(), p.mine  # x has these bytes: its own check made it so
    if problem is not None:
        p.head[1] = 1
    kind = None
    if p.send is not None:
        ctypes.memmove(p.rows_at, src, mine)
        send: Any = p.send
    else:
        blocks, at = [mine, HEADER], [src, p.head.ctypes.data]
        if t.rank == 1:
            blocks.reverse()
            at.reverse()
        kind = MPI.BYTE.Create_hindexed(blocks, at).Commit()
        send = [MPI.BOTTOM, 1, kind]
    peer, status, armed = 1 - t.rank, t._pair_status, p.armed
    failure = None
    armed.n += 1
    try:
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
        armed.n += 1
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
    if mine:  # over the header, read
        ctypes.memmove(base + p.own_at, src, mine)
    return store.as_strided(p.shape, p.strides, p.lead) if p.pad else store
