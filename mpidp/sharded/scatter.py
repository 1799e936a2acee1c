"""Handlers: graph ops with a sharded index (message passing on a band of edges).

A graph model gathers node features at its edges (``x.index_select(0, edge_index[0])``: the
edges come out sharded, :mod:`mpidp.sharded.select`) and sums the messages back into the
nodes (``out.scatter_add_(0, index, msg)``, ``scatter_reduce_``, ``index_add_``). When the
index and the messages are sharded along the scatter dim, each rank reduces its own edges into
a tensor of the whole output's shape filled with the reduction's identity, and one all-reduce
combines them: the serial result, whole on every rank (``self`` plain, or Replicated), or this
rank's rows of it (``self`` sharded along that dim). Sums are differentiable (the all-reduce's
adjoint sums every rank's share of the gradient, the rule of plain tensors); ``amax``, ``amin``
and ``prod`` are exact forward only and refused when gradients would flow through them. When
index, source and ``self`` are all sharded along another dim the scatter is local.

Reading a whole tensor at a sharded index (``index_select``, ``gather``, ``x[index]``) gives
a band cut like the index, with no communication.
"""

from __future__ import annotations

from typing import Any

import torch

from mpidp.ops.collectives import all_reduce
from mpidp.sharded import select
from mpidp.sharded.dispatch import refuse, register
from mpidp.sharded.shapes import _plain
from mpidp.sharded.tensor import Replicated, ShardedTensor

__all__: list[str] = []

#: reduction name -> (the all-reduce that combines ranks, its identity)
_COMBINE = {"sum": "sum", "mean": "sum", "amax": "max", "amin": "min", "prod": "prod"}


def _identity(reduce: str, like: torch.Tensor) -> torch.Tensor:
    if reduce in ("sum", "mean"):
        return torch.zeros_like(like)
    if reduce == "prod":
        return torch.ones_like(like)
    info = torch.finfo(like.dtype) if like.is_floating_point() else torch.iinfo(like.dtype)
    fill = (-1 if reduce == "amax" else 1) * (
        float("inf") if like.is_floating_point() else info.max
    )
    if reduce == "amax" and not like.is_floating_point():
        fill = info.min
    return torch.full_like(like, fill)


def _call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """(self, dim, index, src, reduce, include_self, alpha, in place, index_add)."""
    name = getattr(func, "__name__", "")
    x, dim, index, src = args[:4]
    dim = int(dim) % x.dim()
    if "index_add" in name:
        alpha = args[4] if len(args) > 4 else kwargs.get("alpha", 1)
        return x, dim, index, src, "sum", True, alpha, name.endswith("_"), True
    if "scatter_add" in name:
        return x, dim, index, src, "sum", True, 1, name.endswith("_"), False
    reduce = args[4] if len(args) > 4 else kwargs["reduce"]
    include_self = kwargs.get("include_self", True)
    return x, dim, index, src, reduce, include_self, 1, name.endswith("_"), False


@register(
    torch.scatter_add,
    torch.Tensor.scatter_add,
    torch.Tensor.scatter_add_,
    torch.scatter_reduce,
    torch.Tensor.scatter_reduce,
    torch.Tensor.scatter_reduce_,
    torch.index_add,
    torch.Tensor.index_add,
    torch.Tensor.index_add_,
)
def _scatter(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, dim, index, src, reduce, include_self, alpha, in_place, index_add = _call(func, args, kwargs)
    if reduce not in _COMBINE:
        raise refuse(func, args, kwargs, f"reduce={reduce!r}", f"use one of {sorted(_COMBINE)}")
    idx_dim = 0 if index_add else dim  # the dim of the index that runs along the scatter dim
    parts = [a for a in (index, src) if isinstance(a, ShardedTensor)]
    ref = next((a for a in parts if a.blocks == 1), None)
    if ref is None or any(a.blocks > 1 for a in (index, src, x) if isinstance(a, ShardedTensor)):
        raise refuse(
            func,
            args,
            kwargs,
            "a scatter whose index and source are not bands (or hold merged blocks)",
            "shard the index and the source along one dim, or gather them (.full_tensor())",
        )
    along = ref.shard_dim - (idx_dim if ref is index else dim)  # 0: sharded along the scatter
    if along or any(
        a.shard_dim != (idx_dim if a is index else dim) or a.spec != ref.spec for a in parts
    ):
        return _local_scatter(func, args, kwargs, x, index, src, ref)
    t = ref.transport
    if isinstance(x, ShardedTensor) and (x.shard_dim != dim or x.blocks > 1):
        raise refuse(
            func,
            args,
            kwargs,
            f"scattering along dim {dim} into a tensor sharded along dim {x.shard_dim}",
            "shard the output along the scatter dim, or pass it whole",
        )
    idx = index.local if isinstance(index, ShardedTensor) else ref.rows_of(index, idx_dim)
    val = src.local if isinstance(src, ShardedTensor) else ref.rows_of(src, dim)
    val = _plain(val, t)
    idx = idx.to(val.device)  # an index kept whole on the CPU meets meta values (mpidp explain)
    whole = x.shape  # a band reports its global shape
    like = torch.empty(whole, dtype=x.dtype, device=val.device)
    base = _identity(reduce, like)
    if index_add:
        mine = base.index_add(dim, idx, val, alpha=alpha)
        count = torch.zeros_like(base).index_add(dim, idx, torch.ones_like(val))
    else:
        mine = base.scatter_reduce(dim, idx, val, "sum" if reduce == "mean" else reduce)
        count = torch.zeros_like(base).scatter_add(dim, idx, torch.ones_like(val))
    op = _COMBINE[reduce]
    if op != "sum" and mine.requires_grad:
        raise refuse(
            func,
            args,
            kwargs,
            f"reduce={reduce!r} of a band of edges with gradients: mpidp has no exact "
            f"gradient of it across ranks yet",
            "detach the source (torch_geometric's softmax does), or use reduce='sum'/'mean'",
        )
    total = all_reduce(mine, op, t) if op == "sum" else t.all_reduce(mine, op)
    count = t.all_reduce(count, "sum")
    if isinstance(x, ShardedTensor):  # this rank's rows of the whole result
        total, count = x.rows_of(total, dim), x.rows_of(count, dim)
        own = x.local
    else:
        own = x.as_subclass(torch.Tensor) if isinstance(x, Replicated) else x
    hit = count > 0
    if reduce == "sum":
        out = own + total if include_self else torch.where(hit, total, own)
    elif reduce == "mean":
        mean = (own + total) / (count + 1) if include_self else total / count.clamp(min=1)
        out = torch.where(hit, mean, own)
    elif reduce == "prod":
        out = own * total if include_self else torch.where(hit, total, own)
    else:
        pick = torch.maximum if reduce == "amax" else torch.minimum
        out = torch.where(hit, pick(own, total) if include_self else total, own)
    out = out.to(x.dtype)
    if isinstance(x, ShardedTensor):
        if in_place:
            x.local.copy_(out)
            return x
        return x.like(out)
    if in_place:
        x.copy_(out)
        return x
    return out


def _local_scatter(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    x: Any,
    index: Any,
    src: Any,
    ref: ShardedTensor,
) -> Any:
    """Every tensor of the call cut along one dim other than the scatter's: each rank
    scatters its own rows (a batch of graphs)."""
    d, spec = ref.shard_dim, ref.spec
    locals_ = []
    for a in (x, index, src):
        if isinstance(a, ShardedTensor):
            if a.shard_dim != d or a.spec != spec:
                raise refuse(
                    func,
                    args,
                    kwargs,
                    "the output, index and source of a scatter cut along different dims",
                    "shard them along the same dim (the scatter dim, or one batch dim)",
                )
            locals_.append(a.local)
        elif isinstance(a, torch.Tensor) and a.dim() > d and a.size(d) == spec.total:
            locals_.append(ref.rows_of(a, d))
        else:
            raise refuse(
                func,
                args,
                kwargs,
                "a scatter mixing a band with a tensor that does not run along its sharded dim",
                "shard every tensor of the call along the same dim",
            )
    out = func(*locals_, *args[4:], **kwargs)
    if isinstance(x, ShardedTensor) and out is locals_[0]:
        return x
    return ref.like(out)


@register(torch.gather, torch.Tensor.gather, torch.take_along_dim, torch.Tensor.take_along_dim)
def _gather(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, dim, index = _gather_args(func, args, kwargs)
    if isinstance(x, ShardedTensor) and dim == x.shard_dim and x.blocks == 1:
        return _gather_from_band(func, args, kwargs, x, dim, index)
    if not isinstance(index, ShardedTensor) or isinstance(x, ShardedTensor) or index.blocks > 1:
        if isinstance(x, ShardedTensor) and isinstance(index, ShardedTensor):
            if x.shard_dim == index.shard_dim != dim and x.spec == index.spec and x.blocks == 1:
                return x.like(torch.gather(x.local, dim, index.local))
        raise refuse(
            func,
            args,
            kwargs,
            "gather from a band",
            "gather from a whole tensor at a sharded index, or along another dim of a band "
            "cut like the index",
        )
    d = index.shard_dim
    whole = _plain(x, index.transport)
    if d != dim:  # the index's rows select the same rows of x: cut x like the index
        if whole.size(d) != index.spec.total:
            raise refuse(
                func, args, kwargs, "an index whose band does not run along x's rows", "gather"
            )
        whole = index.rows_of(whole, d)
    return index.like(torch.gather(whole, dim, index.local))


def _gather_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int, Any]:
    """``(x, dim, index)`` of ``gather(x, dim, index)`` or ``take_along_dim(x, index, dim)``."""
    if func in (torch.take_along_dim, torch.Tensor.take_along_dim):
        x, index = args[0], args[1] if len(args) > 1 else kwargs["indices"]
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
        if dim is None:
            raise refuse(func, args, kwargs, "take_along_dim of the flattened band", "pass dim")
        return x, int(dim) % x.dim(), index
    return (
        args[0],
        int(args[1] if len(args) > 1 else kwargs["dim"]) % args[0].dim(),
        (args[2] if len(args) > 2 else kwargs["index"]),
    )


def _gather_from_band(
    func: Any, args: Any, kwargs: Any, x: ShardedTensor, dim: int, index: Any
) -> ShardedTensor:
    """``gather`` along the sharded dim with an index of global row ids: the result is a band
    of the index's shape (cut like a sharded index, else by the manager's partition of its
    length), each rank fetching the rows its part names (:func:`mpidp.sharded.select.
    gather_rows`)."""
    m = x.manager
    if isinstance(index, ShardedTensor):
        if index.shard_dim != dim or index.blocks > 1:
            raise refuse(
                func, args, kwargs, "an index cut along another dim than the gather's",
                "cut the index along the gathered dim, or pass it whole",
            )  # fmt: skip
        spec = index.spec
        index = index.full_tensor().as_subclass(torch.Tensor)
    else:
        index = _plain(index, x.transport)
        spec = m.partition.derived(index.size(dim), m.domain_world_size)
    if index.dim() != x.dim() or index.is_floating_point():
        raise refuse(func, args, kwargs, "an index of another rank or dtype", "match torch.gather")
    return select.gather_rows(x, index.to(torch.long), spec)
