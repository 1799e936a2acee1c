"""The layout words of a ShardedTensor that is a latitude x longitude block: which block of a
full tensor is this rank's, what the blocks of a set of local parts are, and the whole tensor
from every rank's block (:mod:`mpidp.ops.blocks` per axis group of the grid).

A block ShardedTensor is cut along its latitude dim by ``grid.lat`` over the latitude column
and along its longitude dim by ``grid.lon`` over the longitude row (a
:class:`~mpidp.runtime.grid.BlockSpec` with non-negative dims). Bands are the grid ``(P, 1)``:
on a manager whose longitude is not cut, these give no block (the caller makes a band).
The spectrum of blocks is a band of modes over the domain group (:func:`spectral_call`).
A block's rows x columns flattened into one dim are tokens (:class:`TokenSpec`).
Below :mod:`mpidp.sharded.tensor`: it builds no ShardedTensor.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from mpidp.errors import ConfigError
from mpidp.ops.blocks import as_block_spec, block_dims, gather_blocks, shard_blocks
from mpidp.ops.collectives import all_gather_v, all_gather_v_replicated
from mpidp.runtime.grid import BlockSpec, axis_transport
from mpidp.runtime.manager import DistributedManager
from mpidp.runtime.partition import ShardSpec
from mpidp.sharded.layout import agree_parts

__all__ = [
    "SPECTRAL_CALL",
    "TokenSpec",
    "block_of",
    "blocks_of_parts",
    "check_block",
    "is_pair",
    "merged_back",
    "spectral_call",
    "unmerged",
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
    """``bs`` cuts the manager's grid and, given ``local``, this rank's block is that shape.

    With ``local`` (a rank's own part: its shape, and a ``bs`` learned along each axis group,
    can differ by rank) the ranks agree first, as a band's check does
    (:func:`~mpidp.sharded.layout.agree_parts`; collective), so a bad block on one rank, or
    columns that learned other rows than their neighbours, raise the same ConfigError on
    every rank instead of leaving the others waiting in their next collective."""
    problems = []
    if bs.grid != m.grid:
        problems.append(
            f"{bs!r} cuts a {bs.grid[0]} x {bs.grid[1]} grid but the domain grid is "
            f"{m.grid[0]} x {m.grid[1]}; pass manager.block_spec(shape, dims)"
        )
    elif local is not None:
        have = (local.size(bs.dims[0]), local.size(bs.dims[1]))
        if have != bs.block_shape(m.domain_rank):
            problems.append(
                f"this rank's block has {have} (rows, columns) along dims {bs.dims} but "
                f"{bs!r} gives domain rank {m.domain_rank} {bs.block_shape(m.domain_rank)}"
            )
    fix = (
        "pass each rank its own block of one BlockSpec (manager.block_spec(shape, dims) gives "
        "each rank's rows and columns)"
    )
    facts = {"blocks": (list(bs.lat.sizes), list(bs.lon.sizes))}
    agree_parts(m, what, problems, facts, local, fix)


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


def whole_of(
    local: torch.Tensor,
    bs: BlockSpec | TokenSpec,
    m: DistributedManager,
    partial: bool = False,
) -> torch.Tensor:
    """The whole tensor on every domain rank (replicated downstream): blocks gathered along
    each axis group, tokens over the domain group and put in their global order. Tokens with
    ``partial``: for a computation that differs by rank (a rank's queries against every key),
    the backward sums every rank's gradient (:func:`~mpidp.ops.collectives.all_gather_v`).
    Collective."""
    if isinstance(bs, BlockSpec):
        if not bs.merged:
            return gather_blocks(local, bs.dims, m, bs)
        split, dims = unmerged(local, bs, m)
        whole = gather_blocks(split, dims, m, replace(bs, dims=dims, lead=(1, 1)))
        return merged_back(whole, bs, dims)
    t = m.transport(None, local.device)
    ranks = range(bs.counts.parts)
    order = torch.cat([bs.index(r, local.device) for r in ranks])  # the gathered tokens' ids
    gather = all_gather_v if partial else all_gather_v_replicated
    whole = gather(local, bs.counts, bs.dim, group=t)
    return whole.index_select(bs.dim, torch.argsort(order))


def unmerged(
    local: torch.Tensor, bs: BlockSpec, m: DistributedManager
) -> tuple[torch.Tensor, tuple[int, int]]:
    """A block whose cuts hold ``bs.lead`` blocks merged before them (``BlockSpec.lead``)
    with each axis's lead as a dim of its own just before the cut: ``(local, cut dims)``, each
    cut dim then exactly the axis's own entries (a block of a field, one per lead index).
    No communication; :func:`merged_back` undoes it."""
    sizes = bs.block_shape(m.domain_rank)
    dims = list(bs.dims)
    for i in sorted(range(2), key=lambda i: -bs.dims[i]):  # the later dim first: no shifts
        if bs.lead[i] > 1:
            local = local.unflatten(bs.dims[i], (bs.lead[i], sizes[i]))
            for j in range(2):
                dims[j] += j == i or bs.dims[j] > bs.dims[i]
    return local, (dims[0], dims[1])


def merged_back(t: torch.Tensor, bs: BlockSpec, dims: tuple[int, int]) -> torch.Tensor:
    """:func:`unmerged`'s split dims of ``t`` (at ``dims``, the cuts of ``bs``) merged back."""
    for i in sorted(range(2), key=lambda i: -dims[i]):
        if bs.lead[i] > 1:
            t = t.flatten(dims[i] - 1, dims[i])
    return t


@dataclass(frozen=True)
class TokenSpec:
    """Tokens of blocks: dim :attr:`dim` holds ``lead`` x H x W entries (``lead`` blocks of
    the field's rows x columns, global order row-major: (l, row, column)) and each domain rank
    its block's ``lead`` x h x w (row-major within the block), ``lat`` cutting the H rows over
    the latitude column and ``lon`` the W columns over the longitude row as a
    :class:`~mpidp.runtime.grid.BlockSpec` does. A patch or cube embedding's ``flatten(2)``
    makes it, a window partition folding the window grid into the batch too (``lead`` then
    holds the batch); a reshape back into (..., H, W) gives the block again. The entries a
    rank holds are not consecutive: an op that mixes tokens in their global order is refused
    (:mod:`mpidp.sharded.tokens`)."""

    lat: ShardSpec
    lon: ShardSpec
    lead: int
    dim: int

    @property
    def dims(self) -> tuple[int, int]:
        """The token dim, twice (where a block names its latitude and longitude dims)."""
        return self.dim, self.dim

    @property
    def shape(self) -> tuple[int, int]:
        """The field's ``(H, W)``."""
        return self.lat.total, self.lon.total

    @property
    def counts(self) -> ShardSpec:
        """Every domain rank's number of tokens (domain rank = i_lat * P_lon + i_lon)."""
        return ShardSpec(tuple(self.lead * h * w for h in self.lat.sizes for w in self.lon.sizes))

    def coords(self, rank: int) -> tuple[int, int]:
        """``(i_lat, i_lon)`` of domain rank ``rank``'s block."""
        i_lat, i_lon = divmod(rank, self.lon.parts)
        return i_lat, i_lon

    def at(self, dim: int) -> TokenSpec:
        """The same tokens along ``dim``."""
        return self if dim == self.dim else replace(self, dim=dim)

    def index(self, rank: int, device: torch.device) -> torch.Tensor:
        """The global ids of domain rank ``rank``'s tokens, in its local order."""
        return _token_ids(self.lat, self.lon, self.lead, rank).to(device)

    def part(self, t: torch.Tensor, at: int, rank: int) -> torch.Tensor:
        """Domain rank ``rank``'s tokens of ``t``, whose dim ``at`` holds all of them (a
        position embedding): a gather by index (its gradient reaches those entries)."""
        return t.index_select(at, self.index(rank, t.device))


@functools.lru_cache(maxsize=256)
def _token_ids(lat: ShardSpec, lon: ShardSpec, lead: int, rank: int) -> torch.Tensor:
    i, j = divmod(rank, lon.parts)  # TokenSpec.coords
    rows = torch.arange(lat.start(i), lat.start(i) + lat.sizes[i])
    cols = torch.arange(lon.start(j), lon.start(j) + lon.sizes[j])
    blocks = torch.arange(lead) * (lat.total * lon.total)
    ids = blocks[:, None, None] + rows[None, :, None] * lon.total + cols[None, None, :]
    return ids.flatten()
