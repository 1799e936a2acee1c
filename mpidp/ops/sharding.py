"""CREDIT-style conveniences over the domain group: cut a replicated tensor into this rank's
band, put the bands back together, shard a whole batch.

Built on the differentiable primitives of :mod:`mpidp.ops.collectives`, so gradients flow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mpidp.comm import Transport
from mpidp.errors import ConfigError
from mpidp.ops.blocks import gather_blocks, shard_blocks
from mpidp.ops.functions import Sizes, _AllGatherV, _AllGatherVReplicated, _call, _Shard
from mpidp.runtime.grid import blocks_refused
from mpidp.runtime.manager import DistributedManager, get_manager, is_initialized
from mpidp.runtime.partition import Balanced, PartitionPolicy, as_sizes

__all__ = ["gather_tensor", "shard_batch", "shard_tensor"]


def _domain(
    manager: DistributedManager | None, device: torch.device, group: Any
) -> tuple[PartitionPolicy, Transport]:
    """The partition policy and the transport: ``group`` (default: the domain group).

    A Transport given as ``group`` needs no manager (the policy is then the default manager's,
    or the balanced one when mpidp is not initialised)."""
    if isinstance(group, Transport) and manager is None:
        return (get_manager().partition if is_initialized() else Balanced()), group
    m = manager if manager is not None else get_manager()
    if isinstance(group, Transport):
        return m.partition, group
    if group is None and m._blocks:
        raise blocks_refused(m, "shard_tensor / gather_tensor with one dim over the domain group")
    return m.partition, m.transport(m.domain_group if group is None else group, device)


def _spec_for(
    policy: PartitionPolicy, t: Transport, n: int, spec: Sizes | None, dim: int
) -> list[int]:
    try:
        sizes = as_sizes(spec) if spec is not None else as_sizes(policy.spec(n, t.size))
    except ConfigError as err:
        raise ConfigError(f"rank {t.rank}: {err}") from None
    if len(sizes) != t.size or sum(sizes) != n:
        raise ConfigError(
            f"rank {t.rank}: partition {sizes} does not cut the {n} entries along dim {dim} "
            f"over {t.size} domain ranks; pass a spec with {t.size} sizes summing to {n}"
        )
    return sizes


def shard_tensor(
    x: torch.Tensor,
    dim: int | tuple[int, int] = -2,
    manager: DistributedManager | None = None,
    spec: Any = None,
    *,
    group: Any = None,
) -> torch.Tensor:
    """This rank's band of a tensor that every domain rank holds whole (no communication).

    ``spec`` (a ShardSpec or sizes) defaults to the manager's partition policy for
    ``x.size(dim)``. The backward all-gathers the band gradients, so a replicated ``x`` gets
    its full gradient on every rank. ``group`` (default: the domain group) may be any group
    :func:`mpidp.ops.collectives.resolve_transport` accepts.

    With two dims, ``dim=(lat, lon)``, this rank's latitude x longitude block of the manager's
    grid (:func:`mpidp.ops.blocks.shard_blocks`; ``spec`` a BlockSpec).
    """
    if not isinstance(dim, int):
        _no_group(group)
        return shard_blocks(x, dim, manager, spec)
    policy, t = _domain(manager, x.device, group)
    d = dim % max(x.dim(), 1)
    sizes = _spec_for(policy, t, x.size(d), spec, dim)
    return _call(_Shard, x, t, sizes, d)


def gather_tensor(
    x: torch.Tensor,
    dim: int | tuple[int, int] = -2,
    manager: DistributedManager | None = None,
    *,
    spec: Any = None,
    replicated: bool = True,
    group: Any = None,
) -> torch.Tensor:
    """The whole tensor from every domain rank's band, on every domain rank (uneven shards fine).

    The band sizes come from ``spec`` or, when None, from one small all-gather of every rank's
    extent along ``dim``. By default the downstream is **replicated** (every rank computes the
    same thing from the result; backward keeps this rank's slice): the inverse of
    :func:`shard_tensor`. ``replicated=False`` gives :func:`all_gather_v`'s partial downstream.

    With two dims, ``dim=(lat, lon)``, the whole tensor from every rank's block of the
    manager's grid (:func:`mpidp.ops.blocks.gather_blocks`; ``spec`` a BlockSpec).

    Collective over the domain group.
    """
    if not isinstance(dim, int):
        _no_group(group)
        return gather_blocks(x, dim, manager, spec, replicated=replicated)
    _, t = _domain(manager, x.device, group)
    d = dim % max(x.dim(), 1)
    if spec is not None:
        sizes = as_sizes(spec)
    else:
        sizes = [int(s) for s in t.all_gather_object(x.size(d))] if t.size > 1 else [x.size(d)]
    fn = _AllGatherVReplicated if replicated else _AllGatherV
    return _call(fn, x, t, sizes, d)


def _no_group(group: Any) -> None:
    if group is not None:
        raise ConfigError(
            "blocks are cut over the manager's grid (its latitude columns and longitude rows): "
            "pass manager=..., not group=..."
        )


def shard_batch(
    batch: Any,
    dim: int = -2,
    manager: DistributedManager | None = None,
    spec: Sizes | None = None,
) -> Any:
    """Shard every 4-D (B, C, H, W) and 5-D (B, C, T, H, W) tensor in ``batch`` along ``dim``
    (H by default) with :func:`shard_tensor`; other entries come back untouched.

    ``batch`` may be a tensor, a mapping, a list or a tuple, nested. No communication.
    """
    if isinstance(batch, torch.Tensor):
        return shard_tensor(batch, dim, manager, spec) if batch.dim() in (4, 5) else batch
    if isinstance(batch, Mapping):
        return {k: shard_batch(v, dim, manager, spec) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        items = [shard_batch(v, dim, manager, spec) for v in batch]
        return type(batch)(items) if not hasattr(batch, "_fields") else type(batch)(*items)
    return batch
