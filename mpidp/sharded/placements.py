"""The DTensor / ShardTensor vocabulary of a ShardedTensor: placements, the device mesh, and
building one from a local tensor or from one rank's whole tensor (``scatter_tensor``).

A ShardedTensor lives on a manager's 1-D domain mesh; its placement is ``Shard(dim)`` (a band)
or, when dims before the band were merged into it, ``_StridedShard(dim, split_factor=blocks)``.
``Replicate()`` is a :class:`~mpidp.sharded.Replicated` value, ``Partial()`` a summand per rank
(reduced when it becomes a value: mpidp computes contractions over the sharded dim at once).
The layout words that need no ShardedTensor (:func:`manager_of`, :func:`one_placement`) live
in :mod:`mpidp.sharded.layout`, below the tensor type, and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from mpidp.errors import ConfigError
from mpidp.ops.collectives import scatter_v
from mpidp.runtime.manager import DistributedManager
from mpidp.runtime.partition import ShardSpec
from mpidp.sharded.layout import manager_of, one_placement
from mpidp.sharded.tensor import ShardedTensor, replicated

__all__ = ["Partial", "Replicate", "Shard", "manager_of", "one_placement", "scatter_tensor"]

_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


def _meta(tensor: torch.Tensor | None, src: int, m: DistributedManager) -> tuple[list[int], Any]:
    """Shape and dtype of ``src``'s tensor on every rank (one small all-gather)."""
    t = m.transport(None, "cpu")
    mine = (
        []
        if m.domain_rank != src or tensor is None
        else [_DTYPES.index(tensor.dtype), *tensor.shape]
    )
    rows = t.all_gather_ints([len(mine), *mine, *([0] * (16 - len(mine)))])
    row = rows[src]
    if row[0] == 0:
        raise ConfigError(f"rank {m.rank}: scatter_tensor: the source rank passed no tensor")
    return row[2 : 1 + row[0]], _DTYPES[row[1]]


def scatter_tensor(
    tensor: torch.Tensor | None,
    global_src: int,
    mesh: Any,
    placements: Sequence[Placement],
    global_shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
    *,
    cut: Callable[[int, int], ShardSpec] | None = None,
) -> Any:
    """``tensor``, held by global rank ``global_src`` alone (others may pass None), spread over
    ``mesh`` (a 1-D DeviceMesh or process group, adopted when mpidp did not build it, or a
    manager; None: the default manager's): ``[Shard(d)]`` gives each rank its band by the
    manager's partition (any length; ``cut(n, parts)`` instead when given), ``[Replicate()]``
    the whole tensor everywhere. ``global_shape`` and ``dtype`` are read from the source when
    None. The result is a leaf when ``requires_grad``. Collective over the domain group."""
    m = manager_of(mesh)
    if not isinstance(global_src, int) or global_src not in m.domain_ranks:
        raise ConfigError(
            f"rank {m.rank}: scatter_tensor: global_src={global_src!r} is not in this domain "
            f"group (global ranks {list(m.domain_ranks)}); pass one of them"
        )
    src = m.domain_ranks.index(global_src)
    p = one_placement(placements, "scatter_tensor", m.rank)
    if global_shape is None or dtype is None:
        shape, kind = _meta(tensor, src, m)
        global_shape = shape if global_shape is None else global_shape
        dtype = kind if dtype is None else dtype
    device = m.device if tensor is None else tensor.device
    source = tensor.detach().to(dtype) if tensor is not None and m.domain_rank == src else None
    if isinstance(p, Replicate):
        t = m.transport(None, device)
        buf = (
            source
            if source is not None
            else torch.empty(tuple(global_shape), dtype=dtype, device=device)
        )
        whole = t.broadcast(buf.contiguous(), src).requires_grad_(requires_grad)
        return replicated(whole, t)
    if not isinstance(p, Shard):
        raise ConfigError(f"rank {m.rank}: scatter_tensor: {p!r}; scatter to Shard or Replicate")
    d = p.dim % len(global_shape)
    spec = (
        m.spec(int(global_shape[d]))
        if cut is None
        else cut(int(global_shape[d]), m.domain_world_size)
    )
    band = scatter_v(source, list(spec.sizes), d, src, m.transport(None, device))
    return ShardedTensor(band.detach().requires_grad_(requires_grad), spec, d, m)
