"""The layout words of a ShardedTensor that is a latitude x longitude block: which block of a
full tensor is this rank's, what the blocks of a set of local parts are, and the whole tensor
from every rank's block (:mod:`mpidp.ops.blocks` per axis group of the grid).

A block ShardedTensor is cut along its latitude dim by ``grid.lat`` over the latitude column
and along its longitude dim by ``grid.lon`` over the longitude row (a
:class:`~mpidp.runtime.grid.BlockSpec` with non-negative dims). Bands are the grid ``(P, 1)``:
on a manager whose longitude is not cut, these give no block (the caller makes a band).
The spectrum of blocks is a band of modes over the domain group (:func:`spectral_call`).
Below :mod:`mpidp.sharded.tensor`: it builds no ShardedTensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from mpidp.errors import ConfigError
from mpidp.ops.blocks import as_block_spec, block_dims, gather_blocks, shard_blocks
from mpidp.runtime.grid import BlockSpec, axis_transport
from mpidp.runtime.manager import DistributedManager
from mpidp.runtime.partition import ShardSpec

__all__ = [
    "SPECTRAL_CALL",
    "block_of",
    "blocks_of_parts",
    "check_block",
    "is_pair",
    "spectral_call",
    "whole_of",
]

#: non-empty while dispatch runs a call on a spectrum of blocks (:func:`spectral_call`): the
#: bands its handlers make are bands of modes over the domain group, like their input
SPECTRAL_CALL: list[bool] = []


@contextlib.contextmanager
def spectral_call() -> Iterator[None]:
    """While it is open, the bands made on a grid that cuts the longitude are bands of modes
    (:attr:`~mpidp.ShardedTensor.spectral`): dispatch opens it around a call on a spectrum of
    blocks, whose band rules make bands of the same domain group as their input."""
    SPECTRAL_CALL.append(True)
    try:
        yield
    finally:
        SPECTRAL_CALL.pop()


def is_pair(dim: Any) -> bool:
    """Whether ``dim`` names two dims (a block's latitude and longitude)."""
    return isinstance(dim, Sequence) and not isinstance(dim, str)


def _grid(spec: Any, dims: tuple[int, int], m: DistributedManager, shape: Any) -> BlockSpec:
    if spec is None:
        bs = m.block_spec(shape, dims)
    else:
        bs = as_block_spec(spec, dims)
    return BlockSpec(bs.lat, bs.lon, dims)


def check_block(bs: BlockSpec, m: DistributedManager, what: str, local: Any = None) -> None:
    """``bs`` cuts the manager's grid and, given ``local``, this rank's block is that shape."""
    if bs.grid != m.grid:
        raise ConfigError(
            f"rank {m.rank}: {what}: {bs!r} cuts a {bs.grid[0]} x {bs.grid[1]} grid but the "
            f"domain grid is {m.grid[0]} x {m.grid[1]}; pass manager.block_spec(shape, dims)"
        )
    if local is not None:
        have = (local.size(bs.dims[0]), local.size(bs.dims[1]))
        if have != bs.block_shape(m.domain_rank):
            raise ConfigError(
                f"rank {m.rank}: {what}: this rank's block has {have} (rows, columns) along "
                f"dims {bs.dims} but {bs!r} gives domain rank {m.domain_rank} "
                f"{bs.block_shape(m.domain_rank)}; pass this rank's block of that spec"
            )


def block_of(
    x: torch.Tensor, dim: Any, m: DistributedManager, spec: Any, whole: bool
) -> tuple[torch.Tensor, BlockSpec]:
    """This rank's block of the full tensor ``x`` and the blocks (``spec`` default: the
    manager's policy per dim). No communication. A ``whole`` (Replicated) ``x`` gets its whole
    gradient back (:func:`~mpidp.ops.blocks.shard_blocks`); a plain one that requires grad
    keeps the block attached (its ``.grad`` holds this rank's entries), else a new leaf."""
    dims = block_dims(x.dim(), dim, m.rank)
    bs = _grid(spec, dims, m, x.shape)
    check_block(bs, m, "shard")
    if (x.size(dims[0]), x.size(dims[1])) != bs.shape:
        raise ConfigError(
            f"rank {m.rank}: shard: {bs!r} covers {bs.shape} but the tensor has "
            f"{(x.size(dims[0]), x.size(dims[1]))} along dims {dims} (shape {tuple(x.shape)}); "
            f"pass a spec of this tensor's shape"
        )
    if whole:
        return shard_blocks(x, dims, m, bs), bs
    rows, cols = bs.block(m.domain_rank)
    block = x.narrow(dims[0], rows.start, rows.stop - rows.start)
    block = block.narrow(dims[1], cols.start, cols.stop - cols.start)
    if not x.requires_grad:
        block = block.clone(memory_format=torch.contiguous_format)
    return block, bs


def blocks_of_parts(local: torch.Tensor, dim: Any, m: DistributedManager, spec: Any) -> BlockSpec:
    """The blocks that every rank's ``local`` part makes: ``spec`` (checked) or learned in one
    small all-gather along each axis group (collective over the domain group)."""
    dims = block_dims(local.dim(), dim, m.rank)
    if spec is None:
        sizes = []
        for axis, d in zip(("lat", "lon"), dims, strict=True):
            t = axis_transport(m, axis, local.device)
            sizes.append(ShardSpec(tuple(r[0] for r in t.all_gather_ints([local.size(d)]))))
        bs = BlockSpec(sizes[0], sizes[1], dims)
    else:
        bs = _grid(spec, dims, m, None)
    check_block(bs, m, "from_local", local)
    return bs


def whole_of(local: torch.Tensor, bs: BlockSpec, m: DistributedManager) -> torch.Tensor:
    """The whole tensor on every domain rank (replicated downstream). Collective."""
    return gather_blocks(local, bs.dims, m, bs)
