"""Transport over a torch.distributed process group: NCCL for CUDA tensors, gloo on CPU.

gloo rejects uneven ``all_gather``, ``gather``, ``scatter`` and list ``all_to_all`` but
accepts ``all_to_all_single`` with uneven and zero splits, so every v-collective here is an
``all_to_all_single`` with the right split sizes; the same code runs on NCCL.

Checks: on CPU (gloo) every collective first all-reduces a fingerprint of what each rank
passed (the operation, sizes, dtype, row shape; for all-to-all a weighted balance of send and
receive counts), so ranks that disagree raise one clear error on every rank before any data
moves. On a GPU that check would stall the stream once per call (its result must reach the
host), so there it runs only in debug mode (``MPIDP_DEBUG=1``, the collectives' full check).
A failure or timeout inside torch.distributed is re-raised as a :class:`CommError` naming the
call, the rank and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mpidp.comm.base import Transport, _dense, disagreement, fingerprint, pair_weight
from mpidp.errors import CommError

__all__ = ["TorchTransport"]

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}


class TorchTransport(Transport):
    """Collectives over ``group`` (a ProcessGroup; ranks are ranks of that group)."""

    name = "torch"

    def __init__(self, group: dist.ProcessGroup, device: torch.device | None = None) -> None:
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.group = group
        self._device = device or torch.device("cpu")
        # the fingerprint check runs where it costs no device synchronisation (see above)
        self._checks = self._device.type == "cpu"
        self.reports_everywhere = self._checks
        # gloo's send / recv read the buffer's address on the host: a device tensor there
        # aborts the process, so point-to-point moves a host copy (gloo's collectives stage
        # device tensors themselves)
        self._host_p2p = self._device.type != "cpu" and dist.get_backend(group) == "gloo"

    @property
    def default_device(self) -> torch.device:
        return self._device

    def _call(self, what: str, run: Callable[[], Any]) -> Any:
        """``run()``, with torch.distributed's failures (a timeout, a closed connection, a
        size mismatch) re-raised naming the call, this rank and the fix."""
        try:
            return run()
        except RuntimeError as exc:
            # gloo prefixes its messages with the C++ source location
            told = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip().split("\n")[0]) or repr(exc)
            raise CommError(
                f"{self._where()} (torch.distributed, {dist.get_backend(self.group)}): {what} "
                f"failed: {told}. A "
                f"timeout or a closed connection means another rank of the group did not enter "
                f"the same call (it skipped it, is stuck, or died: look for its own error "
                f"first); raise the manager's timeout if such a wait is expected"
            ) from exc

    def _check(
        self,
        what: str,
        facts: tuple[Any, ...],
        balance: int = 0,
        detail: tuple[Any, ...] = (),
        problem: str | None = None,
    ) -> None:
        """Agree on ``facts`` before the call: one all-reduce (sum) of ``(fp, fp**2,
        balance)``. All fingerprints are equal exactly when ``P * sum(fp**2) == sum(fp)**2``
        (24-bit fingerprints, so the sums fit int64 for any group below 8192 ranks)."""
        if not self._checks:
            if problem is not None:
                raise CommError(problem)
            return
        fp = (fingerprint(facts) & 0xFFFFFF) + (1 << 24 if problem is not None else 0)
        sums = torch.tensor([fp, fp * fp, balance], dtype=torch.int64)
        self._call(f"the argument check of {what}", lambda: dist.all_reduce(sums, group=self.group))
        total, squares, bal = sums.tolist()
        if problem is not None or self.size * squares != total * total or bal != 0:
            everyone = self.all_gather_object((facts + detail, problem))
            raise disagreement(self._where(), what, everyone, problem is not None)

    def _a2a(self, x: torch.Tensor, send: list[int], recv: list[int], what: str) -> torch.Tensor:
        out = x.new_empty((sum(recv), *tuple(x.shape[1:])))
        self._call(what, lambda: dist.all_to_all_single(out, x, recv, send, group=self.group))
        return out

    def _all_gather_v(
        self, x: torch.Tensor, sizes: list[int], problem: str | None = None
    ) -> torch.Tensor:
        self._check(
            "all_gather_v",
            ("all_gather_v", tuple(sizes), x.dtype, tuple(x.shape[1:])),
            problem=problem,
        )
        # Each rank sends its part to every rank: P copies on the send side, one call.
        send = x.repeat((self.size,) + (1,) * (x.dim() - 1))
        return self._a2a(send, [x.shape[0]] * self.size, sizes, "all_gather_v")

    def _gather_v(
        self, x: torch.Tensor, sizes: list[int], dst: int, problem: str | None = None
    ) -> torch.Tensor | None:
        self._check(
            "gather_v",
            ("gather_v", tuple(sizes), x.dtype, tuple(x.shape[1:]), dst),
            problem=problem,
        )
        send = [0] * self.size
        send[dst] = x.shape[0]
        recv = sizes if self.rank == dst else [0] * self.size
        out = self._a2a(x, send, recv, "gather_v")
        return out if self.rank == dst else None

    def _scatter_v(
        self,
        x: torch.Tensor | None,
        sizes: list[int],
        src: int,
        rest: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        if self.rank == src and x is not None:
            send = sizes
        else:
            x = torch.empty((0, *rest), dtype=dtype, device=device)
            send = [0] * self.size
        recv = [0] * self.size
        recv[src] = sizes[self.rank]
        self._check("scatter_v", ("scatter_v", tuple(sizes), dtype, tuple(rest), src))
        return self._a2a(x, send, recv, "scatter_v")

    def _all_to_all_v(
        self, x: torch.Tensor, send: list[int], recv: list[int], problem: str | None = None
    ) -> torch.Tensor:
        p, me = self.size, self.rank
        balance = sum(pair_weight(me, j, p) * c for j, c in enumerate(send)) - sum(
            pair_weight(j, me, p) * c for j, c in enumerate(recv)
        )
        self._check(
            "all_to_all_v",
            ("all_to_all_v", x.dtype, tuple(x.shape[1:])),
            balance=balance,
            detail=(f"send rows {send}", f"receive rows {recv}"),
            problem=problem,
        )
        return self._a2a(x, send, recv, "all_to_all_v")

    def _reduce_scatter_v(
        self, x: torch.Tensor, sizes: list[int], op: str, problem: str | None = None
    ) -> torch.Tensor:
        self._check(
            "reduce_scatter_v",
            ("reduce_scatter_v", tuple(sizes), x.dtype, tuple(x.shape[1:]), op),
            problem=problem,
        )
        # Every rank's copy of my part, stacked in rank order, then reduced here: a fixed
        # summation order, and gloo has no uneven reduce_scatter.
        mine = sizes[self.rank]
        parts = self._a2a(x, sizes, [mine] * self.size, "reduce_scatter_v")
        parts = parts.view(self.size, mine, *x.shape[1:])
        if op == "sum":
            return parts.sum(0)
        if op == "prod":
            return parts.prod(0)
        return parts.amax(0) if op == "max" else parts.amin(0)

    def _all_reduce(self, x: torch.Tensor, op: str, src: torch.Tensor | None = None) -> None:
        if src is not None:
            x.copy_(src)
        self._check("all_reduce", ("all_reduce", x.numel(), x.dtype, op))
        self._call("all_reduce", lambda: dist.all_reduce(x, op=_OPS[op], group=self.group))

    def _broadcast(self, x: torch.Tensor, src: int) -> None:
        self._check("broadcast", ("broadcast", x.numel(), x.dtype, src))
        self._call("broadcast", lambda: dist.broadcast(x, group=self.group, group_src=src))

    def _start_exchange(
        self,
        sends: list[tuple[int, int, torch.Tensor]],
        recvs: list[tuple[int, int, torch.Tensor]],
    ) -> Callable[[], None]:
        host = self._host_p2p
        staged = [(t, torch.empty(t.shape, dtype=t.dtype) if host else t) for _, _, t in recvs]
        staged = [(t, buf if buf.is_contiguous() else _dense(buf)) for t, buf in staged]
        if host:  # the send copies live in ``sends`` until the exchange completes
            sends[:] = [(peer, tag, t.to("cpu").contiguous()) for peer, tag, t in sends]
        ops = [
            dist.P2POp(dist.irecv, buf, group=self.group, group_peer=peer, tag=tag)
            for (peer, tag, _), (_, buf) in zip(recvs, staged, strict=False)
        ]
        ops += [
            dist.P2POp(dist.isend, t, group=self.group, group_peer=peer, tag=tag)
            for peer, tag, t in sends
        ]
        what = f"a point-to-point exchange (halo) with ranks {sorted({p for p, _, _ in recvs})}"
        works = self._call(what, lambda: dist.batch_isend_irecv(ops))

        def wait() -> None:
            for work in works:
                self._call(what, work.wait)
            for target, buf in staged:
                if buf is not target:
                    target.copy_(buf)
            sends.clear()  # the send tensors lived until here

        return wait

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._call("all_gather_object", lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        self._call(
            "broadcast_object",
            lambda: dist.broadcast_object_list(box, group=self.group, group_src=src),
        )
        return box[0]

    def barrier(self) -> None:
        self._call("a barrier", lambda: dist.barrier(group=self.group))
