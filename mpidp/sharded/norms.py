"""Handlers: normalisation (group, batch, instance and layer norm) on bands, through the same
code as the converted norm layers (one implementation, two front ends;
:mod:`mpidp.sharded.layer_calls`). A norm keeps its input's shape (given to the layer's run:
no run on meta tensors, whose norms import torch's compiler).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mpidp.sharded.dispatch import refuse
from mpidp.sharded.layer_calls import (
    band_weight,
    bind_args,
    module_with,
    register,
    run_layer,
)
from mpidp.sharded.tensor import ShardedTensor

__all__: list[str] = []


@register(F.group_norm, grid=True)
def _group_norm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    a = bind_args(
        args,
        kwargs,
        ("input", "num_groups", "weight", "bias", "eps"),
        {"weight": None, "bias": None, "eps": 1e-5},
    )
    x = a["input"]
    if x.shard_dim < 2:
        raise refuse(func, args, kwargs, "sharded along the batch or channel dim", "shard along H")
    w = band_weight(a["weight"], x)
    mod = module_with(
        nn.GroupNorm,
        num_groups=a["num_groups"],
        num_channels=x.shape[1],
        eps=a["eps"],
        affine=w is not None,
        weight=w,
        bias=band_weight(a["bias"], x),
    )
    return run_layer(func, args, kwargs, mod, x, shape=x.shape)


def _statistics_norm(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], flag: str, flag_default: bool
) -> tuple[ShardedTensor, dict[str, Any], dict[str, Any]]:
    """F.batch_norm / F.instance_norm's arguments (``flag``: ``training`` or
    ``use_input_stats``) and the attributes of the module that computes them."""
    names = ("input", "running_mean", "running_var", "weight", "bias", flag, "momentum", "eps")
    defaults = {"running_mean": None, "running_var": None, "weight": None, "bias": None}
    a = bind_args(
        args, kwargs, names, {**defaults, flag: flag_default, "momentum": 0.1, "eps": 1e-5}
    )
    x = a["input"]
    if x.dim() not in (4, 5) or x.shard_dim < 2:
        raise refuse(
            func,
            args,
            kwargs,
            "a normalisation of this layout on bands",
            "use (B, C, H, W) or (B, C, T, H, W) bands along H",
        )
    w = band_weight(a["weight"], x)
    attrs = {
        "num_features": x.shape[1],
        "eps": a["eps"],
        "momentum": a["momentum"],
        "affine": w is not None,
        "track_running_stats": a["running_mean"] is not None,
        "weight": w,
        "bias": band_weight(a["bias"], x),
        "running_mean": a["running_mean"],
        "running_var": a["running_var"],
    }
    return x, a, attrs


@register(F.batch_norm, grid=True)
def _batch_norm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, a, attrs = _statistics_norm(func, args, kwargs, "training", False)
    # F.batch_norm gets the momentum already resolved: the counter is the module's, not ours
    track = attrs["track_running_stats"]
    attrs["num_batches_tracked"] = torch.zeros((), dtype=torch.long) if track else None
    mod = module_with(nn.BatchNorm2d if x.dim() == 4 else nn.BatchNorm3d, **attrs)
    mod.training = bool(a["training"])
    if mod.momentum is None:
        mod.momentum = 0.0
    return run_layer(func, args, kwargs, mod, x, shape=x.shape)


@register(F.instance_norm, grid=True)
def _instance_norm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, a, attrs = _statistics_norm(func, args, kwargs, "use_input_stats", True)
    mod = module_with(nn.InstanceNorm2d if x.dim() == 4 else nn.InstanceNorm3d, **attrs)
    mod.training = bool(a["use_input_stats"])
    return run_layer(func, args, kwargs, mod, x, shape=x.shape)


@register(F.layer_norm, grid=True)
def _layer_norm(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    a = bind_args(
        args,
        kwargs,
        ("input", "normalized_shape", "weight", "bias", "eps"),
        {"weight": None, "bias": None, "eps": 1e-5},
    )
    x = a["input"]
    shape = tuple(a["normalized_shape"])
    w, b = band_weight(a["weight"], x), band_weight(a["bias"], x)
    # normalising dims after the sharded one, the batch rule ran it locally
    mod = module_with(
        nn.LayerNorm,
        normalized_shape=shape,
        eps=a["eps"],
        elementwise_affine=w is not None,
        weight=w,
        bias=b,
    )
    return run_layer(func, args, kwargs, mod, x, shape=x.shape)
