"""NCAR CREDIT's ``credit.parallel`` on mpidp: the (dp, tp, domain) mesh from CREDIT's
``trainer.parallelism`` block, FSDP2 / DDP / tensor and domain parallelism applied to a model,
and the gradient average over the domain, made exact for uneven bands."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mpidp import parallel as _parallel
from mpidp.compat.credit.domain_parallel.convert import MARK, convert_to_domain_parallel
from mpidp.compat.credit.domain_parallel.local_mean import LocalBand, plain, track
from mpidp.compat.credit.domain_parallel.manager import (
    DomainParallelManager,
    install,
    resolve,
)
from mpidp.compat.credit.domain_parallel.sharding import shard_tensor
from mpidp.errors import ConfigError
from mpidp.ops.training import sum_in_buckets
from mpidp.parallel.mesh import local_tensor
from mpidp.runtime.adopt import AdoptedManager, manager_for
from mpidp.sharded import ShardedTensor

__all__ = [
    "apply_ddp",
    "apply_domain_parallel",
    "apply_fsdp2",
    "apply_tensor_parallel",
    "build_device_mesh",
    "get_domain_manager",
    "get_raw_model",
    "shard_spatial",
    "sync_domain_gradients",
    "unpad_shard_interp",
]


def build_device_mesh(parallelism_conf: dict, device: str = "cuda") -> tuple[Any, dict]:
    """``(mesh, submeshes)`` for CREDIT's ``{data, tensor, domain}`` block: the mesh is
    mpidp's 3-D ``("dp", "tp", "domain")`` mesh (CREDIT's holds only the dims in use; the
    sub-meshes, keyed ``"dp"`` when dp > 1, ``"tp"`` when tensor > 1, ``"domain"`` when
    domain > 1, as CREDIT's, are the same); ``(None, {})`` when nothing is parallel.
    Initialises mpidp when it is not. Collective."""
    meshes = _parallel.build_device_mesh(parallelism_conf, device)
    subs = {k: v for k, v in meshes.submeshes.items() if k != "dp" or v.size() > 1}
    if not subs and meshes.mesh.size() == 1:
        return None, {}
    return meshes.mesh, subs


def _amp(conf: dict) -> dict[str, Any] | None:
    """CREDIT's FSDP2 mixed precision from ``trainer.amp`` and ``trainer.fsdp2_mp_policy``."""
    trainer = conf.get("trainer", {})
    if not trainer.get("amp", False):
        return None
    policy = trainer.get("fsdp2_mp_policy", {})
    if conf.get("model", {}).get("use_spectral_norm", False) and not policy:
        return None
    return {
        "param_dtype": policy.get("param_dtype", "bfloat16"),
        "reduce_dtype": policy.get("reduce_dtype", "float32"),
        "output_dtype": policy.get("output_dtype", "bfloat16"),
    }


def apply_fsdp2(model: nn.Module, dp_mesh: Any, conf: dict) -> nn.Module:
    """FSDP2 over ``dp_mesh``, each block then the model, with the mixed precision of
    ``conf["trainer"]`` (``amp``, ``fsdp2_mp_policy``) as CREDIT reads it. mpidp's blocks are
    the model's ``_fsdp_blocks`` or its children with parameters. None (what CREDIT's usage
    passes when dp is 1): the data-parallel ranks of mpidp's manager, so that no parameter is
    sharded across the ranks of one domain group (CREDIT's None, the whole world, would
    average the domain ranks' gradients in FSDP's reduce-scatter and then again, shard by
    shard, in ``sync_domain_gradients``); the world when there is no domain group; refused
    after :func:`apply_domain_parallel` on a group of the user's (its data-parallel partners
    are not known to mpidp). Collective over ``dp_mesh``."""
    if dp_mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        m = resolve(None)
        if isinstance(m, AdoptedManager):  # a group of the user's: its dp partners unknown
            raise ConfigError(
                f"rank {m.rank}: apply_fsdp2(model, None, conf) after apply_domain_parallel on "
                f"the domain group {list(m.domain_ranks)} of your own: mpidp does not know "
                f"which ranks hold the other samples (the world would shard parameters across "
                f"the domain ranks); pass the data-parallel mesh (e.g. "
                f"init_device_mesh(device, (n,)) over the ranks that hold this band)"
            )
        if m.domain_world_size > 1:
            dp_mesh = m.mesh["dp"]
        else:
            dp_mesh = init_device_mesh(m.device.type, (torch.distributed.get_world_size(),))
    return _parallel.apply_fsdp2(model, dp_mesh, mixed_precision=_amp(conf))


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """Split the blocks that declare ``_tp_col`` / ``_tp_row`` over ``tp_mesh``, in place (uneven
    channel counts too). No communication."""
    return _parallel.apply_tensor_parallel(model, tp_mesh)


def apply_domain_parallel(model: nn.Module, domain_mesh: Any) -> nn.Module:
    """:func:`mpidp.compat.credit.domain_parallel.convert_to_domain_parallel` over
    ``domain_mesh``: the domain sub-mesh of :func:`build_device_mesh`, or a group or 1-D mesh
    of the user's (``dist.new_group``: its ranks are the domain, never mpidp's default
    group), or an mpidp manager. Sets ``model._domain_parallel_manager`` as CREDIT's trainer
    does, and makes it the process-wide manager (``get_domain_parallel_manager``), which the
    CREDIT layers and sharding functions use when given none. No communication."""
    manager = install(manager_for(domain_mesh))
    out = convert_to_domain_parallel(model, manager)
    setattr(out, "_domain_parallel_manager", manager)  # noqa: B010
    return out


def apply_ddp(model: nn.Module, dp_mesh: Any) -> nn.Module:
    """DistributedDataParallel over ``dp_mesh`` (gradients averaged over dp in backward)."""
    return _parallel.apply_ddp(model, dp_mesh)


def get_domain_manager(model: nn.Module) -> Any:
    """The ``_domain_parallel_manager`` of ``model`` or of a wrapper's ``.module`` chain."""
    m: Any = model
    while m is not None:
        if hasattr(m, "_domain_parallel_manager"):
            return m._domain_parallel_manager
        m = getattr(m, "module", None)
    return None


def get_raw_model(model: nn.Module) -> nn.Module:
    """``model`` without its ``.module`` wrappers (DDP, FSDP1)."""
    m: Any = model
    while hasattr(m, "module"):
        m = m.module
    return m


def shard_spatial(tensor: torch.Tensor, manager: DomainParallelManager | None) -> torch.Tensor:
    """This rank's band of ``tensor`` along H (dim -2); any height (CREDIT's needs H divisible
    by the domain size). No communication."""
    if manager is None or manager.domain_parallel_size <= 1:
        return tensor
    return shard_tensor(tensor, -2, manager)


def unpad_shard_interp(
    y_pred: torch.Tensor,
    padding_opt: Any,
    manager: DomainParallelManager,
    image_h: int,
    image_w: int,
) -> torch.Tensor:
    """A band of the padded prediction without its padding: ``padding_opt.pad_WE`` columns
    off every rank, ``pad_NS`` rows off the first and last rank, then the rows moved to the
    manager's partition of ``image_h`` (only boundary rows travel). Where CREDIT falls back to
    a bilinear resize of a band of the wrong size, this raises with the sizes (the padding
    config does not match the data). Collective over the domain group."""
    followed = isinstance(y_pred, LocalBand)  # the model's output: its means stay weighted
    y_pred = plain(y_pred)
    squeezed = y_pred.dim() == 5
    y = y_pred.squeeze(2) if squeezed else y_pred
    west, east = padding_opt.pad_WE
    y = y[..., west : y.size(-1) - east]
    north, south = padding_opt.pad_NS
    top = north if manager.is_first_domain_rank else 0
    bottom = south if manager.is_last_domain_rank else 0
    y = y[..., top : y.size(-2) - bottom, :]
    band = ShardedTensor.from_local(y, dim=-2, manager=manager.manager)
    if band.shape[-2] != image_h or y.size(-1) != image_w:
        raise ConfigError(
            f"rank {manager.domain_rank}: unpad_shard_interp: the unpadded prediction is "
            f"{band.shape[-2]} x {y.size(-1)}, the image {image_h} x {image_w}; check "
            f"padding_opt (pad_NS={tuple(padding_opt.pad_NS)}, pad_WE={tuple(padding_opt.pad_WE)})"
        )
    y = band.redistribute(spec=manager.manager.partition).local
    y = y.unsqueeze(2) if squeezed else y
    return track(y, -2, manager.manager) if followed else y


def sync_domain_gradients(model: nn.Module, manager: DomainParallelManager | None) -> None:
    """Average the gradients over the domain group, in place, as CREDIT does; exact on uneven
    bands as well: the model converted by :func:`mpidp.compat.credit.domain_parallel.
    convert_to_domain_parallel` weights each mean over its output's rows by the rank's share
    of the rows, so the average is, on any bands, what it is on even ones (a local-mean loss:
    the serial gradient; CREDIT's is right for even bands only). FSDP2's sharded
    gradients work. A model converted otherwise is refused (its average would be a different
    gradient). Collective over the domain group."""
    if manager is None or manager.domain_parallel_size <= 1:
        return
    if not getattr(get_raw_model(model), MARK, False):
        raise ConfigError(
            f"rank {manager.manager.rank}: sync_domain_gradients averages gradients of local-"
            f"mean losses, which is exact only for a model converted by mpidp.compat.credit."
            f"domain_parallel.convert_to_domain_parallel (it weights each rank's rows); convert "
            f"with it, or sum with mpidp.parallel.sync_domain_gradients for mpidp's own rules"
        )
    grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    m = manager.manager
    sum_in_buckets(grads, m, "domain", divide=m.domain_world_size)
