"""The whole state of a composed model: its parameters and optimizer state gathered from
tensor-parallel shards and FSDP2, and loaded back into any layout (:func:`full_state_dict`,
:func:`load_full_state_dict`, :func:`full_optimizer_state`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from mpidp.parallel.tensor_parallel import _TensorParallel

# -- whole state: gather and scatter of sharded parameters ---------------------------------------


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP/compile wrappers (their state_dict keys gain prefixes)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _tp_keys(model: nn.Module) -> dict[str, tuple[_TensorParallel, int]]:
    """state_dict key -> (tensor-parallel layer, split dim)."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, _TensorParallel):
            for name, dim in module.shards.items():
                out[f"{path}.{name}" if path else name] = (module, dim)
    return out


def tensor_parallel_size(model: nn.Module) -> int:
    """The tensor-parallel group size of ``model``'s split layers (1 when it has none)."""
    for module in _unwrap(model).modules():
        if isinstance(module, _TensorParallel):
            return module.spec.parts
    return 1


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _full(value: torch.Tensor, tp: tuple[_TensorParallel, int] | None) -> torch.Tensor:
    if _is_dtensor(value):
        value = value.full_tensor()  # type: ignore[attr-defined]
    value = value.detach()
    if tp is not None:
        layer, dim = tp
        value = layer.transport(value.device).all_gather_v(value, layer.spec.sizes, dim)
    return value


def _param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> state_dict name, for mapping optimizer state to parameters."""
    return {id(p): n for n, p in _unwrap(model).named_parameters()}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The serial model's state_dict, on every rank: FSDP2 shards gathered over dp,
    tensor-parallel shards over tp, DDP/compile prefixes removed. Collective over the world
    (every rank calls it, in the same order)."""
    inner = _unwrap(model)
    tp = _tp_keys(inner)
    return {k: _full(v, tp.get(k)) for k, v in inner.state_dict().items()}


def full_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every per-parameter tensor gathered like its parameter
    (as :func:`full_state_dict`), so the serial model's optimizer loads it. Collective."""
    inner = _unwrap(model)
    tp = _tp_keys(inner)
    names = _param_names(inner)
    state = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    full_state = {}
    for index, per_param in state["state"].items():
        param = params[index]
        key = tp.get(names.get(id(param), ""))
        full_state[index] = {
            k: _full(v, key if v.dim() and v.shape == param.shape else None)
            if isinstance(v, torch.Tensor) and (v.dim() or _is_dtensor(v))
            else v
            for k, v in per_param.items()
        }
    return {"state": full_state, "param_groups": state["param_groups"]}


def _shard_like(
    full: torch.Tensor, like: torch.Tensor, tp: tuple[_TensorParallel, int] | None
) -> Any:
    """``full`` cut like the live tensor ``like``: its tp slice, then its FSDP2 shard."""
    if tp is not None:
        layer, dim = tp
        part = layer.spec.slice(layer.tp_rank)
        full = full.narrow(dim, part.start, part.stop - part.start)
    if _is_dtensor(like):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(
            full.to(like.device, like.dtype),
            like.device_mesh,  # type: ignore[attr-defined]
            like.placements,  # type: ignore[attr-defined]
            src_data_rank=None,  # every rank holds the full tensor: no communication
        )
    return full


def load_full_state_dict(
    model: nn.Module,
    state: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_state: Mapping[str, Any] | None = None,
    *,
    strict: bool = True,
) -> None:
    """Load a serial (full) state_dict into a tensor-parallel / FSDP2 / DDP model: each rank
    keeps its shards. With ``optimizer`` and ``optimizer_state`` (as saved by
    :func:`full_optimizer_state` or a serial optimizer), the optimizer too. No communication."""
    inner = _unwrap(model)
    tp = _tp_keys(inner)
    live = inner.state_dict()
    local = {
        k: _shard_like(v, live[k], tp.get(k)) if k in live and isinstance(v, torch.Tensor) else v
        for k, v in state.items()
    }
    inner.load_state_dict(local, strict=strict)
    if optimizer is None or optimizer_state is None:
        return
    names = _param_names(inner)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    cut = {}
    for index, per_param in optimizer_state["state"].items():
        param = params[int(index)]
        key = tp.get(names.get(id(param), ""))
        cut[index] = {
            k: _shard_like(v, param, key)
            if isinstance(v, torch.Tensor) and v.dim() and v.shape == _full_shape(param, key)
            else v
            for k, v in per_param.items()
        }
    optimizer.load_state_dict({"state": cut, "param_groups": optimizer_state["param_groups"]})


def _full_shape(param: torch.Tensor, tp: tuple[_TensorParallel, int] | None) -> torch.Size:
    shape = list(param.shape)  # a DTensor's shape is its global (dp-gathered) shape
    if tp is not None:
        layer, dim = tp
        shape[dim] = layer.spec.total
    return torch.Size(shape)
