"""Halo exchange, the public entry: each rank's band (one dim) or block (two dims), extended by
rows and columns that other ranks own.

:func:`halo_exchange` with one ``dim`` is the range fetch of :mod:`mpidp.ops.halo_band` (the
engine: plan, autograd Functions, :func:`start_halo_exchange`, :class:`PendingHalo`,
:func:`halo_strips`, re-exported here); with two dims ``(lat, lon)`` it is the block exchange of
:mod:`mpidp.ops.block_halo`, built on that engine. :class:`HaloExchange` is its module form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mpidp.errors import ConfigError
from mpidp.ops.block_halo import block_halo_exchange
from mpidp.ops.geometry import HaloSpec
from mpidp.ops.halo_band import (
    PendingHalo,
    Widths,
    _fetch_now,
    halo_strips,
    start_halo_exchange,
)
from mpidp.ops.halo_plan import BOUNDARY_KINDS, Boundary
from mpidp.runtime.manager import DistributedManager
from mpidp.runtime.partition import ShardSpec

__all__ = [
    "BOUNDARY_KINDS",
    "Boundary",
    "HaloExchange",
    "PendingHalo",
    "halo_exchange",
    "halo_strips",
    "start_halo_exchange",
]


def halo_exchange(
    x: torch.Tensor,
    before: Widths | tuple[Widths, Widths],
    after: Widths | tuple[Widths, Widths],
    dim: int | tuple[int, int] = -2,
    spec: Any = None,
    manager: DistributedManager | None = None,
    boundary: Any = "zeros",
    *,
    group: Any = None,
    roll_dim: int = -1,
) -> torch.Tensor:
    """This rank's band extended by ``before`` rows at its low end and ``after`` at its high end.

    With two dims, ``dim=(lat, lon)``, this rank's latitude x longitude block extended along
    both (corners and the polar fold included): :func:`mpidp.ops.block_halo.block_halo_exchange`,
    where ``before``, ``after`` and ``boundary`` are ``(latitude, longitude)`` pairs and ``spec``
    a :class:`~mpidp.runtime.grid.BlockSpec`.

    Parameters
    ----------
    x:
        This rank's band; its extent along ``dim`` is its shard size.
    before, after:
        Rows to add (negative: rows to drop) at the low / high end; one int for every rank, or
        a sequence with one entry per rank (see :class:`mpidp.HaloSpec` for layer geometry).
    dim:
        The sharded dimension.
    spec:
        The partition of the sharded dim over the group. None: learned from every rank's
        local size (it is learned anyway in the agreement, so passing it only adds
        a check).
    manager, group:
        Whose domain group (default: the default manager's), or any group the collectives
        accept.
    boundary:
        How rows beyond the global edges are filled, as the serial layer fills them: a kind
        (``"zeros"``, ``"replicate"``, ``"reflect"``, ``"symmetric"``, ``"circular"``,
        ``"polar"``, ``"polar_half"``, ``"none"`` / None), a ``(low, high)`` pair, or a
        :class:`Boundary`. See :class:`Boundary` for the grid convention of each polar kind.
    roll_dim:
        Polar boundaries: the dimension rolled by half its size (the longitude).

    Returns
    -------
    The extended band: global rows ``[start - before, stop + after)`` of the field. Its
    gradient flows back to the ranks owning each row (the exact adjoint).

    Collective over the group: every rank calls it with the same widths, dim, boundary and
    spec. Bad arguments on any rank raise the same :class:`~mpidp.CommError` (or, for widths
    the partition cannot serve, :class:`~mpidp.ConfigError`) on every rank.
    """
    if not isinstance(dim, int):
        if group is not None:
            raise ConfigError("halo_exchange on blocks runs over the manager's grid: pass manager")
        return block_halo_exchange(x, before, after, dim, spec, manager, boundary)
    # (the engine's own entry: one frame less than band_halo_exchange, no typing.cast calls)
    return _fetch_now(x, before, after, dim, spec, manager, boundary, group, roll_dim)  # type: ignore[arg-type]


class HaloExchange(torch.nn.Module):
    """Module form of :func:`halo_exchange`.

    ``halo_width`` is an int (both ends), a ``(before, after)`` pair (each may be one entry
    per rank) or a :class:`~mpidp.HaloSpec`. ``spec``, ``manager``, ``group`` given here are
    defaults for every call.
    """

    def __init__(
        self,
        halo_width: Widths | tuple[Widths, Widths] | HaloSpec,
        dim: int = -2,
        boundary: Any = "zeros",
        *,
        spec: ShardSpec | Sequence[int] | None = None,
        manager: DistributedManager | None = None,
        group: Any = None,
        roll_dim: int = -1,
    ) -> None:
        super().__init__()
        self.before: Widths
        self.after: Widths
        if isinstance(halo_width, HaloSpec):
            self.before, self.after = halo_width.before, halo_width.after
        elif isinstance(halo_width, Sequence) and len(halo_width) == 2:
            self.before, self.after = halo_width
        elif isinstance(halo_width, int):
            self.before = self.after = halo_width
        else:
            raise ConfigError(f"halo_width={halo_width!r}: pass an int or a (before, after) pair")
        self.dim, self.spec, self.manager, self.group = dim, spec, manager, group
        self.boundary = Boundary.of(boundary, roll_dim)

    def _args(self, spec: ShardSpec | Sequence[int] | None) -> dict[str, Any]:
        return {
            "dim": self.dim,
            "spec": spec if spec is not None else self.spec,
            "manager": self.manager,
            "boundary": self.boundary,
            "group": self.group,
        }

    def forward(
        self, x: torch.Tensor, spec: ShardSpec | Sequence[int] | None = None
    ) -> torch.Tensor:
        return halo_exchange(x, self.before, self.after, **self._args(spec))

    def start(self, x: torch.Tensor, spec: ShardSpec | Sequence[int] | None = None) -> PendingHalo:
        """Post the exchange; ``.wait()`` on the result gives what :meth:`forward` returns."""
        return start_halo_exchange(x, self.before, self.after, **self._args(spec))

    def extra_repr(self) -> str:
        return f"before={self.before}, after={self.after}, dim={self.dim}, {self.boundary!r}"
