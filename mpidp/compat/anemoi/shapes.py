"""anemoi's ``anemoi.models.distributed.shapes``: the per-rank shard shapes anemoi passes to
its primitives."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mpidp.errors import ConfigError
from mpidp.ops.collectives import resolve_transport
from mpidp.runtime.partition import ShardSpec

__all__ = ["change_channels_in_shape", "get_shape_shards"]


def get_shape_shards(tensor: torch.Tensor, dim: int, model_comm_group: Any = None) -> list:
    """The shape of every rank's shard of ``tensor`` cut along ``dim``: ``torch.tensor_split``'s
    cut (:meth:`mpidp.ShardSpec.balanced`: the first ``n % P`` shards one row larger; shards
    beyond the rows empty), as lists of ints. ``model_comm_group`` None: one shard (anemoi's
    "not distributed"). Local: no communication."""
    if not -tensor.dim() <= dim < tensor.dim():
        raise ConfigError(
            f"get_shape_shards: dim {dim} is out of range for a tensor of shape "
            f"{tuple(tensor.shape)}; pass a dim in [{-tensor.dim()}, {tensor.dim()})"
        )
    parts = 1 if model_comm_group is None else _size(model_comm_group, tensor.device)
    d = dim % tensor.dim()
    cut = ShardSpec.balanced(tensor.size(d), parts, allow_empty=True)
    return [[*tensor.shape[:d], size, *tensor.shape[d + 1 :]] for size in cut.sizes]


def _size(group: Any, device: torch.device) -> int:
    """The ranks in ``group``: asked of torch for its own groups and meshes (no manager, no
    communication), else of mpidp's transport."""
    if isinstance(group, dist.ProcessGroup):
        return int(dist.get_world_size(group))
    if isinstance(group, DeviceMesh):
        return int(group.size())
    return resolve_transport(group, device).size


def change_channels_in_shape(shape_list: list, channels: int) -> list:
    """The shapes with their last entry (the channels) set to ``channels``; ``[]`` for none."""
    return [[*shape[:-1], channels] for shape in shape_list] if shape_list else []
