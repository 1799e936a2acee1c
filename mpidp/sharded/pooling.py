"""Handlers: pooling (max, average, adaptive) on bands, through the same code as the converted
pooling layers (one implementation, two front ends; :mod:`mpidp.sharded.layer_calls`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mpidp.sharded.dispatch import refuse
from mpidp.sharded.layer_calls import (
    as_tuple,
    bind_args,
    check_spatial,
    module_with,
    register,
    run_layer,
)
from mpidp.sharded.tensor import ShardedTensor

__all__: list[str] = []


def _pool_handler(n: int, kind: str) -> Any:
    cls = getattr(nn, f"{kind}Pool{n}d")

    def handler(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kind == "Max":
            names = (
                "input",
                "kernel_size",
                "stride",
                "padding",
                "dilation",
                "ceil_mode",
                "return_indices",
            )
            defaults = {
                "stride": None,
                "padding": 0,
                "dilation": 1,
                "ceil_mode": False,
                "return_indices": False,
            }
        else:
            names = (
                "input",
                "kernel_size",
                "stride",
                "padding",
                "ceil_mode",
                "count_include_pad",
                "divisor_override",
            )
            defaults = {
                "stride": None,
                "padding": 0,
                "ceil_mode": False,
                "count_include_pad": True,
                "divisor_override": None,
            }
        a = bind_args(args, kwargs, names, defaults)
        x = a.pop("input")
        check_spatial(func, args, kwargs, x, n)
        if a.get("return_indices"):
            raise refuse(func, args, kwargs, "pooling indices on bands", "pool without indices")
        if a["stride"] is None or (isinstance(a["stride"], Sequence) and not a["stride"]):
            a["stride"] = a["kernel_size"]
        if n == 1 and kind == "Avg":
            a.pop("divisor_override")
        mod = module_with(cls, **a)
        return run_layer(func, args, kwargs, mod, x)

    return handler


def _adaptive_handler(n: int, kind: str) -> Any:
    cls = getattr(nn, f"Adaptive{kind}Pool{n}d")

    def handler(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        a = bind_args(
            args, kwargs, ("input", "output_size", "return_indices"), {"return_indices": False}
        )
        x = a["input"]
        check_spatial(func, args, kwargs, x, n)
        if a["return_indices"]:
            raise refuse(func, args, kwargs, "pooling indices on bands", "pool without indices")
        size = as_tuple(a["output_size"], n)
        k = x.shard_dim - (x.dim() - n)
        oh = size[k] if size[k] is not None else x.shape[x.shard_dim]
        if oh < x.spec.parts:  # a few rows: every rank gets them whole (Replicated)
            return _adaptive_few(x, size, k, oh, n, kind, func)
        mod = module_with(
            cls,
            output_size=a["output_size"],
            **({"return_indices": False} if kind == "Max" else {}),
        )
        return run_layer(func, args, kwargs, mod, x)

    return handler


def _adaptive_few(
    x: ShardedTensor, size: tuple[Any, ...], k: int, oh: int, n: int, kind: str, func: Any
) -> Any:
    """An adaptive pool to fewer rows than ranks: each output row is the mean (max) of its
    window of rows, a global reduction; the other dims pooled by torch on that row."""
    h, d = x.shape[x.shard_dim], x.shard_dim
    rows = []
    for o in range(oh):
        a, b = (o * h) // oh, -(-((o + 1) * h) // oh)
        seg = x.narrow(d, a, b - a)
        rows.append(seg.amax(d, keepdim=True) if kind == "Max" else seg.mean(d, keepdim=True))
    joined = torch.cat(rows, d) if len(rows) > 1 else rows[0]
    rest = list(size)
    rest[k] = oh
    pool = getattr(F, f"adaptive_{kind.lower()}_pool{n}d")
    return pool(joined, tuple(rest))


for _n in (1, 2, 3):
    for _kind in ("Max", "Avg"):
        register(getattr(F, f"{_kind.lower()}_pool{_n}d"), grid=True)(_pool_handler(_n, _kind))
        register(getattr(F, f"adaptive_{_kind.lower()}_pool{_n}d"), grid=True)(
            _adaptive_handler(_n, _kind)
        )
register(F.max_pool2d_with_indices, F.max_pool1d_with_indices, F.max_pool3d_with_indices)(
    lambda func, args, kwargs: (_ for _ in ()).throw(
        refuse(func, args, kwargs, "pooling indices on bands", "pool without indices")
    )
)
