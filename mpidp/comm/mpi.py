"""Transport over an mpi4py communicator, for CPU tensors.

Data moves as raw bytes straight from and into the tensors' memory (zero copy for contiguous
tensors; any dtype, bfloat16 included). Reductions use the matching MPI datatype.

Always on, for every collective: a fingerprint of what each rank passed (the operation, its
sizes, dtype and row shape) travels in a nonblocking all-reduce of two int64 posted beside the
operation itself, so ranks that disagree (sizes, a dtype of the same width, a frozen parameter)
get one clear error on every rank instead of garbage or a bare MPI abort; and every wait has a
deadline (``timeout``, ``MPIDP_TIMEOUT``), after which the job aborts with a message naming the
call instead of hanging.
Point-to-point receives check the byte count each message brought.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from mpidp.comm.base import Transport, disagreement, fingerprint, pair_weight
from mpidp.comm.buffers import BufferCache
from mpidp.errors import CommError

__all__ = ["MPITransport", "deadline_seconds"]

#: Seconds a blocking call waits before the job is aborted, unless the manager or env says.
DEFAULT_DEADLINE = 600.0


def deadline_seconds(default: float = DEFAULT_DEADLINE) -> float:
    """``MPIDP_TIMEOUT`` (seconds) when set, else ``default``."""
    raw = os.environ.get("MPIDP_TIMEOUT", "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise CommError(f"MPIDP_TIMEOUT={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise CommError(f"MPIDP_TIMEOUT={raw!r} must be positive")
    return value


class _Watchdog:
    """One daemon thread per process that ends the job when a blocking MPI call outlives its
    deadline. A blocked MPI call cannot be interrupted, so the thread prints what the call was
    and aborts the job (``MPI_Abort``), like an uncaught error under ``python -m mpi4py``.
    A call costs two attribute writes; the thread looks twice a second."""

    def __init__(self) -> None:
        self.waits: dict[int, tuple[float, float, str, MPITransport]] = {}
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="mpidp-deadline", daemon=True)
                self.thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            for began, limit, what, t in list(self.waits.values()):
                if now - began > limit:
                    self._fire(now - began, limit, what, t)

    @staticmethod
    def _fire(waited: float, limit: float, what: str, t: MPITransport) -> None:
        print(
            f"mpidp CommTimeout: {t._where()} (MPI group of {t.size}): {what} did not complete "
            f"after {waited:.1f} s (deadline {limit:g} s): another rank of the group has not "
            f"entered the same call (it skipped it, is stuck, or died). Aborting the job. Raise "
            f"the limit with MPIDP_TIMEOUT or the manager's timeout if such a wait is expected",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(1.0)  # let the launcher forward the message before it kills the job
        if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
            MPI.COMM_WORLD.Abort(75)
        os._exit(75)


_WATCHDOG = _Watchdog()


class deadline:
    """``with deadline(t, what):`` runs a blocking MPI wait under ``t``'s deadline (see
    :class:`_Watchdog`). A class, not a generator: it is entered on every call."""

    __slots__ = ("key",)

    def __init__(self, t: MPITransport, what: str) -> None:
        if _WATCHDOG.thread is None:
            _WATCHDOG.start()
        self.key = threading.get_ident()
        _WATCHDOG.waits[self.key] = (time.monotonic(), t.timeout, what, t)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        _WATCHDOG.waits.pop(self.key, None)


_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() if dtype not in _SIZES else _SIZES[dtype]


_SIZES = {torch.float64: 8, torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


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
        # the fingerprint (fp, -fp) and the all-to-all count balance, reused by every call
        self._check = (np.zeros(2, dtype=np.int64), np.zeros(1, dtype=np.int64))

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
        start: Callable[[], MPI.Request],
        balance: int | None = None,
        detail: tuple[Any, ...] = (),
        problem: str | None = None,
    ) -> None:
        """Run the nonblocking operation ``start`` posts, beside an all-reduce of ``facts``'
        fingerprint (and of ``balance``, a weighted count sum that must add up to 0).
        ``detail`` (per-rank values such as send counts) is shown when they disagree."""
        if not self._checks:  # bench/checks.py only: the same call without its checks
            start().Wait()
            return
        fp = fingerprint(facts)
        if problem is not None:  # this rank's own check failed: no other rank matches it
            fp += 1 << 31
        check, total = self._check
        check[0], check[1] = fp, -fp
        reqs = [self.comm.Iallreduce(MPI.IN_PLACE, check, op=MPI.MAX)]
        total[0] = balance or 0
        if balance is not None:
            reqs.append(self.comm.Iallreduce(MPI.IN_PLACE, total, op=MPI.SUM))
        failure: MPI.Exception | None = None
        try:
            reqs.insert(0, start())
        except MPI.Exception as exc:
            failure = exc
        failure = self._wait(reqs, what) or failure
        if problem is not None or check[0] != -check[1] or total[0] != 0:
            everyone = self.comm.allgather((facts + detail, problem))
            raise disagreement(self._where(), what, everyone, problem is not None)
        if failure is not None:
            raise CommError(
                f"{self._where()}: {what} {facts} failed in MPI: {failure}; run with "
                f"MPIDP_DEBUG=1 for a check of every rank's arguments"
            )

    def _bytes(self, tensor: torch.Tensor) -> np.ndarray:
        if tensor.device.type != "cpu":
            raise CommError(
                f"{self._where()}: the MPI transport got a tensor on {tensor.device}; it moves CPU "
                f"tensors only: use the torch transport (NCCL) for device tensors"
            )
        if not tensor.is_contiguous():
            # reshape would copy, and a receive would land in the copy.
            raise CommError(f"{self._where()}: internal error: non-contiguous MPI buffer")
        # A contiguous tensor may still have odd strides on size-1 or empty dims.
        flat = tensor if tensor.dim() and tensor.stride(-1) == 1 else tensor.reshape(-1)
        return flat.view(torch.uint8).numpy()

    def _new(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor in numpy-allocated memory (large ones from the cache).

        Measured (16 MB per rank, 2 ranks): torch.empty gives back fresh pages for large
        buffers on every call and Allgatherv into it took 29 ms, against 12.6 ms into a
        numpy-allocated buffer and 7 ms into a reused one (see :mod:`mpidp.comm.buffers`).
        """
        count = math.prod(shape)
        if count == 0:  # an empty shard: numpy's empty array cannot be viewed as other types
            return torch.empty(shape, dtype=dtype)
        raw = self.buffers.take(count * _itemsize(dtype))
        return torch.from_numpy(raw).view(dtype).view(shape)

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        mine = np.array(values, dtype=np.int64)
        table = np.empty((self.size, mine.size), dtype=np.int64)
        with deadline(self, f"an all-gather of {mine.size} ints (a layer learning its bands?)"):
            self.comm.Allgather(mine, table)
        return table.tolist()

    def scratch(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        if torch.device(device).type != "cpu":
            return super().scratch(shape, dtype, device)
        return self._new(tuple(shape), dtype)

    @staticmethod
    def _row_bytes(x: torch.Tensor) -> int:
        return math.prod(x.shape[1:]) * x.element_size()

    def _counts(self, sizes: list[int], row: int) -> tuple[list[int], list[int]]:
        counts = [s * row for s in sizes]
        displs = [0] * len(counts)
        for i in range(1, len(counts)):
            displs[i] = displs[i - 1] + counts[i - 1]
        return counts, displs

    def _all_gather_v(
        self, x: torch.Tensor, sizes: list[int], problem: str | None = None
    ) -> torch.Tensor:
        out = self._new((sum(sizes), *x.shape[1:]), x.dtype)
        counts, displs = self._counts(sizes, self._row_bytes(x))
        self._checked(
            "all_gather_v",
            ("all_gather_v", tuple(sizes), x.dtype, tuple(x.shape[1:])),
            lambda: self.comm.Iallgatherv(
                self._bytes(x), [self._bytes(out), counts, displs, MPI.BYTE]
            ),
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

    def _all_reduce(self, x: torch.Tensor, op: str) -> None:
        if x.device.type != "cpu":
            self._bytes(x)  # raises the device error
        self._checked(
            "all_reduce",
            ("all_reduce", x.numel(), x.dtype, op),
            lambda: self.comm.Iallreduce(MPI.IN_PLACE, x.numpy(), op=_OPS[op]),
        )

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

        def wait() -> None:
            statuses = [MPI.Status() for _ in recvs]
            peers = sorted({peer for peer, _, _ in recvs})
            what = (
                f"a point-to-point exchange (halo) waiting for messages from ranks {peers}: a "
                f"peer skipped it (a forward or a backward that ran on some ranks only?)"
            )
            failure = None
            with deadline(self, what):
                try:
                    MPI.Request.Waitall(reqs[: len(recvs)], statuses)
                except MPI.Exception as exc:
                    failure = exc
            failure = self._wait(reqs[len(recvs) :], "a point-to-point exchange's sends") or failure
            for (peer, _, _), (_, buf), st in zip(recvs, staged, statuses, strict=False):
                want = buf.numel() * buf.element_size()
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
            for target, buf in staged:
                if buf is not target:
                    target.copy_(buf)
            sends.clear()  # the send tensors lived until here

        return wait

    def all_gather_object(self, obj: Any) -> list[Any]:
        return list(self.comm.allgather(obj))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.comm.bcast(obj, root=src)

    def barrier(self) -> None:
        with deadline(self, "a barrier"):
            self.comm.Barrier()
