"""Domain parallelism composed with DDP and FSDP2 on the mesh's axes, and the domain sum of
gradients (:func:`apply_domain_parallel`, :func:`apply_fsdp2`, :func:`apply_ddp`,
:func:`sync_domain_gradients`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mpidp.errors import ConfigError
from mpidp.parallel.config import MixedPrecision, ParallelismConfig
from mpidp.parallel.convert import convert_to_domain_parallel
from mpidp.parallel.mesh import _one_dim
from mpidp.runtime.adopt import manager_for
from mpidp.runtime.manager import (
    DistributedManager,
)

# -- domain, DDP, FSDP2 -------------------------------------------------------------------------


def apply_domain_parallel(
    model: nn.Module, domain: DeviceMesh | DistributedManager | None = None, **convert: Any
) -> nn.Module:
    """:func:`mpidp.convert_to_domain_parallel` over ``domain``: the domain sub-mesh of
    :func:`build_device_mesh`, a :class:`~mpidp.DistributedManager`, or None (the default
    manager). Keyword arguments go to the conversion. Use the return value."""
    return convert_to_domain_parallel(model, manager_for(domain), **convert)


def _block_paths(model: nn.Module, blocks: Any) -> list[nn.Module]:
    if blocks is None:
        declared = getattr(model, "_fsdp_blocks", None)
        if declared is not None:
            blocks = [declared] if isinstance(declared, str) else list(declared)
        else:
            return [
                child for child in model.children() if next(child.parameters(), None) is not None
            ]
    if isinstance(blocks, type) or (
        isinstance(blocks, tuple) and blocks and all(isinstance(b, type) for b in blocks)
    ):
        kinds = blocks if isinstance(blocks, tuple) else (blocks,)
        return [m for m in model.modules() if isinstance(m, kinds) and m is not model]
    out = []
    for b in blocks:
        if isinstance(b, nn.Module):
            out.append(b)
        else:
            try:
                out.append(model.get_submodule(str(b)))
            except AttributeError:
                raise ConfigError(
                    f"apply_fsdp2: block {b!r} is not a module of the model"
                ) from None
    return out


def apply_fsdp2(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    blocks: Iterable[str | nn.Module] | type | tuple[type, ...] | None = None,
    mixed_precision: MixedPrecision | Mapping[str, Any] | ParallelismConfig | Any = None,
    reshard_after_forward: bool | None = None,
    config: ParallelismConfig | Mapping[str, Any] | None = None,
) -> nn.Module:
    """FSDP2 over ``dp_mesh``: ``fully_shard`` each block, then the root; returns ``model``
    (sharded in place).

    ``blocks``: module paths, modules or module types; default the model's ``_fsdp_blocks``
    paths, else every direct child that has parameters. ``mixed_precision`` (a
    :class:`MixedPrecision`, a mapping such as ``{"param_dtype": "bfloat16", "reduce_dtype":
    "float32"}``, or FSDP2's policy) and ``reshard_after_forward`` default to ``config``'s
    (a :class:`ParallelismConfig` or mapping). FSDP2 averages gradients over dp; call
    :func:`sync_domain_gradients` after ``backward()`` to sum them over the domain.
    Apply tensor and domain parallelism first. Collective over ``dp_mesh``.
    """
    from torch.distributed.fsdp import fully_shard

    mesh = _one_dim(dp_mesh, "dp_mesh")
    conf = None if config is None else ParallelismConfig.coerce(config)
    if isinstance(mixed_precision, ParallelismConfig):
        conf, mixed_precision = mixed_precision, None
    mp = MixedPrecision.coerce(mixed_precision)
    if mp is None and conf is not None:
        mp = conf.mixed_precision
    if reshard_after_forward is None:
        reshard_after_forward = True if conf is None else conf.reshard_after_forward
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp is not None:
        kwargs["mp_policy"] = mp.policy()
    for block in _block_paths(model, blocks):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, **ddp_kwargs: Any) -> nn.Module:
    """``DistributedDataParallel`` over ``dp_mesh``'s process group; returns the wrapper
    (its gradients are averaged over dp in ``backward()``; call :func:`sync_domain_gradients`
    after it to sum them over the domain). Extra keyword arguments go to DDP. Collective
    over ``dp_mesh``."""
    from torch.nn.parallel import DistributedDataParallel

    mesh = _one_dim(dp_mesh, "dp_mesh")
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [device.index])
    return DistributedDataParallel(model, process_group=mesh.get_group(), **ddp_kwargs)
