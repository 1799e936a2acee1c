"""The gradient sync overlapping the backward: buckets reduced as their gradients arrive.

:func:`mpidp.sync_gradients` reduces every gradient after the backward. :class:`GradientSync`
computes the same: each parameter gradient summed over the domain ranks and averaged over the
data-parallel ranks (one all-reduce over the world per bucket, then a division by dp), but it
starts each bucket's all-reduce from the gradient hooks, while the backward goes on computing
the gradients of the layers before, as DDP does. :meth:`GradientSync.wait` completes them.

The buckets are fixed when the object is made, in reverse order of the parameters (the
backward reaches the last layers first), of one dtype and device, about ``bucket_bytes`` each,
and the ranks agree on them then (one all-gather of a fingerprint of the names, shapes and
dtypes). Every rank starts the buckets' reductions in the same order, a bucket only after the
one before it: a bucket whose gradients are complete waits for the ones before it, and
:meth:`~GradientSync.wait` starts whatever the hooks did not (a parameter without a gradient
counts as zeros, and keeps no gradient). So the messages always pair up, and the check that
every rank holds gradients for the same parameters (:func:`mpidp.sync_gradients`' check)
runs in ``wait`` as well, raising on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from mpidp.comm import PendingExchange
from mpidp.comm.base import fingerprint
from mpidp.errors import CommError
from mpidp.ops.training import (
    _BUCKET_BYTES,
    _agree_on_gradients,
    _refuse_owned_reduction,
    _summed_over,
)
from mpidp.runtime import rng
from mpidp.runtime.manager import DistributedManager, get_manager

__all__ = ["GradientSync"]


class _Bucket:
    """Parameters reduced together: their flat buffer and the reduction in flight."""

    def __init__(self, params: list[tuple[str, nn.Parameter]]) -> None:
        self.params = params
        self.ready = 0  # gradients that arrived in this backward
        self.flat: torch.Tensor | None = None
        self.pending: PendingExchange | None = None


class GradientSync:
    """:func:`mpidp.sync_gradients` overlapping the backward (see the module docstring).

    Usage::

        sync = mpidp.GradientSync(model)      # collective over the world, once
        for x, y in loader:
            loss_fn(model(x), y).backward()   # buckets start as their gradients arrive
            sync.wait()                       # collective: the synced gradients
            optimizer.step(); optimizer.zero_grad()

    One backward per :meth:`wait` (gradient accumulation over several backwards: call
    ``wait`` after the last, with the hooks off before, :meth:`pause`). ``bucket_bytes``: the
    size of a bucket (the blocking sync's 32 MB by default). :meth:`remove` takes the hooks
    off. Exact: the same sums and division as the blocking sync, per element.
    """

    def __init__(
        self,
        model: nn.Module,
        manager: DistributedManager | None = None,
        bucket_bytes: int = _BUCKET_BYTES,
    ) -> None:
        m = manager or get_manager()
        _refuse_owned_reduction(model, m)
        self.manager, self.model = m, model
        self.named = list(model.named_parameters())
        trained = [(n, p) for n, p in reversed(self.named) if p.requires_grad]
        self.buckets: list[_Bucket] = []
        size = 0
        for name, p in trained:
            last = self.buckets[-1].params if self.buckets else None
            nbytes = p.numel() * p.element_size()
            if (
                last is None
                or p.dtype != last[0][1].dtype
                or p.device != last[0][1].device
                or size + nbytes > bucket_bytes
            ):
                self.buckets.append(_Bucket([]))
                size = 0
            self.buckets[-1].params.append((name, p))
            size += nbytes
        self._of = {id(p): i for i, b in enumerate(self.buckets) for _, p in b.params}
        self._next = 0  # the first bucket not started in this backward
        self.paused = False
        self._agree_on_buckets()
        self._hooks = [p.register_post_accumulate_grad_hook(self._arrived) for _, p in trained]

    def __repr__(self) -> str:
        return f"GradientSync(buckets={len(self.buckets)}, rank={self.manager.rank})"

    def _agree_on_buckets(self) -> None:
        facts = tuple(
            tuple((n, tuple(p.shape), str(p.dtype)) for n, p in b.params) for b in self.buckets
        )
        t = self.manager.transport(_summed_over(self.manager), "cpu")
        prints = [row[0] for row in t.all_gather_ints([fingerprint(facts)])]
        if any(f != prints[0] for f in prints):
            differ = [r for r, f in enumerate(prints) if f != prints[0]]
            raise CommError(
                f"rank {self.manager.rank}: GradientSync: the ranks' models differ (parameter "
                f"names, shapes, dtypes or requires_grad; ranks {differ} differ from rank 0); "
                f"build the same model on every rank"
            )

    @property
    def started(self) -> int:
        """Buckets whose reduction is in flight (started by the hooks since the last
        :meth:`wait`)."""
        return self._next

    def pause(self, paused: bool = True) -> None:
        """Hooks off (``paused``) for backwards whose gradients accumulate before the one
        that is synced; local."""
        self.paused = paused

    def _arrived(self, p: torch.Tensor) -> None:
        if self.paused:
            return
        bucket = self.buckets[self._of[id(p)]]
        bucket.ready += 1
        if bucket.ready > len(bucket.params):
            raise CommError(
                f"rank {self.manager.rank}: GradientSync: a second backward before wait(); "
                f"call wait() after each backward, or pause() the hooks for the ones before"
            )
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if b.ready < len(b.params):
                break
            self._start(b)
            self._next += 1

    def _start(self, b: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in b.params]
        b.flat = torch.cat([g.reshape(-1) for g in grads])
        t = self.manager.transport(_summed_over(self.manager), b.flat.device)
        b.pending = t.start_all_reduce(b.flat, "sum")

    def wait(self) -> None:
        """Start the buckets the hooks did not, wait for every one, check that every rank
        holds gradients for the same parameters, and write the synced gradients (divided by
        the data-parallel size). Collective over the world (the domain group alone, as for
        :func:`~mpidp.sync_gradients`, where the manager places only its group)."""
        m = self.manager
        for b in self.buckets[self._next :]:
            self._start(b)
        for b in self.buckets:
            assert b.pending is not None
            b.pending.wait()
        self._next = 0
        _agree_on_gradients(self.named, m, rng.draws(self.model), _summed_over(m))
        for b in self.buckets:
            flat, b.flat, b.pending, b.ready = b.flat, None, None, 0
            assert flat is not None
            if m.dp_world_size > 1:
                flat.div_(m.dp_world_size)
            offset = 0
            for _, p in b.params:
                if p.grad is not None:
                    p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()

    def remove(self) -> None:
        """Take the hooks off the parameters. Local."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
