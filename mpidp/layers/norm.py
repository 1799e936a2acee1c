"""Normalisations whose statistics span the whole field: GroupNorm, InstanceNorm, BatchNorm.

Each rank computes, per statistic, its element count, mean and centred sum of squares (M2) over
its band; one all-gather of those three numbers per statistic (count-weighted, so uneven and
empty shards are exact) and Chan's merge give the global mean and variance on every rank. The
merge is differentiable: the all-gather's backward sums every rank's gradient for this rank's
statistics, so the backward carries the cross-rank terms of the mean and variance (what a
per-band norm drops). Statistics of float16/bfloat16 inputs are computed in float32.
"""

from __future__ import annotations

import torch
from torch import nn

from mpidp.collectives import all_gather_v
from mpidp.comm import Transport
from mpidp.errors import ConfigError
from mpidp.layers.base import DomainParallel, learn_spec

__all__ = [
    "DomainParallelBatchNorm2d",
    "DomainParallelBatchNorm3d",
    "DomainParallelGroupNorm",
    "DomainParallelInstanceNorm2d",
    "DomainParallelInstanceNorm3d",
    "DomainParallelLayerNorm",
    "global_moments",
]

_LOW = (torch.float16, torch.bfloat16)


def global_moments(
    x: torch.Tensor, t: Transport, dims: int | tuple[int, ...] = -1
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Mean and biased variance of ``x`` over ``dims`` (its local elements) and over every
    rank of ``t``, and the global element count per statistic. Differentiable; one
    all-gather. Collective over the transport's group."""
    work = x.float() if x.dtype in _LOW else x
    reduced = (dims,) if isinstance(dims, int) else dims
    n = 1
    for d in reduced:
        n *= work.size(d)
    if n:
        var, mean = torch.var_mean(work, reduced, correction=0)  # one native pass
    else:  # an empty band contributes nothing, but stays in the graph: every rank must take
        # part in the all-gather's backward (a rank without grad_fn would skip it and hang)
        mean = work.sum(reduced)
        var = mean * 0
    count = torch.full_like(mean, float(n))
    # merged in float64: exact counts past 2**24 elements, and the merge costs nothing
    stats = torch.stack([count, mean, var * n]).unsqueeze(0).double()  # (1, 3, ...)
    if t.size > 1:
        stats = all_gather_v(stats, [1] * t.size, 0, group=t)
    counts, means, m2s = stats[:, 0].detach(), stats[:, 1], stats[:, 2]
    total = counts.sum(0)
    weights = counts / total.clamp(min=1)
    global_mean = (weights * means).sum(0)
    global_m2 = m2s.sum(0) + (counts * (means - global_mean).square()).sum(0)
    var = global_m2 / total.clamp(min=1)
    return global_mean.to(work.dtype), var.to(work.dtype), int(total.flatten()[0].item())


def _normalise(
    x: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    eps: float,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` as one multiply-add over the field:
    per (sample, channel) scale and shift, broadcast over the spatial dims. ``mean`` and
    ``var`` are (B, C) or (C,)."""
    scale = (var + eps).rsqrt()
    if weight is not None:
        scale = scale * weight
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias
    shape = (*scale.shape, *([1] * (x.dim() - scale.dim())))
    if scale.dim() == 1:  # per channel: (C,) -> (1, C, 1, ...)
        shape = (1, -1, *([1] * (x.dim() - 2)))
    return torch.addcmul(shift.view(shape).to(x.dtype), x, scale.view(shape).to(x.dtype))


class DomainParallelGroupNorm(DomainParallel, nn.GroupNorm):
    """:class:`torch.nn.GroupNorm` with statistics over the whole field. Collective."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)
        b, c = x.size(0), x.size(1)
        mean, var, _ = global_moments(x.reshape(b, self.num_groups, -1), self._transport(x))
        per_channel = c // self.num_groups  # group statistics, repeated for its channels
        mean = mean.repeat_interleave(per_channel, 1)
        var = var.repeat_interleave(per_channel, 1)
        return _normalise(x, mean, var, self.eps, self.weight, self.bias)


class _InstanceNorm(DomainParallel):
    """InstanceNorm2d/3d: per (sample, channel) statistics over the whole field."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)  # type: ignore[misc]
        norm: nn.modules.instancenorm._InstanceNorm = self  # type: ignore[assignment]
        b, c = x.size(0), x.size(1)
        flat = x.reshape(b, c, -1)
        use_batch = norm.training or not norm.track_running_stats
        if use_batch:
            mean, var, total = global_moments(flat, self._transport(x))
            if norm.training and norm.track_running_stats and norm.momentum:
                # as F.instance_norm: the batch mean of every instance's update; no counter
                m = norm.momentum
                with torch.no_grad():
                    assert norm.running_mean is not None and norm.running_var is not None
                    unbiased = var.mean(0) * total / max(total - 1, 1)
                    norm.running_mean.mul_(1 - m).add_(mean.mean(0).detach(), alpha=m)
                    norm.running_var.mul_(1 - m).add_(unbiased.detach(), alpha=m)
        else:
            assert norm.running_mean is not None and norm.running_var is not None
            mean = norm.running_mean.expand(b, c)
            var = norm.running_var.expand(b, c)
        return _normalise(x, mean, var, norm.eps, norm.weight, norm.bias)


class DomainParallelInstanceNorm2d(_InstanceNorm, nn.InstanceNorm2d):
    """:class:`torch.nn.InstanceNorm2d` with statistics over the whole field. Collective."""


class DomainParallelInstanceNorm3d(_InstanceNorm, nn.InstanceNorm3d):
    """:class:`torch.nn.InstanceNorm3d` with statistics over the whole field. Collective."""


def _update(
    norm: nn.modules.batchnorm._BatchNorm, mean: torch.Tensor, unbiased_var: torch.Tensor
) -> None:
    """BatchNorm's running statistics exactly as torch updates them (momentum, or a cumulative
    average when momentum is None)."""
    assert norm.running_mean is not None and norm.running_var is not None
    assert norm.num_batches_tracked is not None
    with torch.no_grad():
        norm.num_batches_tracked.add_(1)
        m = norm.momentum if norm.momentum is not None else 1.0 / float(norm.num_batches_tracked)
        norm.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
        norm.running_var.mul_(1 - m).add_(unbiased_var.detach(), alpha=m)


class _BatchNorm(DomainParallel):
    """BatchNorm2d/3d: per channel statistics over the batch and the whole field (the domain
    group; data-parallel replicas keep their own, as torch's BatchNorm under DDP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)  # type: ignore[misc]
        norm: nn.modules.batchnorm._BatchNorm = self  # type: ignore[assignment]
        use_batch = norm.training or norm.running_mean is None
        if not use_batch:  # eval with running statistics: purely local
            return nn.functional.batch_norm(
                x, norm.running_mean, norm.running_var, norm.weight, norm.bias, False, 0.0, norm.eps
            )
        dims = (0, *range(2, x.dim()))
        mean, var, total = global_moments(x, self._transport(x), dims)
        if norm.training and norm.track_running_stats:
            _update(norm, mean, var * total / max(total - 1, 1))
        return _normalise(x, mean, var, norm.eps, norm.weight, norm.bias)


class DomainParallelBatchNorm2d(_BatchNorm, nn.BatchNorm2d):
    """:class:`torch.nn.BatchNorm2d` with statistics over the whole field. Collective."""


class DomainParallelBatchNorm3d(_BatchNorm, nn.BatchNorm3d):
    """:class:`torch.nn.BatchNorm3d` with statistics over the whole field. Collective."""


class DomainParallelLayerNorm(DomainParallel, nn.LayerNorm):
    """:class:`torch.nn.LayerNorm` whose normalised dims include the sharded one: statistics
    over the whole field; each rank applies its rows of the (replicated) weight and bias, so
    their gradients are partial until :func:`mpidp.sync_gradients` sums them. Collective."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = len(self.normalized_shape)
        d = x.dim() + self.shard_dim
        if self._alone() or d < x.dim() - k:  # not normalising over the sharded dim: local
            return super().forward(x)
        t = self._transport(x)
        spec = learn_spec(x, d, t)
        j = d - (x.dim() - k)  # the sharded dim within normalized_shape
        if spec.total != self.normalized_shape[j]:
            raise ConfigError(
                f"rank {t.rank}: {type(self).__name__}{tuple(self.normalized_shape)} normalises "
                f"{self.normalized_shape[j]} rows along the sharded dim but the field has "
                f"{spec.total}"
            )
        dims = tuple(range(x.dim() - k, x.dim()))
        mean, var, _ = global_moments(x, t, dims)
        shape = (*mean.shape, *([1] * k))
        rstd = (var + self.eps).rsqrt()
        y = torch.addcmul((-mean * rstd).view(shape).to(x.dtype), x, rstd.view(shape).to(x.dtype))
        rows = slice(spec.start(t.rank), spec.stop(t.rank))
        if self.weight is not None:
            y = y * self.weight.narrow(j, rows.start, rows.stop - rows.start)
        if self.bias is not None:
            y = y + self.bias.narrow(j, rows.start, rows.stop - rows.start)
        return y
