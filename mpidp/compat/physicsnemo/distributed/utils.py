"""PhysicsNeMo's ``physicsnemo.distributed.utils`` over :mod:`mpidp.ops.collectives`.

Every ``*_wrapper`` takes PhysicsNeMo's arguments, with ``group=None`` meaning the world, and
calls mpidp's one collective (uneven ``sizes`` work on every device). They are mpidp's
differentiable collectives: with tensors that need no gradient they run the plain forward,
as PhysicsNeMo's do. Differences: ``gather_v_wrapper`` gives ranks other than ``dst`` an empty
tensor (PhysicsNeMo: uninitialised memory of the global shape); float16/bfloat16 reductions
always accumulate in float32 (``use_fp32`` may only ask for what already happens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mpidp.compat.physicsnemo.distributed.manager import DistributedManager, transport_for
from mpidp.errors import ConfigError
from mpidp.layers.base import learn_spec
from mpidp.ops import collectives as core
from mpidp.ops.sharding import shard_tensor

__all__ = [
    "all_gather_v_bwd_wrapper",
    "all_gather_v_wrapper",
    "compute_split_shapes",
    "distributed_transpose",
    "gather_v_wrapper",
    "indexed_all_to_all_v_wrapper",
    "indexed_all_to_all_v_wrapper_bwd",
    "mark_module_as_shared",
    "pad_helper",
    "reduce_loss",
    "scatter_v_wrapper",
    "split_to_group",
    "truncate_helper",
    "unmark_module_as_shared",
]

_HOOK = "_shared_weight_dist_hook"


def compute_split_shapes(size: int, num_chunks: int) -> list[int]:
    """PhysicsNeMo's uneven cut: ``ceil(size / num_chunks)`` per chunk, the rest in the last;
    ``floor`` instead when that would leave the last chunk empty."""
    if num_chunks == 1:
        return [size]
    chunk = (size + num_chunks - 1) // num_chunks
    last = max(0, size - chunk * (num_chunks - 1))
    if last == 0:
        chunk = size // num_chunks
        last = size - chunk * (num_chunks - 1)
    return [chunk] * (num_chunks - 1) + [last]


def pad_helper(tensor: torch.Tensor, dim: int, new_size: int, mode: str = "zero") -> torch.Tensor:
    """``tensor`` zero-padded at the end of ``dim`` to ``new_size``; ``mode="conj"`` fills the
    new entries with the flipped conjugate of entries ``1..`` (a Hermitian extension)."""
    d = dim % tensor.ndim
    orig = tensor.shape[d]
    out = F.pad(tensor, _pad_spec(tensor.ndim, d, new_size - orig))
    if mode == "conj":
        mirror = torch.flip(torch.conj(out.narrow(d, 1, new_size - orig)), dims=[d])
        out = torch.cat([out.narrow(d, 0, orig), mirror], dim=d)
    return out


def _pad_spec(ndim: int, d: int, extra: int) -> list[int]:
    """F.pad's list (last dim first, (before, after) pairs) for ``extra`` entries after ``d``."""
    spec = [0] * (2 * (ndim - d))
    spec[-1] = extra
    return spec


def truncate_helper(tensor: torch.Tensor, dim: int, new_size: int) -> torch.Tensor:
    """The first ``new_size`` entries of ``tensor`` along ``dim``."""
    return tensor.narrow(dim % tensor.ndim, 0, new_size).contiguous()


def _sizes(tensor: torch.Tensor, sizes: Any, dim: int, t: Any) -> list[int]:
    """One size per rank: PhysicsNeMo accepts full shapes per rank too (their ``dim`` entry
    counts), or None (learned here with one all-gather of one integer)."""
    if sizes is None:
        return list(learn_spec(tensor, dim, t).sizes)
    return [int(s[dim]) if isinstance(s, Sequence | torch.Size) else int(s) for s in sizes]


def all_gather_v_wrapper(
    tensor: torch.Tensor,
    sizes: list[int] | None = None,
    dim: int = 0,
    group: Any = None,
) -> torch.Tensor:
    """:func:`mpidp.ops.collectives.all_gather_v` over ``group`` (None: the world). Collective."""
    t = transport_for(group, tensor.device)
    return core.all_gather_v(tensor, _sizes(tensor, sizes, dim, t), dim, group=t)


def all_gather_v_bwd_wrapper(
    tensor: torch.Tensor,
    sizes: list[int],
    dim: int = 0,
    use_fp32: bool = True,
    group: Any = None,
) -> torch.Tensor:
    """:func:`mpidp.ops.collectives.reduce_scatter_v` (sum) over ``group`` (None: the world): the
    adjoint of :func:`all_gather_v_wrapper`. Collective."""
    t = transport_for(group, tensor.device)
    return core.reduce_scatter_v(tensor, _sizes(tensor, sizes, dim, t), dim, group=t, op="sum")


def gather_v_wrapper(
    tensor: torch.Tensor,
    sizes: list[int],
    dim: int = 0,
    dst: int = 0,
    group: Any = None,
) -> torch.Tensor:
    """:func:`mpidp.ops.collectives.gather_v` over ``group`` (None: the world); ranks other than
    ``dst`` get an empty tensor. Collective."""
    t = transport_for(group, tensor.device)
    return core.gather_v(tensor, _sizes(tensor, sizes, dim, t), dim, dst, group=t)


def scatter_v_wrapper(
    tensor: torch.Tensor,
    sizes: list[int],
    dim: int = 0,
    src: int = 0,
    group: Any = None,
) -> torch.Tensor:
    """:func:`mpidp.ops.collectives.scatter_v` over ``group`` (None: the world); only ``src``'s
    tensor is read. Collective."""
    t = transport_for(group, tensor.device if tensor is not None else None)
    return core.scatter_v(tensor, [int(s) for s in sizes], dim, src, group=t)


def indexed_all_to_all_v_wrapper(
    tensor: torch.Tensor,
    indices: list[torch.Tensor],
    sizes: list[list[int]],
    dim: int = 0,
    group: Any = None,
) -> torch.Tensor:
    """:func:`mpidp.ops.collectives.indexed_all_to_all_v` over ``group`` (None: the world): the
    entries ``indices[j]`` along ``dim`` go to rank j. Collective."""
    t = transport_for(group, tensor.device)
    return core.indexed_all_to_all_v(tensor, indices, sizes, dim, group=t)


def indexed_all_to_all_v_wrapper_bwd(
    tensor: torch.Tensor,
    indices: list[torch.Tensor],
    sizes: list[list[int]],
    tensor_size_along_dim: int,
    use_fp32: bool = True,
    dim: int = 0,
    group: Any = None,
) -> torch.Tensor:
    """The adjoint of :func:`indexed_all_to_all_v_wrapper` applied to ``tensor`` (the gradient
    of its result): autograd's vector-Jacobian product of mpidp's one forward, so it is the
    exact backward by construction (one more exchange than a hand-written one). Collective."""
    t = transport_for(group, tensor.device)
    shape = list(tensor.shape)
    shape[dim] = tensor_size_along_dim
    probe = torch.zeros(shape, dtype=tensor.dtype, device=tensor.device, requires_grad=True)
    with torch.enable_grad():
        out = core.indexed_all_to_all_v(probe, indices, sizes, dim, group=t)
        (grad,) = torch.autograd.grad(out, probe, tensor)
    return grad


def distributed_transpose(
    tensor: torch.Tensor, dim0: int, dim1: int, group: Any = None, async_op: bool = False
) -> tuple[list[torch.Tensor], Any]:
    """Cut ``tensor`` along ``dim0`` (:func:`compute_split_shapes`) and send part j to rank j;
    returns the parts received from every rank (concatenate them along ``dim1``) and a
    completed request (mpidp's exchange is synchronous). Uneven extents work. Collective."""
    t = transport_for(group, tensor.device)
    split = compute_split_shapes(tensor.size(dim0), t.size)
    cat = list(learn_spec(tensor, dim1, t).sizes)
    out = core.all_to_all_v(tensor, split, cat, dim0, dim1, group=t)
    return list(out.split(cat, dim=dim1)), _Done()


class _Done:
    """The request of an exchange that has completed."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def split_to_group(tensor: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """This rank's part (:func:`compute_split_shapes`) of a tensor every rank of ``group``
    holds whole; the backward all-gathers (mpidp's ``shard_tensor``). No communication."""
    t = transport_for(group, tensor.device)
    sizes = compute_split_shapes(tensor.size(dim), t.size)
    return shard_tensor(tensor, dim, spec=sizes, group=t)


@torch.no_grad()
def reduce_loss(loss: float, dst_rank: int = 0, mean: bool = True) -> float | None:
    """The sum (``mean``: average) of every rank's ``loss`` on ``dst_rank``, None elsewhere.
    Collective over the world."""
    if not DistributedManager.is_initialized():
        raise ConfigError("reduce_loss needs DistributedManager.initialize() first (on every rank)")
    manager = DistributedManager()
    value = torch.tensor([float(loss)], dtype=torch.float64)
    if manager.world_size == 1:
        return float(value)
    total = core.all_reduce(value, "avg" if mean else "sum", group=transport_for(None, "cpu"))
    return float(total) if manager.rank == dst_rank else None


def mark_module_as_shared(
    module: torch.nn.Module,
    process_group: str | None,
    recurse: bool = True,
    use_fp32_reduction: bool = True,
) -> torch.nn.Module:
    """Sum every parameter's accumulated gradient over the named group (None: the world) with
    mpidp's all-reduce, after each backward. Every rank of the group must run the backward."""
    group = DistributedManager().group(process_group)

    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        assert grad is not None
        low = use_fp32_reduction and grad.is_floating_point() and grad.element_size() < 4
        summed = core.all_reduce(
            grad.float() if low else grad, "sum", group=transport_for(group, grad.device)
        )
        param.grad = summed.to(grad.dtype)

    for name, param in module.named_parameters(recurse=recurse):
        if hasattr(param, _HOOK):
            raise ConfigError(f"parameter {name} is already marked as shared; unmark it first")
        setattr(param, _HOOK, param.register_post_accumulate_grad_hook(hook))
    return module


def unmark_module_as_shared(module: torch.nn.Module, recurse: bool = True) -> torch.nn.Module:
    """Remove the hooks :func:`mark_module_as_shared` attached."""
    for name, param in module.named_parameters(recurse=recurse):
        if not hasattr(param, _HOOK):
            raise ConfigError(f"parameter {name} is not marked as shared; nothing to unmark")
        getattr(param, _HOOK).remove()
        delattr(param, _HOOK)
    return module
