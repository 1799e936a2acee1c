"""Transport over a torch.distributed process group: NCCL for CUDA tensors, gloo on CPU.

gloo rejects uneven ``all_gather``, ``gather``, ``scatter`` and list ``all_to_all`` but
accepts ``all_to_all_single`` with uneven and zero splits, so every v-collective here is an
``all_to_all_single`` with the right split sizes; the same code runs on NCCL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mpidp.comm.base import Transport, _dense

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

    @property
    def default_device(self) -> torch.device:
        return self._device

    def _a2a(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(recv), *tuple(x.shape[1:])))
        dist.all_to_all_single(out, x, recv, send, group=self.group)
        return out

    def _all_gather_v(
        self, x: torch.Tensor, sizes: list[int], problem: str | None = None
    ) -> torch.Tensor:
        # Each rank sends its part to every rank: P copies on the send side, one call.
        send = x.repeat((self.size,) + (1,) * (x.dim() - 1))
        return self._a2a(send, [x.shape[0]] * self.size, sizes)

    def _gather_v(
        self, x: torch.Tensor, sizes: list[int], dst: int, problem: str | None = None
    ) -> torch.Tensor | None:
        send = [0] * self.size
        send[dst] = x.shape[0]
        recv = sizes if self.rank == dst else [0] * self.size
        out = self._a2a(x, send, recv)
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
        return self._a2a(x, send, recv)

    def _all_to_all_v(
        self, x: torch.Tensor, send: list[int], recv: list[int], problem: str | None = None
    ) -> torch.Tensor:
        return self._a2a(x, send, recv)

    def _reduce_scatter_v(
        self, x: torch.Tensor, sizes: list[int], op: str, problem: str | None = None
    ) -> torch.Tensor:
        # Every rank's copy of my part, stacked in rank order, then reduced here: a fixed
        # summation order, and gloo has no uneven reduce_scatter.
        mine = sizes[self.rank]
        parts = self._a2a(x, sizes, [mine] * self.size).view(self.size, mine, *x.shape[1:])
        if op == "sum":
            return parts.sum(0)
        if op == "prod":
            return parts.prod(0)
        return parts.amax(0) if op == "max" else parts.amin(0)

    def _all_reduce(self, x: torch.Tensor, op: str) -> None:
        dist.all_reduce(x, op=_OPS[op], group=self.group)

    def _broadcast(self, x: torch.Tensor, src: int) -> None:
        dist.broadcast(x, group=self.group, group_src=src)

    def _start_exchange(
        self,
        sends: list[tuple[int, int, torch.Tensor]],
        recvs: list[tuple[int, int, torch.Tensor]],
    ) -> Callable[[], None]:
        staged = [(t, t if t.is_contiguous() else _dense(t)) for _, _, t in recvs]
        ops = [
            dist.P2POp(dist.irecv, buf, group=self.group, group_peer=peer, tag=tag)
            for (peer, tag, _), (_, buf) in zip(recvs, staged, strict=False)
        ]
        ops += [
            dist.P2POp(dist.isend, t, group=self.group, group_peer=peer, tag=tag)
            for peer, tag, t in sends
        ]
        works = dist.batch_isend_irecv(ops)

        def wait() -> None:
            for work in works:
                work.wait()
            for target, buf in staged:
                if buf is not target:
                    target.copy_(buf)
            sends.clear()  # the send tensors lived until here

        return wait

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=src)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.group)
