"""PhysicsNeMo's ``physicsnemo.domain_parallel`` (``ShardTensor``, ``scatter_tensor``) on
mpidp's :class:`~mpidp.ShardedTensor`, which speaks the same DTensor vocabulary natively.

``ShardTensor`` is a name for ShardedTensor with ShardTensor's defaults: ``from_local``
without placements means ``Replicate()`` (mpidp's own default is a band along -2),
``from_dtensor`` keeps torch.chunk's cut, and handlers are registered in ShardTensor's three
ways. ``isinstance(x, ShardTensor)`` holds for every ShardedTensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpidp.sharded import ShardedTensor
from mpidp.sharded.dispatch import register
from mpidp.sharded.placements import Replicate, scatter_tensor
from mpidp.sharded.tensor import chunk_spec

__all__ = ["ShardTensor", "scatter_tensor"]


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
    ) -> Any:
        """``local_tensor`` on ``device_mesh`` (None: mpidp's domain mesh) with ``placements``
        (None: ``Replicate()``, as in ShardTensor); uneven parts. Collective for ``"infer"``."""
        chosen = [Replicate()] if placements is None else placements
        return ShardedTensor.from_local(local_tensor, device_mesh, chosen, sharding_shapes)

    @classmethod
    def from_dtensor(cls, dtensor: Any) -> ShardedTensor:  # type: ignore[override]
        """A DTensor ``Shard(d)`` as a ShardedTensor with the same local parts (torch.chunk's
        cut; no rows move)."""
        from torch.distributed.tensor import Shard

        place = dtensor.placements[0]
        n = dtensor.shape[place.dim % dtensor.dim()] if isinstance(place, Shard) else 0
        return ShardedTensor.from_dtensor(
            dtensor, spec=chunk_spec(n, dtensor.device_mesh.size()) if n else None
        )

    @classmethod
    def patches_enabled(cls) -> bool:
        """Always True: ShardedTensors dispatch every torch function (nothing to patch)."""
        return True

    @classmethod
    def register_dispatch_handler(cls, op: Any, handler: Callable[..., Any]) -> None:
        """``handler(*args, **kwargs)`` computes operator overload ``op`` (e.g.
        ``torch.ops.aten.conv2d.default``) when called on ShardedTensors."""
        register(op)(lambda _f, args, kwargs: handler(*args, **kwargs))

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
