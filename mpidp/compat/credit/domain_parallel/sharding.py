"""CREDIT's ``shard_tensor``, ``gather_tensor`` and ``shard_batch`` over mpidp's."""

from __future__ import annotations

from typing import Any

import torch

from mpidp.compat.credit.domain_parallel.manager import DomainParallelManager, resolve
from mpidp.ops.sharding import gather_tensor as _gather
from mpidp.ops.sharding import shard_batch as _shard_batch
from mpidp.ops.sharding import shard_tensor as _shard

__all__ = ["gather_tensor", "shard_batch", "shard_tensor"]


def shard_tensor(
    x: torch.Tensor, dim: int = -2, manager: DomainParallelManager | None = None
) -> torch.Tensor:
    """This rank's band of ``x`` along ``dim`` (no communication). Any length: the manager's
    partition (CREDIT raises unless the length divides evenly)."""
    return _shard(x, dim, resolve(manager))


def gather_tensor(
    x: torch.Tensor, dim: int = -2, manager: DomainParallelManager | None = None
) -> torch.Tensor:
    """The whole tensor from every rank's band along ``dim`` (bands of any lengths), on
    every rank. Like CREDIT's (an all_gather), the result carries no gradient back to the
    bands: use :func:`mpidp.gather_tensor` for a differentiable gather. Collective over the
    domain group."""
    return _gather(x.detach(), dim, resolve(manager))


def shard_batch(
    batch: dict[str, Any],
    spatial_dims_5d: int = -2,
    spatial_dims_4d: int = -2,
    manager: DomainParallelManager | None = None,
) -> dict[str, Any]:
    """Every 5-D entry of ``batch`` cut along ``spatial_dims_5d``, every 4-D entry along
    ``spatial_dims_4d``; other entries as they are. No communication."""
    m = resolve(manager)
    if m.domain_world_size <= 1:
        return batch
    dims = {5: spatial_dims_5d, 4: spatial_dims_4d}
    return {
        k: _shard_batch(v, dims[v.dim()], m)
        if isinstance(v, torch.Tensor) and v.dim() in dims
        else v
        for k, v in batch.items()
    }
