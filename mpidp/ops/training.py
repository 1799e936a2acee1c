"""Exact training math on bands and blocks: global reductions, metrics, latitude weights,
gradient sync.

The loss of a domain-parallel model is the serial loss: sums and counts (or weights) are reduced
over the domain group first and divided after, so uneven shards weigh exactly what their rows
weigh. Gradients are summed over domain ranks (each holds part of every parameter's gradient)
and averaged over data-parallel ranks (each saw different samples): one all-reduce over the
world divided by the data-parallel size does both.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from mpidp.comm.base import fingerprint
from mpidp.errors import CommError, ConfigError
from mpidp.ops.bands import learn_spec
from mpidp.ops.collectives import reduce_from
from mpidp.runtime import rng
from mpidp.runtime.manager import DistributedManager, get_manager
from mpidp.runtime.partition import ShardSpec

__all__ = [
    "broadcast_parameters",
    "global_acc",
    "global_mean",
    "global_rmse",
    "global_sum",
    "latitude_weights",
    "mean_share",
    "sync_gradients",
]

_LOW = (torch.float16, torch.bfloat16)
_BUCKET_BYTES = 32 << 20


def _group(manager: DistributedManager | None, group: Any) -> Any:
    return group if group is not None else manager


def _dims(x: torch.Tensor, dims: int | Sequence[int] | None) -> list[int]:
    if dims is None:
        return list(range(x.dim()))
    return [d % x.dim() for d in ([dims] if isinstance(dims, int) else dims)]


def _sums(
    x: torch.Tensor, weights: torch.Tensor | None, dims: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local weighted sum and total weight over ``dims`` (float32 or better)."""
    work = x.float() if x.dtype in _LOW else x
    if weights is None:
        count = math.prod(x.size(d) for d in dims)
        total = work.sum(dims)
        return total, torch.full_like(total, float(count))
    w = torch.broadcast_to(weights.to(work.dtype), work.shape)
    return (work * w).sum(dims), w.sum(dims)


def global_sum(
    x: torch.Tensor,
    dims: int | Sequence[int] | None = None,
    manager: DistributedManager | None = None,
    *,
    group: Any = None,
) -> torch.Tensor:
    """Sum of ``x`` over ``dims`` (default: all) of every rank's band; the same value on every
    rank of the group (default: the domain group). Differentiable: each rank's backward covers
    its own band. Collective."""
    local = x.float() if x.dtype in _LOW else x
    return reduce_from(local.sum(_dims(x, dims)), _group(manager, group))


def global_mean(
    x: torch.Tensor,
    weights: torch.Tensor | None = None,
    dims: int | Sequence[int] | None = None,
    manager: DistributedManager | None = None,
    *,
    group: Any = None,
) -> torch.Tensor:
    """The serial (weighted) mean of the whole field: ``sum(w * x) / sum(w)`` over ``dims``
    (default: all) of every rank's band, numerator and denominator reduced together in one
    all-reduce, then divided. ``weights`` broadcast against ``x`` (latitude weights of this
    band: shape (rows, 1)). Exact for uneven shards; differentiable. Collective."""
    total, weight = _sums(x, weights, _dims(x, dims))
    both = reduce_from(torch.stack([total, weight]), _group(manager, group))
    return both[0] / both[1]


def global_rmse(
    pred: torch.Tensor,
    target: torch.Tensor,
    weights: torch.Tensor | None = None,
    dims: int | Sequence[int] | None = None,
    manager: DistributedManager | None = None,
    *,
    group: Any = None,
) -> torch.Tensor:
    """Root of the global (weighted) mean squared error over ``dims``: per variable with
    ``dims=(0, 2, 3)`` on (B, C, H, W). Collective."""
    return global_mean((pred - target).square(), weights, dims, manager, group=group).sqrt()


def global_acc(
    pred_anomaly: torch.Tensor,
    target_anomaly: torch.Tensor,
    weights: torch.Tensor | None = None,
    dims: int | Sequence[int] | None = None,
    manager: DistributedManager | None = None,
    *,
    group: Any = None,
) -> torch.Tensor:
    """Anomaly correlation ``sum(w a b) / sqrt(sum(w a^2) sum(w b^2))`` over the whole field
    (anomalies: fields minus climatology). One all-reduce of the three sums. Collective."""
    d = _dims(pred_anomaly, dims)
    ab, _ = _sums(pred_anomaly * target_anomaly, weights, d)
    aa, _ = _sums(pred_anomaly.square(), weights, d)
    bb, _ = _sums(target_anomaly.square(), weights, d)
    s = reduce_from(torch.stack([ab, aa, bb]), _group(manager, group))
    return s[0] / (s[1] * s[2]).sqrt()


def latitude_weights(
    lat: int | Sequence[float] | torch.Tensor,
    spec: ShardSpec | Sequence[int] | None = None,
    manager: DistributedManager | None = None,
    *,
    poles: str = "rows",
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``cos(latitude)`` of this rank's rows, normalised so that the global mean is 1; shape
    (rows, 1), to broadcast over (..., H, W) bands.

    ``lat`` is the global latitude in degrees (any order), or a row count for an equiangular
    grid from 90 to -90 with the poles on the first and last rows (``poles="rows"``, e.g. 721)
    or half a row beyond them (``poles="half"``, e.g. 720). ``spec``: the partition of the rows
    (default: the manager's policy over the ranks along the latitude: the domain group on
    bands, this rank's latitude column on blocks, whose rows these are); ``spec=[n]`` gives the
    whole column, for a loss on ShardedTensors (which cuts it to each band). Local: no
    communication.
    """
    if isinstance(lat, int):
        n = lat
        if poles == "rows":
            lat_t = torch.linspace(90.0, -90.0, n, dtype=torch.float64)
        elif poles == "half":
            lat_t = 90.0 - 180.0 * (torch.arange(n, dtype=torch.float64) + 0.5) / n
        else:
            raise ConfigError(f"poles={poles!r}: use 'rows' or 'half'")
    else:
        lat_t = torch.as_tensor(lat, dtype=torch.float64).flatten()
    w = torch.cos(torch.deg2rad(lat_t)).clamp(min=0.0)
    w = w / w.mean()
    spec = spec if spec is None or isinstance(spec, ShardSpec) else ShardSpec.from_sizes(spec)
    if spec is not None and spec.parts == 1:  # the whole column (a ShardedTensor loss cuts it)
        rank = 0
    else:
        m = manager or get_manager()
        # the rows are cut over the latitude column: the domain group on bands (the grid (P, 1))
        parts, rank = m.grid[0], m.grid_coords[0]
        if spec is None:
            try:
                spec = m.partition.spec(w.numel(), parts)
            except ConfigError as err:
                raise ConfigError(f"rank {m.rank}: latitude_weights: {err}") from None
        elif spec.parts != parts:
            raise ConfigError(
                f"rank {m.rank}: latitude_weights: the partition {spec} cuts the rows over "
                f"{spec.parts} ranks but the latitude is cut over {parts} (the grid "
                f"{m.grid}); pass the rows' partition over the latitude column, e.g. "
                f"spec=manager.block_spec(shape).lat"
            )
    if spec.total != w.numel():
        raise ConfigError(
            f"latitude_weights: {w.numel()} latitudes but the partition covers {spec.total} rows"
        )
    return w[spec.slice(rank)].to(dtype).unsqueeze(-1)


def _buckets(grads: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    """Gradients in groups of one dtype and device, about 32 MB each, in a fixed order."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        if bucket and (
            g.dtype != bucket[0].dtype
            or g.device != bucket[0].device
            or size + g.numel() * g.element_size() > _BUCKET_BYTES
        ):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel() * g.element_size()
    if bucket:
        yield bucket


def sync_gradients(model: nn.Module, manager: DistributedManager | None = None) -> None:
    """Sum every parameter gradient over the domain ranks and average it over the
    data-parallel ranks: one all-reduce over the world per bucket, divided by the
    data-parallel size. Parameters without a gradient are skipped (the same ones on every
    rank: the graph is the same everywhere). Collective over the world; over the domain
    group alone for a manager whose data-parallel partners are not known (a group of the
    user's, :class:`~mpidp.runtime.adopt.AdoptedManager`: the world holds other groups, whose
    gradients are other samples')."""
    m = manager or get_manager()
    _refuse_owned_reduction(model, m)
    named = list(model.named_parameters())
    over = _summed_over(m)
    _agree_on_gradients(named, m, rng.draws(model), over)
    grads = [p.grad for _, p in named if p.grad is not None]
    sum_in_buckets(grads, m, over, divide=m.dp_world_size)


def _summed_over(m: DistributedManager) -> str:
    """The group a gradient sync of ``m`` runs over: ``"world"`` (the domain ranks summed, the
    data-parallel ranks averaged, in one all-reduce), or ``"domain"`` alone where the world
    holds ranks ``m`` does not place (a group of the user's: its data-parallel partners are
    unknown, and the other ranks' gradients are other samples')."""
    return "world" if m.dp_world_size * m.domain_world_size == m.world_size else "domain"


def _gradient_facts(named: list[tuple[str, nn.Parameter]]) -> list[tuple[str, str]]:
    """Per parameter: whether this rank has a gradient for it, and its shape and dtype."""
    out = []
    for name, p in named:
        if p.grad is None:
            why = "requires_grad=False" if not p.requires_grad else "grad is None"
            out.append((name, f"no gradient ({why})"))
        else:
            out.append((name, f"gradient {tuple(p.grad.shape)} {p.grad.dtype}"))
    return out


def _agree_on_gradients(
    named: list[tuple[str, nn.Parameter]],
    m: DistributedManager,
    draws: bool = False,
    over: str = "world",
) -> None:
    """Every rank must hold gradients for the same parameters, of the same shapes and dtypes:
    otherwise the buckets would pair one rank's gradient with another's (a silent mix when
    the lengths happen to agree). One all-gather of a fingerprint; on a mismatch every rank
    raises the same error naming the parameters and the ranks. A model that ``draws`` random
    numbers also checks its domain ranks' generators are in step (mpidp.runtime.rng), in the same
    message. Collective over ``over`` (the world, or the domain group alone)."""
    facts = tuple(
        (n, p.grad is not None, None if p.grad is None else (p.grad.shape, p.grad.dtype))
        for n, p in named
    )
    t = m.transport(over, "cpu")
    device = next((p.grad.device for _, p in named if p.grad is not None), None)
    table = t.all_gather_ints([fingerprint(facts), rng.fingerprint(device) if draws else 0])
    p = m.domain_world_size
    for g in range(len(table) // p):  # every rank checks every group: all raise alike
        prints = [row[1] for row in table[g * p : (g + 1) * p]]
        rng.check_in_step(prints, m.rank, f"sync_gradients (data-parallel group {g})")
    if all(row[0] == table[0][0] for row in table):
        return
    everyone = t.all_gather_object(_gradient_facts(named))
    lines = []
    names = sorted({n for theirs in everyone for n, _ in theirs})
    for name in names:
        seen = [dict(theirs).get(name, "no such parameter") for theirs in everyone]
        if any(s != seen[0] for s in seen):
            by = {s: [r for r, x in enumerate(seen) if x == s] for s in dict.fromkeys(seen)}
            lines.append(f"{name!r}: " + "; ".join(f"{s} on ranks {r}" for s, r in by.items()))
    raise CommError(
        f"rank {m.rank} of {m.world_size}: sync_gradients: the ranks hold gradients for "
        f"different parameters: "
        + ", ".join(lines[:8])
        + (f" and {len(lines) - 8} more" if len(lines) > 8 else "")
        + "; freeze the same parameters on every rank (requires_grad), and run the same "
        "forward and backward on every rank (or give unused parameters zero gradients)"
    )


def sum_in_buckets(
    tensors: list[torch.Tensor], manager: DistributedManager, group: str, divide: int = 1
) -> None:
    """Sum ``tensors`` over ``group`` in place (then divide by ``divide``): one all-reduce per
    bucket of about 32 MB of one dtype and device. Collective over the group."""
    for bucket in _buckets(tensors):
        t = manager.transport(group, bucket[0].device)
        flat = t.all_reduce(torch.cat([g.reshape(-1) for g in bucket]), "sum")
        if divide > 1:
            flat.div_(divide)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _refuse_owned_reduction(model: nn.Module, m: DistributedManager) -> None:
    """sync_gradients averages over every rank outside the domain group: wrong when DDP or
    FSDP2 already averaged over dp, or when tensor-parallel shards would be mixed."""
    owner = None
    if hasattr(model, "module") and hasattr(model, "process_group") and hasattr(model, "reducer"):
        owner = "DistributedDataParallel already averages the gradients over dp"
    elif any(hasattr(p, "device_mesh") for p in model.parameters()):
        owner = "FSDP2 (or another DTensor wrapper) already reduces the gradients over dp"
    elif any(getattr(mod, "shards", None) and hasattr(mod, "_tp_mesh") for mod in model.modules()):
        owner = "the model has tensor-parallel layers, whose shards must not be summed together"
    if owner is not None:
        raise ConfigError(
            f"rank {m.rank}: sync_gradients on this model: {owner}; call "
            f"mpidp.parallel.sync_domain_gradients(model, manager) after backward() instead"
        )


def broadcast_parameters(
    model: nn.Module, manager: DistributedManager | None = None, src: int = 0
) -> None:
    """Every parameter and buffer set to world rank ``src``'s, so all ranks start identical.
    Collective over the world."""
    m = manager or get_manager()
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            t = m.transport("world", tensor.device)
            tensor.copy_(t.broadcast(tensor.detach(), src))


class _MeanShare(torch.autograd.Function):
    """Identity forward; backward scales the gradient by ``w`` (see :func:`mean_share`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: float) -> Any:
        ctx.w = w
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return g * ctx.w, None


def mean_share(
    band: torch.Tensor, dim: int | Sequence[int] = -2, manager: DistributedManager | None = None
) -> torch.Tensor:
    """``band`` unchanged, its gradient scaled by ``P * n / N`` (``n`` this rank's points along
    the cut dims, ``N`` the points of all ``P`` domain ranks).

    For training loops written for even bands: each rank's loss is the mean over its own rows
    and the domain ranks' gradients are then averaged. That is the serial gradient only when
    every rank holds N / P rows; with this scaling of the band that the loss reads, the sum
    over ranks of the local means' gradients is ``P`` times the gradient of the mean over all
    rows, exact for any cut (the scaling sits before the halo exchanges, so gradients that
    cross ranks carry the weight of the loss they came from). Even bands: the weight is 1.

    ``dim``: the cut dim of a band; on latitude x longitude blocks ``(latitude, longitude)``
    (one int: it and the dim after it, as the layers count), ``n / N`` then the product of the
    block's shares along both. No communication when gradients are off; else one all-gather of
    one integer along each cut axis. Collective over the domain group.
    """
    if not (torch.is_grad_enabled() and band.requires_grad):
        return band

    m = manager or get_manager()
    if m.domain_world_size == 1:
        return band
    dims = [dim] if isinstance(dim, int) else list(dim)
    if m._blocks and len(dims) == 1:
        dims.append(dims[0] % band.dim() + 1)
    weight = float(m.domain_world_size)
    for axis, d in zip(("lat", "lon") if m._blocks else (None,), dims, strict=False):
        t = m.transport(axis, band.device)
        spec = learn_spec(band, d % band.dim(), t)
        if spec.total == 0:
            return band
        weight *= spec.sizes[t.rank] / spec.total
    return _MeanShare.apply(band, weight)
