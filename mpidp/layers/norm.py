"""Normalisations whose statistics span the whole field: GroupNorm, InstanceNorm, BatchNorm.

Each rank computes, per statistic, its element count, mean and centred sum of squares (M2) over
its band (two passes: a sum, then the squares about the band's mean); one all-gather of those
three numbers per statistic (count-weighted, so uneven and empty shards are exact) and Chan's
merge give the global mean and variance on every rank. Statistics of float16/bfloat16 inputs are
computed in float32.

GroupNorm and InstanceNorm are one autograd Function: the forward is the statistics and one
multiply-add; the backward is two reductions per channel (sum of g, sum of g·(x - mean)), one
all-reduce of two numbers per statistic (the cross-rank terms a per-band norm drops), and the
input gradient in place. Under ``create_graph`` the backward is the composite ops instead, so
double backward works. BatchNorm and LayerNorm are composite: the merge is differentiable, and
the all-gather's backward sums every rank's gradient for this rank's statistics.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mpidp.comm import Transport
from mpidp.errors import ConfigError
from mpidp.layers.base import DomainParallel, band_forward, learn_spec
from mpidp.layers.registry import register_layer
from mpidp.ops.collectives import all_gather_v

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
    # two passes: torch.var_mean's single-pass kernel is 5x slower on CPU (28 against 6 ms
    # for 4 M floats), and the squares about the band's own mean keep every digit. An empty
    # band contributes nothing but stays in the graph: every rank must take part in the
    # all-gather's backward (a rank without grad_fn would skip it and hang).
    mean = work.sum(reduced, keepdim=True) / max(n, 1)
    centred = work - mean
    m2 = (centred * centred).sum(reduced)
    return _merge(mean.squeeze(reduced), m2, n, t)


def _merge(
    mean: torch.Tensor, m2: torch.Tensor, n: int, t: Transport
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The global mean and biased variance from every rank's band mean, centred sum of
    squares and element count (Chan's merge, in float64: exact counts past 2**24 elements);
    one all-gather, differentiable."""
    count = torch.full_like(mean, float(n))
    stats = torch.stack([count, mean, m2]).unsqueeze(0).double()  # (1, 3, ...)
    if t.size > 1:
        stats = all_gather_v(stats, [1] * t.size, 0, group=t)
    counts, means, m2s = stats[:, 0].detach(), stats[:, 1], stats[:, 2]
    total = counts.sum(0)
    weights = counts / total.clamp(min=1)
    global_mean = (weights * means).sum(0)
    global_m2 = m2s.sum(0) + (counts * (means - global_mean).square()).sum(0)
    var = global_m2 / total.clamp(min=1)
    count_all = 0 if total.is_meta else int(total.flatten()[0].item())  # meta: mpidp explain
    return global_mean.to(mean.dtype), var.to(mean.dtype), count_all


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


def _composite(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    groups: int,
    eps: float,
    t: Transport,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Group normalisation over the whole field from differentiable ops; the output, the
    (B, groups) mean and variance, and the global element count per group."""
    b, c = x.size(0), x.size(1)
    mean, var, total = global_moments(x.reshape(b, groups, -1), t)
    per_channel = c // groups  # group statistics, repeated for its channels
    y = _normalise(
        x,
        mean.repeat_interleave(per_channel, 1),
        var.repeat_interleave(per_channel, 1),
        eps,
        weight,
        bias,
    )
    return y, mean, var, total


def _samples_as_channels(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` (B, C, ...) contiguous in ``x``'s working precision, and its elements per channel.
    torch's group-norm kernels then see one sample of B*C channels in B*groups groups: the
    same memory, with per (sample, channel) results where they would sum over the batch."""
    work = x.float() if x.dtype in _LOW else x
    return work.contiguous(), x[0, 0].numel() if x.size(0) and x.size(1) else 0


class _FieldNorm(torch.autograd.Function):
    """Group normalisation (instance normalisation: one channel per group) with statistics
    over the whole field. The passes over the band are torch's fused group-norm kernels: the
    band's moments (the forward kernel with eps = 0, its output dropped), and the backward's
    per (sample, channel) sums of g and g*x; the statistics and those sums are kept in
    float64 (for float32 and lower inputs the kernel sums row by row and the rows are added
    in float64: over a whole band its float32 sums made a 4-rank weight gradient 2.3e-7 off
    in CI, beyond the oracle's bound); the input gradient is two multiply-adds."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        groups: int,
        eps: float,
        t: Transport,
    ) -> Any:
        b, c = x.size(0), x.size(1)
        work, hw = _samples_as_channels(x)
        n: int = hw * (c // groups)  # this band's elements per group
        if n:  # rstd = 1 / sqrt(var) exactly: var = rstd**-2 (0 where the band is constant)
            _, mean, rstd = torch.native_group_norm(work, None, None, 1, b * c, hw, b * groups, 0.0)
            mean, m2 = mean.view(b, groups), rstd.view(b, groups).pow(-2) * n
        else:
            mean = m2 = work.new_zeros(b, groups)
        mean, var, total = _merge(mean.double(), m2.double(), n, t)  # float64 (B, groups)
        rstd = (var + eps).rsqrt()
        k = c // groups
        y = _normalise(
            x, mean.repeat_interleave(k, 1), var.repeat_interleave(k, 1), eps, weight, bias
        )
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.groups, ctx.eps, ctx.t, ctx.total = groups, eps, t, total
        mean, var = mean.to(work.dtype), var.to(work.dtype)
        count = torch.tensor(float(total), dtype=torch.float64)
        ctx.mark_non_differentiable(mean, var, count)
        return y, mean, var, count

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor, *_: Any) -> Any:
        x, weight, bias, mean, rstd = ctx.saved_tensors  # mean, rstd: float64 (B, groups)
        if torch.is_grad_enabled():  # create_graph: the composite ops, differentiable again
            return _FieldNorm.twice(ctx, x, weight, bias, gy)
        b, c, groups = x.size(0), x.size(1), ctx.groups
        k = c // groups
        xw, hw = _samples_as_channels(x)
        g = _samples_as_channels(gy)[0]
        mean_c, r = mean.repeat_interleave(k, 1), rstd.repeat_interleave(k, 1)  # (B, C)
        # per (sample, channel), float64: the sums of g and of g * (x - mean)
        if not hw:
            g_sum = gx_sum = mean.new_zeros(b, c)
        elif xw.dtype == torch.float64:  # torch's kernel (the weight it wants is not used)
            _, gx_sum, g_sum = torch.ops.aten.native_group_norm_backward(
                g, xw, mean_c.view(1, -1), torch.ones_like(r).view(1, -1), xw.new_ones(b * c),
                1, b * c, hw, b * c, [False, True, True],
            )  # fmt: skip
            gx_sum, g_sum = gx_sum.view(b, c), g_sum.view(b, c)
        else:  # the kernel's raw sums row by row (short float32 sums), added in float64
            rows = x.size(2) if x.dim() > 2 else 1
            m = b * c * rows
            zero = xw.new_zeros(1, m)
            _, gx_rows, g_rows = torch.ops.aten.native_group_norm_backward(
                g, xw, zero, torch.ones_like(zero), xw.new_ones(m),
                1, m, hw // rows, m, [False, True, True],
            )  # fmt: skip
            g_sum = g_rows.double().view(b, c, rows).sum(-1)
            gx_sum = gx_rows.double().view(b, c, rows).sum(-1) - mean_c * g_sum
        dx = dw = db = None
        if ctx.needs_input_grad[1]:
            dw = (gx_sum * r).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            db = g_sum.sum(0).to(bias.dtype)
        if ctx.needs_input_grad[0]:
            w = r.new_ones(c) if weight is None else weight.double()
            # per (sample, group), over the whole field: the sums of g*w and g*w*(x - mean)
            per_group = torch.stack([g_sum * w, gx_sum * w]).view(2, b, groups, k).sum(-1)
            if ctx.t.size > 1:
                per_group = ctx.t.all_reduce(per_group)
            m1, m2 = per_group / max(ctx.total, 1)
            # dx = r*w*g - r*mean(g*w) - r**3 * mean(g*w*(x - mean)) * (x - mean)
            coef = -(rstd**3) * m2
            shift = -rstd * m1 - coef * mean

            def per_channel(v: torch.Tensor) -> torch.Tensor:
                return v.repeat_interleave(k, 1).unsqueeze(-1).to(xw.dtype)

            dx = torch.addcmul(per_channel(shift), xw.view(b, c, -1), per_channel(coef))
            scale = (r * w).unsqueeze(-1).to(xw.dtype)
            dx = dx.addcmul_(g.view(b, c, -1), scale).view(x.shape).to(x.dtype)
        return dx, dw, db, None, None, None

    @staticmethod
    def twice(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        gy: torch.Tensor,
    ) -> Any:
        """The backward from the composite ops, recomputed: its result is differentiable."""
        with torch.enable_grad():
            y = _composite(x, weight, bias, ctx.groups, ctx.eps, ctx.t)[0]
        needs = ctx.needs_input_grad[:3]
        wanted = [
            v for v, need in zip((x, weight, bias), needs, strict=True) if need and v is not None
        ]
        got = iter(torch.autograd.grad(y, wanted, gy, create_graph=True))
        return (*(next(got) if need else None for need in needs), None, None, None)


def _field_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    groups: int,
    eps: float,
    t: Transport,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The normalised field, the (B, groups) mean and biased variance, and the global element
    count per group."""
    y, mean, var, count = _FieldNorm.apply(x, weight, bias, groups, eps, t)
    return y, mean, var, int(count)


class DomainParallelGroupNorm(DomainParallel, nn.GroupNorm):
    """:class:`torch.nn.GroupNorm` with statistics over the whole field. Collective."""

    dry_run = True  # listed by validate_sharding_constraints and mpidp plan
    on_blocks = True  # statistics over the domain group: every block

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)
        t = self._transport(x)
        return _field_norm(x, self.weight, self.bias, self.num_groups, self.eps, t)[0]


class _InstanceNorm(DomainParallel):
    """InstanceNorm2d/3d: per (sample, channel) statistics over the whole field."""

    dry_run = True  # listed by validate_sharding_constraints and mpidp plan
    on_blocks = True  # statistics over the domain group: every block

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)  # type: ignore[misc]
        norm: nn.modules.instancenorm._InstanceNorm = self  # type: ignore[assignment]
        b, c = x.size(0), x.size(1)
        if norm.training or not norm.track_running_stats:  # batch statistics
            t = self._transport(x)
            y, mean, var, total = _field_norm(x, norm.weight, norm.bias, c, norm.eps, t)
            if norm.training and norm.track_running_stats and norm.momentum:
                # as F.instance_norm: the batch mean of every instance's update; no counter
                m = norm.momentum
                with torch.no_grad():
                    assert norm.running_mean is not None and norm.running_var is not None
                    unbiased = var.mean(0) * total / max(total - 1, 1)
                    norm.running_mean.mul_(1 - m).add_(mean.mean(0).detach(), alpha=m)
                    norm.running_var.mul_(1 - m).add_(unbiased.detach(), alpha=m)
            return y
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

    dry_run = True  # listed by validate_sharding_constraints and mpidp plan
    on_blocks = True  # statistics over the domain group: every block

    @band_forward
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

    on_blocks = True

    @band_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._alone():
            return super().forward(x)
        k = len(self.normalized_shape)
        first = x.dim() - k  # the first normalised dim
        axes = self._axes(x)
        cut = [a for a in axes if a.dim >= first]
        if not cut:  # not normalising over a sharded dim: local
            return super().forward(x)
        # the statistics span every rank holding a part of the normalised dims: the domain
        # group when they include every cut dim, else the longitude row (over W alone)
        t = self._transport(x) if len(cut) == len(axes) else cut[0].transport
        weight: torch.Tensor | None = self.weight
        bias: torch.Tensor | None = self.bias
        for axis in cut:
            spec = learn_spec(x, axis.dim, axis.transport)
            j = axis.dim - first  # the cut dim within normalized_shape
            if spec.total != self.normalized_shape[j]:
                raise ConfigError(
                    f"rank {t.rank}: {type(self).__name__}{tuple(self.normalized_shape)} "
                    f"normalises {self.normalized_shape[j]} rows along the sharded dim but the "
                    f"field has {spec.total}"
                )
            r = axis.transport.rank
            if weight is not None:
                weight = weight.narrow(j, spec.start(r), spec.sizes[r])
            if bias is not None:
                bias = bias.narrow(j, spec.start(r), spec.sizes[r])
        dims = tuple(range(first, x.dim()))
        mean, var, _ = global_moments(x, t, dims)
        shape = (*mean.shape, *([1] * k))
        rstd = (var + self.eps).rsqrt()
        y = torch.addcmul((-mean * rstd).view(shape).to(x.dtype), x, rstd.view(shape).to(x.dtype))
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return y


for _t, _l in (
    (nn.GroupNorm, DomainParallelGroupNorm),
    (nn.LayerNorm, DomainParallelLayerNorm),
    (nn.InstanceNorm2d, DomainParallelInstanceNorm2d),
    (nn.InstanceNorm3d, DomainParallelInstanceNorm3d),
    (nn.BatchNorm2d, DomainParallelBatchNorm2d),
    (nn.BatchNorm3d, DomainParallelBatchNorm3d),
):
    register_layer(_t, _l)
