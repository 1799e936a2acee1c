"""Transport over an mpi4py communicator, for CPU tensors.

Data moves as raw bytes straight from and into the tensors' memory (zero copy for contiguous
tensors; any dtype, bfloat16 included). Reductions use the matching MPI datatype.

Always on, for every collective: a fingerprint of what each rank passed (the operation, its
sizes, dtype and row shape) is all-reduced (two int64) before the operation, so ranks that
disagree (sizes, a dtype of the same width, a frozen parameter) get one clear error on every
rank, and no data moves, instead of garbage or a bare MPI abort (``all_gather_v`` on two ranks
carries it in a header beside its rows instead: :mod:`mpidp.comm.pair_gather`, and on three
and four ranks in messages of its own beside them: :mod:`mpidp.comm.few_gather`); and every
wait has a deadline (``timeout``, ``MPIDP_TIMEOUT``, :mod:`mpidp.comm.deadline`), after which
the job aborts with a message naming the call instead of hanging.
Point-to-point receives check the byte count each message brought.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from mpi4py import MPI

from mpidp.comm.base import (
    EXCHANGE_NUMBERS,
    TAGS_PER_EXCHANGE,
    PendingExchange,
    PreparedExchange,
    Transport,
    disagreement,
    fingerprint,
    pair_weight,
)
from mpidp.comm.buffers import BufferCache
from mpidp.comm.deadline import Armed, deadline, deadline_seconds
from mpidp.comm.few_gather import FEW, Few, few_gather, few_of
from mpidp.comm.pair_gather import PAIR_TAG, Pair, pair_gather, pair_of
from mpidp.comm.prepared import WaitingFor, _Prepared
from mpidp.errors import CommError

__all__ = ["MPITransport", "deadline_seconds"]

#: ``all_gather_v`` blocks of at most this many bytes per rank use MPI's blocking call, larger
#: ones its nonblocking one: MPICH picks other algorithms for each, and these win on each side.
BLOCKING_BYTES = 1 << 16


@functools.lru_cache(maxsize=256)
def _counts(sizes: tuple[int, ...], row: int) -> tuple[list[int], list[int]]:
    """Byte counts and displacements of blocks of ``sizes`` rows of ``row`` bytes."""
    counts = [s * row for s in sizes]
    displs = [0] * len(counts)
    for i in range(1, len(counts)):
        displs[i] = displs[i - 1] + counts[i - 1]
    return counts, displs


# the two-rank all_gather_v's tag lies above every numbered exchange's
assert TAGS_PER_EXCHANGE * (EXCHANGE_NUMBERS + 1) <= PAIR_TAG


class _Gather(NamedTuple):
    """An ``all_gather_v`` call's facts, checked once, and what MPI needs for it."""

    facts: tuple[Any, ...]
    shape: tuple[int, ...]
    counts: list[int]
    displs: list[int]
    call: Callable[..., MPI.Request | None]
    pair: Pair | None  # on two ranks: the one-message plan, its header carrying the facts
    few: Few | None  # on three to FEW ranks: the headers in messages beside the rows


_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() if dtype not in _SIZES else _SIZES[dtype]


_SIZES = {torch.float64: 8, torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def _world_ranks(comm: MPI.Comm) -> tuple[int, ...]:
    mine, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return tuple(int(r) for r in mine.Translate_ranks(list(range(comm.Get_size())), world))
    finally:
        mine.Free()
        world.Free()


class MPITransport(Transport):
    """Collectives over ``comm`` (any intra-communicator: a domain or data-parallel split)."""

    name = "mpi"
    reports_everywhere = True

    def __init__(
        self, comm: MPI.Comm, buffers: BufferCache | None = None, timeout: float | None = None
    ) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        self.comm = comm
        self.buffers = buffers if buffers is not None else BufferCache()
        #: seconds any one call waits for the other ranks before the watchdog aborts the job
        self.timeout = deadline_seconds() if timeout is None else float(timeout)
        self._checks = True  # off only in bench/checks.py, to price them
        #: the world ranks of this communicator's ranks: how a peer's report names it
        self.world_ranks = _world_ranks(comm)
        # the fingerprint (fp, -fp) and the all-to-all count balance, reused by every call
        self._check = (np.zeros(2, dtype=np.int64), np.zeros(1, dtype=np.int64))
        # all_gather_v calls seen before, by (sizes, shape, dtype): what the call needs
        self._gathers: dict[tuple[Any, ...], _Gather] = {}
        # a two-rank all_gather_v's receive status (mpidp.comm.pair_gather)
        self._pair_status = MPI.Status()

    # -- the always-on checks -----------------------------------------------------------------

    def _wait(self, reqs: list[MPI.Request], what: str) -> MPI.Exception | None:
        """Complete ``reqs`` one after the other (so an MPI error in one leaves the others
        waitable) under the deadline; returns the first MPI error instead of raising it."""
        failure: MPI.Exception | None = None
        with deadline(self, what):
            for req in reqs:
                try:
                    req.Wait()
                except MPI.Exception as exc:
                    failure = failure or exc
        return failure

    def _checked(
        self,
        what: str,
        facts: tuple[Any, ...],
        start: Callable[[], MPI.Request | None],
        balance: int | None = None,
        detail: tuple[Any, ...] = (),
        problem: str | None = None,
    ) -> None:
        """Run the operation ``start`` starts (a blocking call, or a nonblocking one whose
        request it returns) once every rank is known to pass the same: an all-reduce of
        ``facts``' fingerprint (and of ``balance``, a weighted count sum that must add up to 0)
        comes first, and when it fails no data moves and every rank raises the same error.
        ``detail`` (per-rank values such as send counts) is shown when they disagree.

        Checking first costs a little more than posting the check beside the operation
        (1 MB ``all_gather_v`` at P = 2: 550 against 508 us raw) but lets the operation pick
        its algorithm from the agreed facts: blocking below 64 KiB per rank, where it is
        faster (1 KB: 6.2 against 8.0 us), nonblocking above (1 MB: 532 against 795 us)."""
        failure: MPI.Exception | None = None
        with deadline(self, what, "collective"):
            if self._checks:  # off only in bench/checks.py, to price them
                fp = fingerprint(facts)
                if problem is not None:  # this rank's own check failed: no other rank matches
                    fp += 1 << 31
                check, total = self._check
                check[0], check[1] = fp, -fp
                self.comm.Allreduce(MPI.IN_PLACE, check, op=MPI.MAX)
                if balance is not None:
                    total[0] = balance
                    self.comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
                high, low = check.tolist()
                if problem is not None or high != -low or (balance is not None and total[0]):
                    everyone = self.comm.allgather((facts + detail, problem))
                    raise disagreement(self._where(), what, everyone, problem is not None)
            try:
                req = start()
                if req is not None:
                    req.Wait()
            except MPI.Exception as exc:
                failure = exc
        if failure is not None:
            self._failed(what, facts, failure)

    def _failed(self, what: str, facts: tuple[Any, ...], failure: MPI.Exception) -> None:
        raise CommError(
            f"{self._where()}: {what} {facts} failed in MPI: {failure}; run with "
            f"MPIDP_DEBUG=1 for a check of every rank's arguments"
        )

    def _bytes(self, tensor: torch.Tensor) -> MPI.buffer:
        """The tensor's memory as an MPI buffer (no copy; receives land in the tensor)."""
        if not tensor.is_cpu:
            raise CommError(
                f"{self._where()}: the MPI transport got a tensor on {tensor.device}; it moves CPU "
                f"tensors only: use the torch transport (NCCL) for device tensors"
            )
        if not tensor.is_contiguous():
            # a copy would receive instead of the tensor
            raise CommError(f"{self._where()}: internal error: non-contiguous MPI buffer")
        # data_ptr is the first element's address, storage offset included (0.4 us, against
        # 2 us for tensor.view(torch.uint8).numpy())
        return MPI.buffer.fromaddress(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    def _new(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor in numpy-allocated memory (large ones from the cache).

        Measured (16 MB per rank, 2 ranks): torch.empty gives back fresh pages for large
        buffers on every call and Allgatherv into it took 29 ms, against 12.6 ms into a
        numpy-allocated buffer and 7 ms into a reused one (see :mod:`mpidp.comm.buffers`).
        """
        nbytes = math.prod(shape) * _itemsize(dtype)
        if nbytes < self.buffers.min_bytes:  # small: malloc's free lists, no page faults
            return torch.empty(shape, dtype=dtype)
        raw = self.buffers.take(nbytes)
        return torch.from_numpy(raw).view(dtype).view(shape)

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        mine = np.array(values, dtype=np.int64)
        table = np.empty((self.size, mine.size), dtype=np.int64)
        with deadline(self, f"an all-gather of {mine.size} ints (a layer learning its bands?)"):
            self.comm.Allgather(mine, table)
        return table.tolist()

    def max_ints(self, values: Sequence[int], what: str) -> list[int]:
        """The element-wise maximum of every rank's ``values`` (int64, the same count on every
        rank): one small all-reduce, under the deadline (``what`` names the call). Blocking,
        so it also progresses the messages a caller posted before it (a check that travels
        beside them, not after them). Collective."""
        buf = np.array(values, dtype=np.int64)
        with deadline(self, what, "collective"):
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
        return buf.tolist()

    def scratch(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        if torch.device(device).type != "cpu":
            return super().scratch(shape, dtype, device)
        return self._new(tuple(shape), dtype)

    @staticmethod
    def _row_bytes(x: torch.Tensor) -> int:
        return math.prod(x.shape[1:]) * x.element_size()

    @staticmethod
    def _counts(sizes: list[int], row: int) -> tuple[list[int], list[int]]:
        return _counts(tuple(sizes), row)

    def all_gather_v(
        self, tensor: torch.Tensor, sizes: Sequence[int], dim: int = 0
    ) -> torch.Tensor:
        # The common call (rows along dim 0 of a contiguous CPU tensor) repeats with the same
        # sizes and shape: its validated facts are kept, which saves the argument checks'
        # Python (about a quarter of a 1 KB call). Anything else takes the general path.
        if dim == 0 and tensor.is_cpu and tensor.is_contiguous():
            key = (tuple(sizes), tensor.shape, tensor.dtype)
            known = self._gathers.get(key)
            if known is not None:
                return self._gather(known, tensor, None)
            out = super().all_gather_v(tensor, sizes, dim)
            # valid (or the general path raised), and sizes of plain ints: kept
            if self.size > 1 and tensor.dim() and all(type(s) is int for s in key[0]):
                if len(self._gathers) > 256:
                    self._gathers.clear()
                self._gathers[key] = self._gather_of(tensor, list(key[0]))
            return out
        return super().all_gather_v(tensor, sizes, dim)

    def kept_all_gather_v(
        self, tensor: torch.Tensor, sizes: Sequence[int], dim: int
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if dim != 0 or not tensor.is_contiguous():
            return None
        g = self._gathers.get((tuple(sizes), tensor.shape, tensor.dtype))
        if g is None:
            return None
        if g.pair is not None and self._checks:  # the exchange itself, one frame less
            return functools.partial(pair_gather, self, g.pair, g.facts)
        if g.few is not None and self._checks:
            return functools.partial(few_gather, self, g.few, g.facts)
        return functools.partial(self._gather, g, problem=None)

    def _gather_of(self, x: torch.Tensor, sizes: list[int]) -> _Gather:
        counts, displs = self._counts(sizes, self._row_bytes(x))
        facts = ("all_gather_v", tuple(sizes), x.dtype, tuple(x.shape[1:]))
        shape = (sum(sizes), *x.shape[1:])
        pair = None
        if self.size == 2:
            pair = pair_of(self, shape, counts, displs, x.dtype, fingerprint(facts))
        few = None
        if 2 < self.size <= FEW:
            few = few_of(self, x, shape, counts, displs, fingerprint(facts))
        return _Gather(
            facts,
            shape,
            counts,
            displs,
            self.comm.Allgatherv if max(counts) <= BLOCKING_BYTES else self.comm.Iallgatherv,
            pair,
            few,
        )

    def _all_gather_v(
        self, x: torch.Tensor, sizes: list[int], problem: str | None = None
    ) -> torch.Tensor:
        return self._gather(self._gather_of(x, sizes), x, problem)

    def _gather(self, g: _Gather, x: torch.Tensor, problem: str | None) -> torch.Tensor:
        """``x``'s rows and every other rank's, as ``g`` says: on two ranks the agreement rides
        in the one message each way (:mod:`mpidp.comm.pair_gather`), on three and four in
        messages beside the rows (:mod:`mpidp.comm.few_gather`), on more it is the check
        all-reduce before the ``Allgatherv`` (with counts that disagree the collective itself
        is erroneous MPI)."""
        if g.pair is not None and self._checks:
            return pair_gather(self, g.pair, g.facts, x, problem)
        if g.few is not None and self._checks:
            return few_gather(self, g.few, g.facts, x, problem)
        out = self._new(g.shape, x.dtype)
        self._checked(
            "all_gather_v",
            g.facts,
            lambda: g.call(self._bytes(x), [self._bytes(out), g.counts, g.displs, MPI.BYTE]),
            problem=problem,
        )
        return out

    def _gather_v(
        self, x: torch.Tensor, sizes: list[int], dst: int, problem: str | None = None
    ) -> torch.Tensor | None:
        counts, displs = self._counts(sizes, self._row_bytes(x))
        facts = ("gather_v", tuple(sizes), x.dtype, tuple(x.shape[1:]), dst)
        if self.rank != dst:
            self._checked(
                "gather_v",
                facts,
                lambda: self.comm.Igatherv(self._bytes(x), None, dst),
                problem=problem,
            )
            return None
        out = self._new((sum(sizes), *x.shape[1:]), x.dtype)
        self._checked(
            "gather_v",
            facts,
            lambda: self.comm.Igatherv(
                self._bytes(x), [self._bytes(out), counts, displs, MPI.BYTE], root=dst
            ),
            problem=problem,
        )
        return out

    def _scatter_v(
        self,
        x: torch.Tensor | None,
        sizes: list[int],
        src: int,
        rest: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        out = self._new((sizes[self.rank], *rest), dtype)
        facts = ("scatter_v", tuple(sizes), dtype, tuple(rest), src)
        if self.rank != src or x is None:
            self._checked(
                "scatter_v", facts, lambda: self.comm.Iscatterv(None, self._bytes(out), root=src)
            )
            return out
        counts, displs = self._counts(sizes, self._row_bytes(x))
        self._checked(
            "scatter_v",
            facts,
            lambda: self.comm.Iscatterv(
                [self._bytes(x), counts, displs, MPI.BYTE], self._bytes(out), root=src
            ),
        )
        return out

    def _all_to_all_v(
        self, x: torch.Tensor, send: list[int], recv: list[int], problem: str | None = None
    ) -> torch.Tensor:
        out = self._new((sum(recv), *x.shape[1:]), x.dtype)
        row = self._row_bytes(x)
        scounts, sdispls = self._counts(send, row)
        rcounts, rdispls = self._counts(recv, row)
        p, me = self.size, self.rank
        balance = sum(pair_weight(me, j, p) * c for j, c in enumerate(scounts)) - sum(
            pair_weight(j, me, p) * c for j, c in enumerate(rcounts)
        )
        self._checked(
            "all_to_all_v",
            ("all_to_all_v", x.dtype, tuple(x.shape[1:])),
            lambda: self.comm.Ialltoallv(
                [self._bytes(x), scounts, sdispls, MPI.BYTE],
                [self._bytes(out), rcounts, rdispls, MPI.BYTE],
            ),
            balance=balance,
            detail=(f"send rows {send}", f"receive rows {recv}"),
            problem=problem,
        )
        return out

    def _reduce_scatter_v(
        self, x: torch.Tensor, sizes: list[int], op: str, problem: str | None = None
    ) -> torch.Tensor:
        self._bytes(x)  # device and layout checks
        out = self._new((sizes[self.rank], *x.shape[1:]), x.dtype)
        row = math.prod(x.shape[1:])
        self._checked(
            "reduce_scatter_v",
            ("reduce_scatter_v", tuple(sizes), x.dtype, tuple(x.shape[1:]), op),
            lambda: self.comm.Ireduce_scatter(
                x.numpy(), out.numpy(), recvcounts=[s * row for s in sizes], op=_OPS[op]
            ),
            problem=problem,
        )
        return out

    def _all_reduce(self, x: torch.Tensor, op: str, src: torch.Tensor | None = None) -> None:
        if x.device.type != "cpu":
            self._bytes(x)  # raises the device error
        send = MPI.IN_PLACE if src is None else src.numpy()
        self._checked(
            "all_reduce",
            ("all_reduce", x.numel(), x.dtype, op),
            lambda: self.comm.Allreduce(send, x.numpy(), op=_OPS[op]),
        )

    def start_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> PendingExchange:
        """``MPI_Iallreduce`` in place, waited for under the deadline. No fingerprint check
        of its own (that would block): its callers agree on what they reduce beforehand
        (:class:`mpidp.GradientSync` agrees its buckets once). float16/bfloat16, ``avg`` and
        non-contiguous tensors take the blocking form."""
        op = self._op(op)
        if (
            self.size == 1
            or op not in _OPS
            or tensor.dtype in (torch.float16, torch.bfloat16)
            or not (tensor.is_cpu and tensor.is_contiguous())
        ):
            return super().start_all_reduce(tensor, op)
        req = self.comm.Iallreduce(MPI.IN_PLACE, tensor.detach().numpy(), op=_OPS[op])

        def wait() -> None:
            with deadline(self, "a nonblocking all_reduce (a gradient bucket)", "collective"):
                req.Wait()

        return PendingExchange(wait)

    def _broadcast(self, x: torch.Tensor, src: int) -> None:
        self._checked(
            "broadcast",
            ("broadcast", x.numel(), x.dtype, src),
            lambda: self.comm.Ibcast(self._bytes(x), root=src),
        )

    def _start_exchange(
        self,
        sends: list[tuple[int, int, torch.Tensor]],
        recvs: list[tuple[int, int, torch.Tensor]],
    ) -> Callable[[], None]:
        # A non-contiguous receive buffer is received into a contiguous copy, then copied back.
        staged = [
            (t, t if t.is_contiguous() else self._new(tuple(t.shape), t.dtype)) for _, _, t in recvs
        ]
        reqs = [
            self.comm.Irecv(self._bytes(buf), source=peer, tag=tag)
            for (peer, tag, _), (_, buf) in zip(recvs, staged, strict=False)
        ]
        reqs += [self.comm.Isend(self._bytes(t), dest=peer, tag=tag) for peer, tag, t in sends]
        # the exchange's number (halo.py numbers its exchanges; 0: unnumbered) rides in the
        # tags: a peer's report of another number is another exchange
        number = recvs[0][1] // TAGS_PER_EXCHANGE if recvs else 0
        peers = [peer for peer, _, _ in recvs]
        bufs = [buf for _, buf in staged]

        def wait() -> None:
            self._complete(reqs, peers, bufs, [MPI.Status() for _ in recvs], number)
            for target, buf in staged:
                if buf is not target:
                    target.copy_(buf)
            sends.clear()  # the send tensors lived until here

        return wait

    def _complete(
        self,
        reqs: list[MPI.Request],
        peers: Sequence[int],
        bufs: Sequence[torch.Tensor],
        statuses: list[MPI.Status],
        number: int,
        wants: Sequence[int] | None = None,
        waiting: WaitingFor | None = None,
        armed: Armed | None = None,
    ) -> None:
        """Wait for an exchange's receives (the first ``len(peers)`` requests), then its sends,
        under the deadline (a prepared exchange's :class:`~mpidp.comm.deadline.Armed` slot,
        ``armed``, or one registered for the call), and check that every receive brought the
        bytes of its buffer (``wants``, and the deadline's :class:`WaitingFor`: given by a
        prepared exchange, which made them once)."""
        n = len(peers)
        if armed is not None:
            armed.number = number
            armed.n += 1
            try:
                failure = self._wait_all(reqs, n, statuses)
            finally:
                armed.n += 1
        else:
            needs = waiting.needs if waiting is not None else sorted(set(peers))
            with deadline(self, waiting or WaitingFor(peers), "exchange", number, needs):
                failure = self._wait_all(reqs, n, statuses)
        if wants is None:
            wants = [buf.numel() * buf.element_size() for buf in bufs]
        for peer, buf, st, want in zip(peers, bufs, statuses, wants, strict=True):
            got = st.Get_count(MPI.BYTE)
            if failure is not None or got != want:
                raise CommError(
                    f"{self._where()}: a point-to-point receive from rank {peer} expected "
                    f"{want} bytes {tuple(buf.shape)} {buf.dtype} and got "
                    f"{'more (' + str(failure) + ')' if failure is not None else got}: the "
                    f"two ranks disagree on the rows or the shape they exchange (a halo of "
                    f"another width, another dtype); check that every rank runs the same "
                    f"layer on the same partition"
                )

    def _wait_all(
        self, reqs: list[MPI.Request], n: int, statuses: list[MPI.Status]
    ) -> MPI.Exception | None:
        """Complete the receives (the first ``n`` of ``reqs``, their statuses kept), then the
        sends; the first MPI error, not raised (every request is completed first)."""
        failure = None
        try:
            MPI.Request.Waitall(reqs[:n], statuses)
        except MPI.Exception as exc:
            failure = exc
        try:
            MPI.Request.Waitall(reqs[n:])
        except MPI.Exception:  # one by one, so that every other send completes
            failure = self._wait(reqs[n:], "a point-to-point exchange's sends") or failure
        return failure

    def prepare_exchange(
        self,
        send_peers: Sequence[int],
        recvs: Sequence[tuple[int, torch.Tensor]],
        sends: Sequence[torch.Tensor] | None = None,
    ) -> PreparedExchange:
        bufs = [b for _, b in recvs] + list(sends or ())
        if any(p == self.rank for p in (*send_peers, *(p for p, _ in recvs))) or not all(
            b.is_cpu and b.is_contiguous() for b in bufs
        ):
            return super().prepare_exchange(send_peers, recvs, sends)
        return _Prepared(self, send_peers, recvs, sends)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return list(self.comm.allgather(obj))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.comm.bcast(obj, root=src)

    def barrier(self) -> None:
        with deadline(self, "a barrier"):
            self.comm.Barrier()
