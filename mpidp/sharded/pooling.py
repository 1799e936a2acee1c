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
        cuts = _cuts(x)
        outs = [size[d - x.dim() + n] or x.shape[d] for d, _ in cuts]
        if any(o < parts for o, (_, parts) in zip(outs, cuts, strict=True)):
            return _adaptive_few(x, size, [d for d, _ in cuts], outs, n, kind)
        mod = module_with(
            cls,
            output_size=a["output_size"],
            **({"return_indices": False} if kind == "Max" else {}),
        )
        return run_layer(func, args, kwargs, mod, x)

    return handler


def _cuts(x: ShardedTensor) -> list[tuple[int, int]]:
    """(dim, ranks along it) of each cut dim: a band's one, a block's two."""
    g = x.grid
    if g is None:
        return [(x.shard_dim, x.spec.parts)]
    return [(g.dims[0], g.lat.parts), (g.dims[1], g.lon.parts)]


def _adaptive_few(
    x: ShardedTensor, size: tuple[Any, ...], dims: list[int], outs: list[int], n: int, kind: str
) -> Any:
    """An adaptive pool to fewer rows than ranks along a cut dim: each output cell of the cut
    dims is the mean (max) of its window of rows (by columns, on a block), a global reduction
    (Replicated, every rank the same; a block's one-dim reduction would be no ShardedTensor);
    the other dims pooled by torch on those cells (a window is a product of intervals, so
    pooling dim by dim is exact)."""

    def window(t: Any, d: int, o: int, out: int) -> Any:
        h = x.shape[d]
        lo, hi = (o * h) // out, -(-((o + 1) * h) // out)
        return t.narrow(d, lo, hi - lo)

    def cells(t: Any, k: int) -> Any:
        """The cells of the cut dims from the k-th on, joined along them."""
        if k == len(dims):
            return t.amax(dims, keepdim=True) if kind == "Max" else t.mean(dims, keepdim=True)
        parts = [cells(window(t, dims[k], o, outs[k]), k + 1) for o in range(outs[k])]
        return torch.cat(parts, dims[k]) if len(parts) > 1 else parts[0]

    rest = list(size)
    for d, o in zip(dims, outs, strict=True):
        rest[d - x.dim() + n] = o
    pool = getattr(F, f"adaptive_{kind.lower()}_pool{n}d")
    return pool(cells(x, 0), tuple(rest))


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
