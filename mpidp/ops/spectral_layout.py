"""The spectral layout of :mod:`mpidp.ops.fft` (which global modes a rank holds, recorded on a
transform's output and queried by :func:`layout`, :func:`modes` and :func:`mode_spec`) and the
steps its transforms share: the group and partitions of a call, the one all-to-all, the FFT of
one rank's part (an empty one included), and on blocks the pencils (:class:`Pencils`): how a
block's rows are sub-cut over its longitude row so that each rank holds whole rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from mpidp.comm import Transport
from mpidp.errors import ConfigError
from mpidp.ops.bands import learn_spec
from mpidp.ops.blocks import as_block_spec, learn_blocks
from mpidp.ops.collectives import all_to_all_v
from mpidp.runtime.grid import BlockSpec
from mpidp.runtime.manager import DistributedManager, get_manager
from mpidp.runtime.partition import ShardSpec, as_sizes

__all__ = [
    "FFT_OPS",
    "Pencils",
    "block_input",
    "block_output",
    "Spec",
    "SpectralLayout",
    "context",
    "input_spec",
    "layout",
    "lon_row",
    "mark",
    "mode_spec",
    "modes",
    "output_spec",
    "pencils",
    "policy",
    "run_fft",
    "size_arg",
    "transpose",
    "two_dims",
]

_ATTR = "_mpidp_spectral"
Spec = ShardSpec | Sequence[int] | None


@dataclasses.dataclass(frozen=True)
class SpectralLayout:
    """Which global modes a rank holds: ``spec`` cuts dim ``dim`` (counted from the end) of the
    spectral tensor over the group; this rank (``rank``) holds ``spec.slice(rank)``."""

    spec: ShardSpec
    dim: int
    rank: int

    @property
    def modes(self) -> slice:
        """This rank's global mode numbers along ``dim``, as a slice."""
        return self.spec.slice(self.rank)


# -- plumbing ---------------------------------------------------------------------------------


def context(
    x: torch.Tensor, manager: DistributedManager | None, group: Any
) -> tuple[DistributedManager, Transport]:
    m = manager if manager is not None else get_manager()
    if isinstance(group, Transport):
        return m, group
    return m, m.transport(group, x.device)


def policy(m: DistributedManager, n: int, parts: int) -> ShardSpec:
    """The manager's policy for ``n`` entries over ``parts`` ranks; with fewer entries than
    ranks (3 modes over 4 ranks) a balanced cut whose last ranks hold none."""
    return m.partition.derived(n, parts)


def _given(spec: Spec, t: Transport, x: torch.Tensor, d: int, what: str) -> ShardSpec | None:
    if spec is None:
        return None
    s = spec if isinstance(spec, ShardSpec) else ShardSpec.from_sizes(as_sizes(spec))
    if s.parts != t.size:
        raise ConfigError(
            f"rank {t.rank}: {what} {s} has {s.parts} parts for a group of {t.size} ranks; "
            f"give one size per rank"
        )
    if x is not None and x.size(d) != s[t.rank]:
        raise ConfigError(
            f"rank {t.rank}: {what} {s} gives this rank {s[t.rank]} entries along dim {d}, "
            f"but the tensor {tuple(x.shape)} holds {x.size(d)}; pass the partition the "
            f"tensor was cut by (or leave {what} out to learn it)"
        )
    return s


def input_spec(x: torch.Tensor, d: int, t: Transport, spec: Spec) -> ShardSpec:
    """The partition of ``x`` along ``d``: ``spec`` when given, else the layout recorded by an
    mpidp.ops.fft transform, else every rank's extent (one all-gather of one integer)."""
    given = _given(spec, t, x, d, "spec")
    if given is not None:
        return given
    recorded = getattr(x, _ATTR, None)
    if (
        isinstance(recorded, SpectralLayout)
        and recorded.dim == d - x.dim()
        and recorded.spec.parts == t.size
        and recorded.spec[t.rank] == x.size(d)
    ):
        return recorded.spec
    return learn_spec(x, d, t)


def output_spec(m: DistributedManager, t: Transport, n: int, out_spec: Spec) -> ShardSpec:
    if out_spec is None:
        return policy(m, n, t.size)
    s = out_spec if isinstance(out_spec, ShardSpec) else ShardSpec.from_sizes(as_sizes(out_spec))
    if s.parts != t.size or s.total != n:
        raise ConfigError(
            f"rank {t.rank}: out_spec {s} must cut {n} entries over {t.size} ranks "
            f"(it cuts {s.total} over {s.parts})"
        )
    return s


def two_dims(x: torch.Tensor, dim: Sequence[int], shard_dim: int) -> tuple[int, int, int]:
    """(first, second, sharded) as non-negative dims of ``x``."""
    nd = x.dim()
    if len(dim) != 2:
        raise ConfigError(f"dim={tuple(dim)}: a 2-D transform takes two dims")
    try:
        a, b, sd = (d + nd if -nd <= d < 0 else d for d in (*dim, shard_dim))
        if not (0 <= a < nd and 0 <= b < nd and 0 <= sd < nd) or a == b:
            raise ValueError
    except ValueError:
        raise ConfigError(
            f"dim={tuple(dim)}, shard_dim={shard_dim} do not name two different dims of a "
            f"{nd}-D tensor {tuple(x.shape)}"
        ) from None
    return a, b, sd


def size_arg(s: Sequence[int] | None, i: int) -> int | None:
    if s is None:
        return None
    return None if s[i] == -1 else int(s[i])


def transpose(
    x: torch.Tensor, t: Transport, split: ShardSpec, split_dim: int, rows: ShardSpec, cat_dim: int
) -> torch.Tensor:
    """Sharded along ``cat_dim`` (by ``rows``) in, sharded along ``split_dim`` (by ``split``)
    out: the one all-to-all of each transform."""
    return all_to_all_v(x, split, rows, split_dim=split_dim, cat_dim=cat_dim, group=t)


FFT_OPS = {
    "rfft": torch.fft.rfft,
    "irfft": torch.fft.irfft,
    "fft": torch.fft.fft,
    "ifft": torch.fft.ifft,
}


def run_fft(kind: str, y: torch.Tensor, n: int | None, d: int, norm: str | None) -> torch.Tensor:
    """``torch.fft.<kind>(y, n=n, dim=d, norm=norm)``; on an empty shard (no rows or no modes
    here) the result's zeros without calling the FFT library (MKL refuses empty batches), still
    joined to ``y`` in the graph, so that this rank's backward reaches the exchanges too."""
    if y.numel():
        return FFT_OPS[kind](y, n=n, dim=d, norm=norm)
    length = {
        "rfft": (n or y.size(d)) // 2 + 1,
        "irfft": n or 2 * (y.size(d) - 1),
    }.get(kind, n or y.size(d))
    shape = list(y.shape)
    shape[d] = length
    real = kind == "irfft"
    dtype = y.dtype if y.is_complex() != real else _partner(y.dtype)
    anchor = y.sum() * 0
    if real and anchor.is_complex():
        anchor = anchor.real
    return torch.zeros(shape, dtype=dtype, device=y.device) + anchor


def _partner(dtype: torch.dtype) -> torch.dtype:
    """complex64 <-> float32, complex128 <-> float64."""
    pairs = {
        torch.float32: torch.complex64,
        torch.float64: torch.complex128,
        torch.complex64: torch.float32,
        torch.complex128: torch.float64,
    }
    return pairs[dtype]


def mark(x: torch.Tensor, spec: ShardSpec, d: int, t: Transport) -> torch.Tensor:
    setattr(x, _ATTR, SpectralLayout(spec, d - x.dim(), t.rank))
    return x


# -- blocks: the pencil step along the longitude row -------------------------------------------


def lon_row(m: DistributedManager, group: Any, device: torch.device) -> Transport | None:
    """The longitude row a 2-D transform of a block transposes over first, or None where the
    ranks hold whole rows already: bands (the grid ``(P, 1)``) and a ``group`` passed
    explicitly (a band transform over that group). On bands this check is the whole cost of
    blocks: no message, no copy."""
    if group is not None or m.grid[1] == 1:
        return None
    return m.transport("lon", device)


@dataclasses.dataclass(frozen=True)
class Pencils:
    """How a 2-D transform moves a field cut into ``blocks``: block ``(i_lat, i_lon)``'s rows
    ``blocks.lat[i_lat]`` are sub-cut over its longitude row by the manager's policy (``sub``,
    this rank's row of the grid), and the all-to-all over that row gives rank ``i_lon`` its
    sub-cut's rows with every column (a pencil). Taken in domain rank order
    (``i_lat * P_lon + i_lon``) those sub-cuts are a band cut of all the rows over the domain
    group (``rows``): the band transforms' all-to-all runs on it unchanged."""

    blocks: BlockSpec
    sub: ShardSpec
    rows: ShardSpec


def pencils(m: DistributedManager, blocks: BlockSpec) -> Pencils:
    """The pencils of ``blocks`` over ``m``'s grid (every rank computes the same from global
    facts). Local."""
    if blocks.grid != m.grid:
        raise ConfigError(
            f"rank {m.rank}: {blocks!r} cuts a {blocks.grid[0]} x {blocks.grid[1]} grid but the "
            f"domain grid is {m.grid[0]} x {m.grid[1]}; pass manager.block_spec(shape, dims)"
        )
    cuts = [policy(m, r, m.grid[1]) for r in blocks.lat.sizes]
    rows = ShardSpec.from_sizes([n for cut in cuts for n in cut.sizes])
    return Pencils(blocks, cuts[m.grid_coords[0]], rows)


#: the other way out for a band given to a 2-D transform on a grid of blocks
_BAND_FIX = (
    " (with x this rank's block: mpidp.shard_tensor(x, dim=(-2, -1))), or for a band of the "
    "domain group transform it over that group: group=manager.transport()"
)


def block_input(
    m: DistributedManager, x: torch.Tensor, dims: tuple[int, int], spec: Any
) -> BlockSpec:
    """The blocks ``x`` is one of: ``spec`` (a BlockSpec or a ``(lat, lon)`` pair) when given,
    else every rank's extents (:func:`~mpidp.ops.blocks.learn_blocks`: a band is refused)."""
    if spec is not None:
        blocks = as_block_spec(spec, dims, rank=m.rank, fix=_BAND_FIX)
        if blocks.block_shape(m.domain_rank) != (x.size(dims[0]), x.size(dims[1])):
            raise ConfigError(
                f"rank {m.rank}: spec {blocks!r} gives this rank a block of "
                f"{blocks.block_shape(m.domain_rank)} but the tensor {tuple(x.shape)} holds "
                f"{(x.size(dims[0]), x.size(dims[1]))} along dims {dims}; pass the blocks the "
                f"tensor was cut by (or leave spec out to learn them)"
            )
        return blocks
    return learn_blocks(m, x, dims, _BAND_FIX)


def block_output(
    m: DistributedManager, shape: tuple[int, int], dims: tuple[int, int], out_spec: Any
) -> BlockSpec:
    """The blocks an inverse transform returns, of global extents ``shape`` along ``dims``:
    ``out_spec`` (a BlockSpec or a ``(lat, lon)`` pair) when given, else the manager's."""
    if out_spec is None:
        full = [0] * (max(dims) + 1)
        full[dims[0]], full[dims[1]] = shape
        return m.block_spec(full, dims)
    blocks = as_block_spec(out_spec, dims, rank=m.rank, fix=_BAND_FIX)
    if blocks.shape != shape:
        raise ConfigError(
            f"rank {m.rank}: out_spec {blocks!r} cuts {blocks.shape} but the output is "
            f"{shape} along dims {dims}; pass the blocks of the output's shape"
        )
    return blocks


# -- the spectral layout, queried -------------------------------------------------------------


def layout(x: torch.Tensor) -> SpectralLayout:
    """The spectral layout an mpidp.ops.fft transform recorded on its output ``x``. Arithmetic on
    ``x`` gives a tensor without it: query the transform's own output, or use :func:`modes` with
    the global mode count."""
    found = getattr(x, _ATTR, None)
    if not isinstance(found, SpectralLayout):
        raise ConfigError(
            "this tensor carries no spectral layout (only the direct output of mpidp.ops.fft."
            "rfft2/fft2/rfft/fft does); call mpidp.ops.fft.modes(n_modes, manager=...) instead"
        )
    return found


def mode_spec(n: int, *, manager: DistributedManager | None = None, group: Any = None) -> ShardSpec:
    """How ``n`` global modes are cut over the group in the spectral layout: the manager's
    partition policy, or, with fewer modes than ranks, a balanced cut with empty last ranks."""
    m = manager if manager is not None else get_manager()
    size = group.size if isinstance(group, Transport) else m.transport(group).size
    return policy(m, n, size)


def modes(
    x: torch.Tensor | int, *, manager: DistributedManager | None = None, group: Any = None
) -> slice:
    """The global mode numbers this rank holds along the split dim of the spectral layout, as
    a slice: ``filt[..., modes(X)]`` is this rank's part of a filter over the ``Kx`` modes.

    ``x`` is the direct output of a transform (its recorded layout), or the global number of
    modes (``W // 2 + 1`` for ``rfft2``, ``W`` for ``fft2``) with the manager that cuts them."""
    if isinstance(x, torch.Tensor):
        return layout(x).modes
    m = manager if manager is not None else get_manager()
    t = group if isinstance(group, Transport) else m.transport(group)
    return mode_spec(int(x), manager=m, group=t).slice(t.rank)
