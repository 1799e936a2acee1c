"""PhysicsNeMo's ``physicsnemo.domain_parallel`` (``ShardTensor``, ``scatter_tensor``) on
mpidp's :class:`~mpidp.ShardedTensor`, which speaks the same DTensor vocabulary natively.

``ShardTensor`` is a name for ShardedTensor with ShardTensor's defaults and meanings:

* the mesh: any 1-D DeviceMesh or named axis (PhysicsNeMo's ``initialize_mesh``, torch's
  ``init_device_mesh``); none given: the current one (``with mesh:``), else the one mesh
  PhysicsNeMo's manager holds, else mpidp's domain mesh; a band is never taken as the whole;
* a 2-D mesh (PhysicsNeMo's 2-D recipe: ``(Shard(2), Shard(3))`` on ``mesh["lat", "lon"]``)
  is a grid of latitude x longitude blocks, uneven in both dims
  (:mod:`mpidp.compat.physicsnemo._mesh2d`);
* gradients as PhysicsNeMo gives them (:mod:`mpidp.runtime.adopt`, ``"whole"``): every rank holds
  the whole gradient of every parameter or plain tensor it used, with no gradient sync
  (PhysicsNeMo's reduction of weight gradients over the mesh, and ``full_tensor()``'s plain
  result);
* the cut of ``scatter_tensor`` and ``from_dtensor`` is torch.chunk's (``ceil(n / P)`` rows,
  the last ranks short; on a 2-D mesh, of each dim), as PhysicsNeMo's;
* ``from_local`` without placements means ``Replicate()``; handlers are registered in
  ShardTensor's three ways. ``isinstance(x, ShardTensor)`` holds for every ShardedTensor
  (``isinstance(x, DTensor)`` does not: docs/migration.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpidp.compat.physicsnemo import _mesh2d
from mpidp.errors import ConfigError
from mpidp.runtime.adopt import mesh_ndim
from mpidp.runtime.manager import DistributedManager
from mpidp.sharded import ShardedTensor
from mpidp.sharded.dispatch import public_forms, register
from mpidp.sharded.placements import Replicate, manager_of
from mpidp.sharded.placements import scatter_tensor as _scatter
from mpidp.sharded.tensor import chunk_spec

__all__ = ["ShardTensor", "scatter_tensor"]

#: PhysicsNeMo's gradient convention (mpidp.runtime.adopt)
WHOLE = "whole"


def _mesh(device_mesh: Any) -> DistributedManager:
    """The manager of ``device_mesh`` with PhysicsNeMo's gradients; None: the mesh PhysicsNeMo
    (and DTensor) would take, or a refusal on every rank."""
    if device_mesh is not None:
        return manager_of(device_mesh, gradients=WHOLE)
    from torch.distributed.device_mesh import _mesh_resources

    import mpidp
    from mpidp.compat.physicsnemo.distributed.manager import DistributedManager as PNM

    if _mesh_resources.mesh_stack:  # with mesh:
        return manager_of(_mesh_resources.mesh_stack[-1], gradients=WHOLE)
    held = PNM._shared_state.get("_global_mesh")
    if held is not None:
        return manager_of(held, gradients=WHOLE)
    if mpidp.is_initialized():
        core = mpidp.get_manager()
        if core.domain_world_size > 1 or core.world_size == 1:
            return manager_of(None, core, gradients=WHOLE)
        rank = core.rank
    else:
        rank = -1
    raise ConfigError(
        f"rank {rank}: ShardTensor without a device mesh and none to take: no `with mesh:` "
        f"is active, PhysicsNeMo's DistributedManager holds no mesh and mpidp's domain is one "
        f"rank, so this rank's part would be taken as the whole tensor; pass the mesh "
        f"(DistributedManager().initialize_mesh(...), init_device_mesh) or enter `with mesh:`"
    )


class _ShardTensorMeta(type(ShardedTensor)):  # type: ignore[misc]
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, ShardedTensor)


class ShardTensor(ShardedTensor, metaclass=_ShardTensorMeta):
    """ShardTensor's constructors and registries over :class:`mpidp.ShardedTensor`; the
    tensors themselves are ShardedTensors."""

    @staticmethod
    def from_local(  # type: ignore[override]
        local_tensor: torch.Tensor,
        device_mesh: Any = None,
        placements: Sequence[Any] | None = None,
        sharding_shapes: str | dict[int, list[tuple[int, ...]]] = "infer",
        global_shape: Sequence[int] | None = None,
    ) -> Any:
        """``local_tensor`` on ``device_mesh`` (None: the current mesh, else PhysicsNeMo's
        one mesh, else mpidp's domain mesh; refused when there is none) with ``placements``
        (None: ``Replicate()`` on every mesh dim, as in ShardTensor); uneven parts.
        ``global_shape`` serves ``sharding_shapes="chunk"``. Collective for ``"infer"``."""
        m = _mesh(device_mesh)
        if mesh_ndim(m) == 2:
            chosen = [Replicate()] * 2 if placements is None else placements
            return _mesh2d.from_local(local_tensor, m, chosen, sharding_shapes, global_shape)
        chosen = [Replicate()] if placements is None else placements
        return ShardedTensor.from_local(
            local_tensor, None, chosen, sharding_shapes, manager=m, global_shape=global_shape
        )

    @classmethod
    def from_dtensor(cls, dtensor: Any) -> Any:  # type: ignore[override]
        """A DTensor ``Shard(d)`` as a ShardedTensor with the same local parts (torch.chunk's
        cut; no rows move). On a 2-D mesh, the placements :meth:`from_local` takes there (e.g.
        ``(Shard(2), Shard(3))``), the cut of each dim learned from the parts (one small
        all-gather along each mesh dim: a DTensor's ``from_local`` parts need not be
        torch.chunk's) and checked against the DTensor's shape. Differentiable."""
        from torch.distributed.tensor import Shard

        m = _mesh(dtensor.device_mesh)
        if mesh_ndim(m) == 2:
            out = _mesh2d.from_local(dtensor.to_local(), m, dtensor.placements, "infer", None)
            if tuple(out.shape) != tuple(dtensor.shape):
                raise ConfigError(
                    f"rank {m.rank}: from_dtensor: the DTensor's parts make a tensor of shape "
                    f"{tuple(out.shape)} but the DTensor says {tuple(dtensor.shape)}; pass a "
                    f"DTensor whose parts are its own (distribute_tensor, or from_local with "
                    f"its shape and stride)"
                )
            return out
        place = dtensor.placements[0]
        n = dtensor.shape[place.dim % dtensor.dim()] if isinstance(place, Shard) else 0
        return ShardedTensor.from_dtensor(
            dtensor, manager=m, spec=chunk_spec(n, m.domain_world_size) if n else None
        )

    @classmethod
    def patches_enabled(cls) -> bool:
        """Always True: ShardedTensors dispatch every torch function (nothing to patch)."""
        return True

    @classmethod
    def register_dispatch_handler(cls, op: Any, handler: Callable[..., Any]) -> None:
        """``handler(*args, **kwargs)`` computes operator overload ``op`` (e.g.
        ``torch.ops.aten.conv2d.default``) on ShardedTensors, called directly or through its
        public forms (``torch.conv2d``, ``Tensor.sigmoid``, ``x + y``...: what PhysicsNeMo's
        dispatch-level handler also sees; :func:`mpidp.sharded.dispatch.public_forms`)."""
        register(op, *public_forms(op))(lambda _f, args, kwargs: handler(*args, **kwargs))

    @classmethod
    def register_function_handler(
        cls, func: Callable[..., Any], handler: Callable[..., Any]
    ) -> None:
        """``handler(func, types, args, kwargs)`` computes ``func`` (a torch function or
        Tensor method) on ShardedTensors."""
        register(func)(lambda f, args, kwargs: handler(f, (ShardedTensor,), args, kwargs))

    @classmethod
    def register_named_function_handler(cls, func_name: str, handler: Callable[..., Any]) -> None:
        """``handler(func, types, args, kwargs)`` for the custom op named ``func_name``
        (``"mylib.fused.default"``, or ``"mylib::fused"``)."""
        register(func_name)(lambda f, args, kwargs: handler(f, (ShardedTensor,), args, kwargs))


def scatter_tensor(
    tensor: torch.Tensor | None,
    global_src: int,
    mesh: Any,
    placements: Sequence[Any],
    global_shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
) -> Any:
    """PhysicsNeMo's ``scatter_tensor``: ``tensor``, held by global rank ``global_src`` alone,
    spread over ``mesh`` (a 1-D DeviceMesh or named axis, or a 2-D mesh of blocks; None: as
    :meth:`ShardTensor.from_local` takes one) cut as torch.chunk cuts each dim (PhysicsNeMo's:
    13 rows over 3 ranks are 5, 5, 3), with PhysicsNeMo's gradients. Collective over the
    mesh's group."""
    m = _mesh(mesh)
    if mesh_ndim(m) == 2:
        if global_src not in m.domain_ranks:
            raise ConfigError(
                f"rank {m.rank}: scatter_tensor: global_src={global_src!r} is not in the mesh "
                f"(global ranks {list(m.domain_ranks)}); pass one of them"
            )
        src = m.domain_ranks.index(global_src)
        meta = (global_shape, dtype)
        return _mesh2d.scatter(tensor, src, m, placements, meta, requires_grad)
    return _scatter(
        tensor, global_src, m, placements, global_shape, dtype, requires_grad,
        cut=chunk_spec,
    )  # fmt: skip
