"""ShardTensor's placements on a 2-D device mesh, as mpidp's layouts over that mesh's grid.

PhysicsNeMo's 2-D recipe cuts a field ``(B, C, H, W)`` over a mesh of ``P_lat x P_lon`` ranks
(``init_device_mesh(..., (P_lat, P_lon))`` or the ``mesh["lat", "lon"]`` of a
``(dp, lat, lon)`` mesh) with placements ``(Shard(2), Shard(3))``: mesh dim 0 cuts the rows,
mesh dim 1 the columns, any sizes. The mesh's manager is a grid of blocks
(:mod:`mpidp.runtime.adopt`), so that is a block ShardedTensor, every op on it the block
rule; ``(Shard(d), Replicate())`` is a band along ``d`` over the mesh's dim-0 group, held
alike by every rank of a dim-1 group (``(Replicate(), Shard(d))`` the converse);
``(Replicate(), Replicate())`` a value every rank holds. Anything else (the columns cut
over mesh dim 0, one dim cut twice, ``Partial``) is refused on every rank.

PhysicsNeMo's ``sharding_shapes={mesh_dim: [shape per rank along that mesh dim]}`` gives each
dim's cut; ``"chunk"`` is torch.chunk's cut of ``global_shape`` per dim, as PhysicsNeMo's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

from mpidp.errors import ConfigError
from mpidp.ops.blocks import scatter_blocks
from mpidp.runtime.adopt import axis_manager
from mpidp.runtime.grid import BlockSpec
from mpidp.runtime.manager import DistributedManager
from mpidp.runtime.partition import ShardSpec
from mpidp.sharded import ShardedTensor
from mpidp.sharded.layout import chunk_spec

__all__: list[str] = []

#: what placements on a 2-D mesh say: ("block", (d_lat, d_lon)), ("band", (mesh_dim, d)) or
#: ("replicate", ())
Layout = tuple[str, tuple[int, ...]]


def layout_of(placements: Sequence[Any], m: DistributedManager, ndim: int, what: str) -> Layout:
    """What ``placements`` on ``m``'s 2-D mesh mean for a tensor of ``ndim`` dims, or a
    refusal naming them and the fix (the same on every rank)."""
    ps = tuple(placements)
    shards = [p.dim % ndim if isinstance(p, Shard) else None for p in ps]
    ok = len(ps) == 2 and all(isinstance(p, (Shard, Replicate)) for p in ps)
    if ok and None not in shards and shards[0] is not None and shards[1] is not None:
        if shards[0] < shards[1]:
            return "block", (shards[0], shards[1])
    elif ok and shards != [None, None]:
        k = 0 if shards[0] is not None else 1
        return "band", (k, int(shards[k]))  # type: ignore[arg-type]
    elif ok:
        return "replicate", ()
    raise ConfigError(
        f"rank {m.rank}: {what}: placements {ps} on the 2-D mesh {tuple(m.domain_mesh.shape)}: "
        f"a 2-D mesh takes (Shard(h), Shard(w)) with h < w (mesh dim 0 cuts the rows, dim 1 "
        f"the columns: latitude x longitude blocks), (Shard(d), Replicate()), "
        f"(Replicate(), Shard(d)) or (Replicate(), Replicate()); pass one of those (for the "
        f"columns cut over mesh dim 0, build the mesh with its dims swapped)"
    )


def _told(
    sharding_shapes: Any, k: int, d: int, parts: int, global_shape: Any, rank: int
) -> ShardSpec | None:
    """Mesh dim ``k``'s cut of tensor dim ``d`` that ``sharding_shapes`` gives; None: learn
    it (``"infer"``)."""
    if isinstance(sharding_shapes, dict):
        shapes = sharding_shapes.get(k)
        if shapes is None or len(shapes) != parts:
            raise ConfigError(
                f"rank {rank}: from_local: sharding_shapes={sharding_shapes!r}; pass "
                f"{{mesh dim: [shape of each of its ranks' parts]}} for mesh dim {k} "
                f"({parts} ranks)"
            )
        return ShardSpec(tuple(int(s[d]) for s in shapes))
    if sharding_shapes == "chunk":
        if global_shape is None:
            raise ConfigError(
                f"rank {rank}: from_local(sharding_shapes='chunk') on a 2-D mesh: pass "
                f"global_shape (or sharding_shapes='infer')"
            )
        return chunk_spec(int(global_shape[d]), parts)
    if sharding_shapes != "infer":
        raise ConfigError(
            f"rank {rank}: from_local: sharding_shapes={sharding_shapes!r}; pass 'infer', "
            f"'chunk' or a dict of shapes"
        )
    return None


def from_local(
    local: torch.Tensor,
    m: DistributedManager,
    placements: Sequence[Any],
    sharding_shapes: Any,
    global_shape: Sequence[int] | None,
) -> Any:
    """``local`` on ``m``'s 2-D mesh with ``placements`` (:func:`layout_of`). Collective along
    the cut axes when the cut is learned (``"infer"``)."""
    kind, dims = layout_of(placements, m, local.dim(), "from_local")
    if kind == "replicate":
        return ShardedTensor.from_local(local, None, [Replicate()], manager=m)
    if kind == "band":
        k, d = dims
        a = axis_manager(m, k)
        spec = _told(sharding_shapes, k, d, a.domain_world_size, global_shape, m.rank)
        return ShardedTensor.from_local(local, dim=d, spec=spec, manager=a)
    told = [
        _told(sharding_shapes, k, d, m.grid[k], global_shape, m.rank) for k, d in enumerate(dims)
    ]
    lat, lon = told
    bs = BlockSpec(lat, lon, (dims[0], dims[1])) if lat is not None and lon is not None else None
    return ShardedTensor.from_local(local, dim=dims, spec=bs, manager=m)


def scatter(
    tensor: torch.Tensor | None,
    src: int,
    m: DistributedManager,
    placements: Sequence[Any],
    meta: tuple[Sequence[int] | None, torch.dtype | None],
    requires_grad: bool,
) -> Any:
    """Domain rank ``src``'s ``tensor`` spread over ``m``'s 2-D mesh with ``placements``, cut
    as torch.chunk cuts each dim (PhysicsNeMo's); blocks move by one scatter along each axis,
    other layouts by one broadcast. ``meta`` (global shape, dtype): read from ``src`` where
    None. Collective over the mesh."""
    shape, dtype = meta
    t = m.transport(None, tensor.device if tensor is not None else None)
    mine = tensor if m.domain_rank == src else None
    if shape is None or dtype is None:
        told = t.broadcast_object(None if mine is None else (tuple(mine.shape), mine.dtype), src)
        if told is None:
            raise ConfigError(f"rank {m.rank}: scatter_tensor: the source rank passed no tensor")
        shape = told[0] if shape is None else shape
        dtype = told[1] if dtype is None else dtype
    mine = mine.detach().to(dtype) if mine is not None else None
    kind, dims = layout_of(placements, m, len(shape), "scatter_tensor")
    if kind == "block":
        cuts = [chunk_spec(int(shape[d]), m.grid[k]) for k, d in enumerate(dims)]
        bs = BlockSpec(cuts[0], cuts[1], (dims[0], dims[1]))
        block = scatter_blocks(mine, dims, src, m, bs)
        leaf = block.detach().requires_grad_(requires_grad)
        return ShardedTensor.from_local(leaf, dim=dims, spec=bs, manager=m)
    if mine is None:
        mine = torch.empty(tuple(shape), dtype=dtype, device=m.device)
    whole = t.broadcast(mine.contiguous(), src)
    if kind == "replicate":
        leaf = whole.requires_grad_(requires_grad)
        return ShardedTensor.from_local(leaf, None, [Replicate()], manager=m)
    k, d = dims
    a = axis_manager(m, k)
    cut = chunk_spec(int(shape[d]), a.domain_world_size)
    band = whole.narrow(d, cut.start(a.domain_rank), cut.sizes[a.domain_rank])
    leaf = band.contiguous().requires_grad_(requires_grad)
    return ShardedTensor.from_local(leaf, dim=d, spec=cut, manager=a)
