"""The MPI transport's prepared exchange (:meth:`mpidp.comm.mpi.MPITransport.prepare_exchange`):
an exchange made again and again with the same peers and receive buffers, its checks and
bookkeeping done once, its messages posted straight on the communicator, its wait and byte-count
checks the transport's own (:meth:`~mpidp.comm.mpi.MPITransport._complete`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from mpi4py import MPI

from mpidp.comm.base import (
    EXCHANGE_NUMBERS,
    TAGS_PER_EXCHANGE,
    PendingExchange,
    PreparedExchange,
    _tagged,
)
from mpidp.comm.deadline import Armed

if TYPE_CHECKING:
    from mpidp.comm.mpi import MPITransport


class WaitingFor:
    """What an exchange's wait names when its deadline passes (made into text only then),
    and the peers it needs (the watchdog's report)."""

    __slots__ = ("needs", "peers")

    def __init__(self, peers: Sequence[int]) -> None:
        self.peers = peers
        self.needs = sorted(set(peers))

    def __str__(self) -> str:
        return (
            f"a point-to-point exchange (halo) waiting for messages from ranks "
            f"{self.needs}: a peer skipped it (a forward or a backward that ran "
            f"on some ranks only?)"
        )


class _Prepared(PreparedExchange):
    """:class:`PreparedExchange` over MPI: peers checked, tags counted, the receive buffers'
    (and kept send buffers') addresses, byte counts and statuses made once; :meth:`start`
    posts the messages straight on the communicator, and the wait checks every receive's byte
    count as every exchange does."""

    def __init__(
        self,
        t: MPITransport,
        send_peers: Sequence[int],
        recvs: Sequence[tuple[int, torch.Tensor]],
        sends: Sequence[torch.Tensor] | None = None,
    ) -> None:
        super().__init__(t, send_peers, recvs, sends)
        self.mpi = t
        for peer in (*send_peers, *(p for p, _ in recvs)):
            t._root(peer, "peer")
        self.rtags = [tag for _, tag, _ in _tagged(list(recvs))]
        self.stags = [tag for _, tag, _ in _tagged([(p, None) for p in send_peers])]  # type: ignore[misc]
        self.bufs = [b for _, b in recvs]
        self.raw = [t._bytes(b) for b in self.bufs]
        self.wants = [b.numel() * b.element_size() for b in self.bufs]
        self.kept = None if sends is None else [t._bytes(s) for s in sends]
        self.rpeers = [p for p, _ in recvs]
        self.waiting = WaitingFor(self.rpeers)
        self.statuses = [MPI.Status() for _ in recvs]
        self.numbered = max([*self.rtags, *self.stags], default=0) < TAGS_PER_EXCHANGE
        #: the deadline of :meth:`run`'s wait (one exchange of the plan at a time)
        self.armed = Armed(t, self.waiting, "exchange", self.waiting.needs)

    def start(self, sends: Sequence[torch.Tensor] | None, number: int = 0) -> PendingExchange:
        t, comm = self.mpi, self.mpi.comm
        base = (number % EXCHANGE_NUMBERS + 1) * TAGS_PER_EXCHANGE if number > 0 else 0
        base = base if self.numbered else 0
        reqs = [
            comm.Irecv(raw, source=peer, tag=base + tag)
            for raw, peer, tag in zip(self.raw, self.rpeers, self.rtags, strict=True)
        ]
        held = None if sends is None else [s.detach().contiguous() for s in sends]
        raws = self.kept if held is None else [t._bytes(s) for s in held]
        assert raws is not None, "no send buffers were kept: pass them"
        reqs += [
            comm.Isend(raw, dest=peer, tag=base + tag)
            for raw, peer, tag in zip(raws, self.peers, self.stags, strict=True)
        ]
        number = base // TAGS_PER_EXCHANGE

        def wait() -> None:
            t._complete(
                reqs, self.rpeers, self.bufs, self.statuses, number, self.wants, self.waiting
            )
            if held is not None:
                held.clear()  # the send tensors lived until here

        return PendingExchange(wait)

    def run(self, number: int = 0) -> None:
        """:meth:`start` with the kept send buffers and its wait, in one call: the messages
        posted, the wait under the plan's :class:`~mpidp.comm.deadline.Armed` slot, every
        receive's byte count checked."""
        comm = self.mpi.comm
        base = (number % EXCHANGE_NUMBERS + 1) * TAGS_PER_EXCHANGE if number > 0 else 0
        base = base if self.numbered else 0
        kept = self.kept
        assert kept is not None, "no send buffers were kept: pass them"
        reqs = []  # (loops, not comprehensions: a frame each in this Python)
        for raw, peer, tag in zip(self.raw, self.rpeers, self.rtags, strict=True):
            reqs.append(comm.Irecv(raw, source=peer, tag=base + tag))
        for raw, peer, tag in zip(kept, self.peers, self.stags, strict=True):
            reqs.append(comm.Isend(raw, dest=peer, tag=base + tag))
        self.mpi._complete(
            reqs,
            self.rpeers,
            self.bufs,
            self.statuses,
            base // TAGS_PER_EXCHANGE,
            self.wants,
            self.waiting,
            self.armed,
        )
