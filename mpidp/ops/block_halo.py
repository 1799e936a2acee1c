"""The halo exchange of latitude x longitude blocks: the 1-D range fetch once along each axis.

A rank owns rows ``[s, e)`` and columns ``[c, d)`` of an ``H x W`` field. The exchange returns
rows ``[s - before_lat, e + after_lat)`` by columns ``[c - before_lon, d + after_lon)`` of the
field padded the way the serial model pads it: **latitude first** (its boundary, the polar
fold included, on the ``W`` columns of the circle), **then longitude** on the latitude-extended
field. Three steps, each the 1-D range fetch of :mod:`mpidp.ops.halo_band` over one axis group
(multi-hop when blocks are thinner than the halo, as on bands):

1. *latitude*, within the latitude column: the rows beyond a pole are mirrored (``reflect`` for
   ``"polar"``, ``symmetric`` for ``"polar_half"``) but not yet rolled;
2. *the polar fold*, within the longitude row, on those rows only: each takes the columns half
   a circle away, ``[c - W/2, d - W/2)`` circularly -- a range fetch of widths ``(W/2, -W/2)``
   from the blocks that own them, another rank when ``P_lon > 1``;
3. *longitude*, within the longitude row, on the latitude-extended block: its halo columns
   carry the latitude halo rows with them, so the corners come from this second phase.

Every step is a halo fetch whose backward is halo accumulate, so the backward of the whole is
its exact adjoint (double backward too). On bands (``P_lon = 1``) steps 2 and 3 run over this
rank alone: the same code, no messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mpidp.errors import ConfigError
from mpidp.ops.blocks import SpecLike, as_block_spec, block_dims, grid_transports
from mpidp.ops.halo_band import Widths, band_halo_exchange
from mpidp.ops.halo_plan import Boundary
from mpidp.runtime.grid import BlockSpec
from mpidp.runtime.manager import DistributedManager
from mpidp.runtime.partition import ShardSpec

__all__ = ["block_halo_exchange", "block_boundaries"]

#: the mirror a polar kind makes before its roll
_UNROLLED = {"polar": "reflect", "polar_half": "symmetric"}


def block_boundaries(boundary: Any, rank: int = 0) -> tuple[Boundary, Boundary]:
    """``(latitude, longitude)`` boundaries from what users pass: one kind for both dims, or
    a ``(latitude, longitude)`` pair whose entries are kinds, ``(low, high)`` pairs or
    :class:`~mpidp.Boundary` objects. The polar kinds belong to the latitude only."""
    if boundary is None or isinstance(boundary, (str, Boundary)):
        pair: tuple[Any, Any] = (boundary, boundary)
    elif isinstance(boundary, Sequence) and len(boundary) == 2:
        pair = (boundary[0], boundary[1])
    else:
        raise ConfigError(
            f"rank {rank}: block boundary {boundary!r}: pass one kind, or a (latitude, "
            f"longitude) pair, e.g. ('polar', 'circular')"
        )
    lat, lon = Boundary.of(pair[0]), Boundary.of(pair[1])
    if lon.polar:
        raise ConfigError(
            f"rank {rank}: boundary {lon!r} along the longitude: the polar fold is a latitude "
            f"boundary; pass e.g. boundary=('polar', 'circular')"
        )
    return lat, lon


def _pair(w: Any, what: str, rank: int) -> tuple[Widths, Widths]:
    if isinstance(w, int) and not isinstance(w, bool):
        return w, w
    if isinstance(w, Sequence) and len(w) == 2:
        return w[0], w[1]
    raise ConfigError(
        f"rank {rank}: {what}={w!r} for blocks: pass one int for both dims or a (latitude, "
        f"longitude) pair, each an int or one int per rank of that axis"
    )


def _mine(w: Widths, i: int) -> int:
    return int(w) if isinstance(w, int) else int(w[i])


def _learned(x: torch.Tensor, dims: tuple[int, int], t_lat: Any, t_lon: Any) -> BlockSpec:
    lat = ShardSpec.from_sizes([r[0] for r in t_lat.all_gather_ints([x.size(dims[0])])])
    lon = ShardSpec.from_sizes([r[0] for r in t_lon.all_gather_ints([x.size(dims[1])])])
    return BlockSpec(lat, lon, dims)


def block_halo_exchange(
    x: torch.Tensor,
    before: Widths | tuple[Widths, Widths],
    after: Widths | tuple[Widths, Widths],
    dims: Sequence[int] = (-2, -1),
    spec: SpecLike | None = None,
    manager: DistributedManager | None = None,
    boundary: Any = ("zeros", "circular"),
) -> torch.Tensor:
    """This rank's block extended by ``before`` / ``after`` rows and columns.

    Parameters
    ----------
    x:
        This rank's block; ``dims`` are its (latitude, longitude) dims.
    before, after:
        ``(latitude, longitude)`` widths at the low / high ends (one int: both dims); each an
        int or one int per rank of that axis (negative: trim), as :func:`mpidp.halo_exchange`.
    spec:
        The blocks (:meth:`mpidp.DistributedManager.block_spec`), or None to learn them from
        every rank's extents (one small all-gather along each axis).
    boundary:
        ``(latitude, longitude)``: any kind :func:`mpidp.halo_exchange` takes along each dim
        (``"polar"`` and ``"polar_half"`` along the latitude only; they need an even ``W``).

    Returns
    -------
    The extended block (see the module docstring for the padding order); its gradient flows
    back to the ranks owning each entry (the exact adjoint).

    Collective over the domain group: every rank calls it with the same widths and boundary.
    """
    m, t_lat, t_lon = grid_transports(manager, x.device)
    d = block_dims(x.dim(), dims, m.rank)
    b_lat, b_lon = block_boundaries(boundary, m.rank)
    bw_lat, bw_lon = _pair(before, "before", m.rank)
    aw_lat, aw_lon = _pair(after, "after", m.rank)
    bs = as_block_spec(spec, d) if spec is not None else _learned(x, d, t_lat, t_lon)
    if b_lat.polar and bs.shape[1] % 2:
        raise ConfigError(
            f"rank {m.rank}: polar boundary {b_lat!r}: the longitude has {bs.shape[1]} columns, "
            f"odd; rows across a pole are rolled by half the circle, which needs an even size"
        )
    plain = Boundary(_UNROLLED.get(b_lat.low, b_lat.low), _UNROLLED.get(b_lat.high, b_lat.high))
    y = band_halo_exchange(x, bw_lat, aw_lat, d[0], bs.lat, boundary=plain, group=t_lat)
    if b_lat.polar:
        i = t_lat.rank
        y = _fold(y, bs, d, b_lat, i, (_mine(bw_lat, i), _mine(aw_lat, i)), t_lon)
    return band_halo_exchange(y, bw_lon, aw_lon, d[1], bs.lon, boundary=b_lon, group=t_lon)


def _fold(
    y: torch.Tensor,
    bs: BlockSpec,
    d: tuple[int, int],
    b: Boundary,
    i_lat: int,
    widths: tuple[int, int],
    t_lon: Any,
) -> torch.Tensor:
    """Step 2: the rows of ``y`` beyond a polar edge take the columns half a circle away.

    Every rank of a longitude row shares its latitude rows, so all of them fold the same rows
    (or none) and the fetches pair up."""
    h, w = bs.shape
    lo, hi = bs.lat.start(i_lat) - widths[0], bs.lat.stop(i_lat) + widths[1]
    n_low = max(0, min(hi, 0) - lo) if b.low.startswith("polar") else 0
    n_high = max(0, hi - max(lo, h)) if b.high.startswith("polar") else 0
    if not (n_low or n_high):
        return y
    rows = y.size(d[0])

    def rolled(strip: torch.Tensor) -> torch.Tensor:
        return band_halo_exchange(
            strip, w // 2, -(w // 2), d[1], bs.lon, boundary="circular", group=t_lon
        )

    parts = [rolled(y.narrow(d[0], 0, n_low))] if n_low else []
    parts.append(y.narrow(d[0], n_low, rows - n_low - n_high))
    if n_high:
        parts.append(rolled(y.narrow(d[0], rows - n_high, n_high)))
    return torch.cat(parts, d[0])
