"""The domain group as a ``P_lat x P_lon`` grid of blocks; bands are the grid ``(P, 1)``.

Domain rank ``d = i_lat * P_lon + i_lon`` (row-major over the domain group, which stays a run of
consecutive ranks inside one data-parallel replica). Two axis groups cross at every rank:

* its **latitude column** (``"lat"``): the ranks sharing ``i_lon``, in ``i_lat`` order; a
  field's rows are cut over it;
* its **longitude row** (``"lon"``): the ranks sharing ``i_lat``, in ``i_lon`` order; a field's
  columns are cut over it.

An axis with one rank along it is this rank alone (a :class:`~mpidp.comm.single.SelfTransport`,
every primitive the identity), and an axis holding the whole domain is the domain group itself,
so code written for blocks runs unchanged on bands: no second code path. Communicators and
process groups of their own are made only for a grid with more than one rank along both axes.

:class:`BlockSpec` is the partition of one field: a :class:`~mpidp.ShardSpec` per axis, each
made by the manager's partition policy (uneven allowed).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mpidp.comm import Transport
from mpidp.comm.single import SelfTransport
from mpidp.errors import ConfigError
from mpidp.runtime.partition import PartitionPolicy, ShardSpec
from mpidp.runtime.transports import built_transport

if TYPE_CHECKING:
    from mpidp.runtime.manager import DistributedManager

__all__ = [
    "AXES",
    "BlockSpec",
    "GridAxes",
    "axis_transport",
    "block_spec",
    "blocks_refused",
    "grid_shape",
    "parse_domain",
]

#: the axis groups of a grid, as ``group=`` names them
AXES = ("lat", "lon")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def parse_domain(text: str) -> int | tuple[int, int]:
    """The domain a command line names: ``"4"`` (4 ranks of latitude bands) or ``"2x2"`` (a
    grid of ``P_lat x P_lon`` blocks), as ``domain_parallel_size`` takes it. Raises
    :class:`~mpidp.ConfigError` with the usage when it is neither. Local."""
    usage = (
        f"{text!r} is not a domain: give N ranks (latitude bands) or LATxLON ranks (blocks), "
        f"each a whole number >= 1, e.g. 4 or 2x2"
    )
    parts = str(text).strip().lower().split("x")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(usage)
    sizes = [int(p) for p in parts]
    if min(sizes) < 1:
        raise ConfigError(usage)
    return sizes[0] if len(sizes) == 1 else (sizes[0], sizes[1])


def grid_shape(domain: Any, world_size: int, rank: int) -> tuple[int, int]:
    """``(P_lat, P_lon)`` from ``domain_parallel_size``: an int P (bands: ``(P, 1)``) or a
    ``(P_lat, P_lon)`` pair. Raises :class:`~mpidp.ConfigError` naming the values and the fix
    when it is not positive or its product does not divide the world. Local."""
    if isinstance(domain, int) and not isinstance(domain, bool):
        if domain < 1:
            raise ConfigError(
                f"rank {rank}: domain_parallel_size must be an integer >= 1, got {domain!r}"
            )
        if world_size % domain:
            raise ConfigError(
                f"rank {rank}: world size {world_size} is not divisible by "
                f"domain_parallel_size {domain}; use one of {_divisors(world_size)} or launch a "
                f"multiple of {domain} ranks"
            )
        return domain, 1
    pair: tuple[int, ...] = ()
    if isinstance(domain, Sequence) and not isinstance(domain, str) and len(domain) == 2:
        try:
            pair = tuple(operator.index(p) for p in domain if not isinstance(p, bool))
        except TypeError:
            pair = ()
    if len(pair) != 2 or min(pair) < 1:
        raise ConfigError(
            f"rank {rank}: domain_parallel_size must be an integer >= 1 (bands) or a "
            f"(P_lat, P_lon) pair of integers >= 1 (blocks), got {domain!r}; e.g. "
            f"domain_parallel_size=(2, 2)"
        )
    p_lat, p_lon = pair
    if world_size % (p_lat * p_lon):
        fits = [(a, d // a) for d in _divisors(world_size) for a in _divisors(d)]
        raise ConfigError(
            f"rank {rank}: world size {world_size} is not divisible by the domain grid "
            f"domain_parallel_size=({p_lat}, {p_lon}) of {p_lat * p_lon} ranks; use a grid "
            f"whose product divides {world_size} (one of {fits}) or launch a multiple of "
            f"{p_lat * p_lon} ranks"
        )
    return p_lat, p_lon


def blocks_refused(m: DistributedManager, what: str) -> ConfigError:
    """The error for band code (``what``) met with a manager whose grid cuts the longitude
    (``P_lon > 1``): it would take each rank's block for a band and compute a wrong result.

    Raised by the entry points of band code (converted layers and models, ShardedTensors, the
    1-D halo exchange and the v-collectives over the domain group) on every rank alike, before
    any message: every rank's manager has the same grid. Local."""
    p_lat, p_lon = m.grid
    return ConfigError(
        f"rank {m.rank}: {what} works on bands, but the domain group is the grid "
        f"({p_lat}, {p_lon}) of latitude x longitude blocks: it would take each rank's block "
        f"for a band and give a wrong result. On blocks: a converted model (its forward on "
        f"block ShardedTensors: element-wise ops, slices, views, cat, reductions over both "
        f"cut dims), mpidp.shard(x, dim=(-2, -1)), the converted 2-D and 3-D layers "
        f"(convolutions, pools, norms, pads, interpolation, pixel shuffles, PeriodicConv2d, "
        f"spectral filters, window attention), halo_exchange(x, ..., dim=(-2, -1)), "
        f"shard_tensor / gather_tensor(x, dim=(-2, -1)), manager.block_spec(shape), the "
        f"readers and write_sharded, latitude_weights, mean_share and "
        f"the global losses, and rfft2 / irfft2 / fft2 / ifft2 of blocks (torch.fft of a "
        f"block ShardedTensor, or mpidp.ops.fft). "
        f"fix: "
        f"mpidp.init(domain_parallel_size={p_lat * p_lon}) for bands, or for a 1-D collective "
        f"along one axis pass its group: "
        f"group=manager.transport('lat') or group=manager.transport('lon')"
    )


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """How a field's two grid dims are cut into blocks: ``lat`` over the latitude columns'
    ``P_lat`` ranks (the rows), ``lon`` over the longitude rows' ``P_lon`` ranks (the columns).

    Domain rank ``d`` owns rows ``lat.slice(i_lat)`` and columns ``lon.slice(i_lon)`` with
    ``(i_lat, i_lon) = divmod(d, P_lon)``. ``dims`` are the tensor dims (latitude, longitude).

    ``lead`` (per axis, latitude then longitude; 1 for a field) counts the blocks merged
    before each cut into its dim, as a band's ``blocks``: a window partition at a batch above 1
    folds the batch into the window index that holds a cut, so that dim is ``lead`` runs of the
    axis's global entries and each rank holds its own part of every run (a strided set, as
    DTensor's ``_StridedShard``; :class:`~mpidp.sharded.layout.Cut`).
    """

    lat: ShardSpec
    lon: ShardSpec
    dims: tuple[int, int] = (-2, -1)
    lead: tuple[int, int] = (1, 1)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(int(d) for d in self.dims))
        object.__setattr__(self, "lead", tuple(int(n) for n in self.lead))
        if len(self.dims) != 2:
            raise ConfigError(f"BlockSpec dims {self.dims}: give two dims (latitude, longitude)")
        if len(self.lead) != 2 or min(self.lead) < 1:
            raise ConfigError(f"BlockSpec lead {self.lead}: give two counts >= 1 (per axis)")

    @property
    def grid(self) -> tuple[int, int]:
        """``(P_lat, P_lon)``."""
        return self.lat.parts, self.lon.parts

    @property
    def shape(self) -> tuple[int, int]:
        """The global extents ``(H, W)``."""
        return self.lat.total, self.lon.total

    def coords(self, rank: int) -> tuple[int, int]:
        """``(i_lat, i_lon)`` of domain rank ``rank``."""
        p = self.lat.parts * self.lon.parts
        if not 0 <= rank < p:
            raise ConfigError(f"rank {rank} is not a block of {self!r}; use 0..{p - 1}")
        i_lat, i_lon = divmod(rank, self.lon.parts)
        return i_lat, i_lon

    def block(self, rank: int) -> tuple[slice, slice]:
        """The global rows and columns domain rank ``rank`` owns."""
        i_lat, i_lon = self.coords(rank)
        return self.lat.slice(i_lat), self.lon.slice(i_lon)

    def block_shape(self, rank: int) -> tuple[int, int]:
        """``(rows, columns)`` of domain rank ``rank``'s block."""
        i_lat, i_lon = self.coords(rank)
        return self.lat.sizes[i_lat], self.lon.sizes[i_lon]

    @property
    def merged(self) -> bool:
        """Whether blocks are merged before a cut (a ``lead`` above 1)."""
        return self.lead != (1, 1)

    def __repr__(self) -> str:
        lead = f", lead={self.lead}" if self.merged else ""
        return f"BlockSpec(lat={self.lat.sizes}, lon={self.lon.sizes}, dims={self.dims}{lead})"


def block_spec(
    policy: PartitionPolicy | Sequence[PartitionPolicy],
    extents: Sequence[int],
    grid: tuple[int, int],
    dims: Sequence[int] = (-2, -1),
    rank: int = 0,
) -> BlockSpec:
    """The blocks of a field whose grid dims have ``extents`` ``(H, W)``, cut by ``policy``
    per dim (one policy, or one per dim) over ``grid``. Local."""
    policies = tuple(policy) if isinstance(policy, Sequence) else (policy, policy)
    try:
        lat = policies[0].spec(int(extents[0]), grid[0])
        lon = policies[1].spec(int(extents[1]), grid[1])
    except ConfigError as err:
        raise ConfigError(f"rank {rank}: blocks of {tuple(extents)} over {grid}: {err}") from None
    return BlockSpec(lat, lon, (int(dims[0]), int(dims[1])))


class GridAxes:
    """The MPI communicators and torch process groups of this rank's latitude column and
    longitude row, for a grid with more than one rank along both axes (:meth:`build`)."""

    def __init__(self, comms: dict[str, Any], groups: dict[str, Any], free_comms: bool) -> None:
        self.comms, self.groups, self._free = comms, groups, free_comms

    @classmethod
    def build(cls, m: DistributedManager) -> GridAxes | None:
        """Collective over the world (every rank makes every row's and column's group, in
        one order); None when an axis has one rank (then no group is made)."""
        p_lat, p_lon = m.grid
        if p_lat == 1 or p_lon == 1:
            return None
        i_lat, i_lon = m.grid_coords
        comms: dict[str, Any] = {}
        mpi = m.domain_comm is not None and m._mpi_runs_job()
        if mpi:
            comms["lon"] = m.domain_comm.Split(color=i_lat, key=i_lon)
            comms["lat"] = m.domain_comm.Split(color=i_lon, key=i_lat)
        p = p_lat * p_lon
        rows = [
            [dp * p + i * p_lon + j for j in range(p_lon)]
            for dp in range(m.dp_world_size)
            for i in range(p_lat)
        ]
        cols = [
            [dp * p + i * p_lon + j for i in range(p_lat)]
            for dp in range(m.dp_world_size)
            for j in range(p_lon)
        ]
        lon_pg, _ = dist.new_subgroups_by_enumeration(rows)
        lat_pg, _ = dist.new_subgroups_by_enumeration(cols)
        return cls(comms, {"lat": lat_pg, "lon": lon_pg}, mpi)

    def close(self) -> None:
        """Free the communicators (collective) and destroy the process groups (local)."""
        for comm in self.comms.values():
            if self._free:
                comm.Free()
        self.comms = {}
        for group in self.groups.values():
            if dist.is_initialized():
                try:
                    dist.destroy_process_group(group)
                except (ValueError, RuntimeError):
                    pass  # destroyed already, with the default group
        self.groups = {}


def axis_transport(
    m: DistributedManager, axis: str, device: str | torch.device | None = None
) -> Transport:
    """The transport over this rank's latitude column (``"lat"``) or longitude row
    (``"lon"``) for tensors on ``device``: the domain group's own when the axis holds the whole
    domain, this rank alone when it holds one rank, else the axis group's (MPI for CPU tensors
    when MPI runs the job, as :meth:`~mpidp.DistributedManager.transport` chooses)."""
    if axis not in AXES:
        raise ConfigError(f"rank {m.rank}: unknown grid axis {axis!r}; use 'lat' or 'lon'")
    p_lat, p_lon = m.grid
    n = p_lat if axis == "lat" else p_lon
    if n == m.domain_world_size:
        return m.transport("domain", device)
    if n == 1:
        made = m._transports.get((axis, "self"))
        if made is None:
            made = m._transports[(axis, "self")] = SelfTransport()
        return made
    dev = torch.device(device) if device is not None else m.device
    axes: GridAxes | None = getattr(m, "_grid_axes", None)
    if axes is None:
        raise ConfigError(f"rank {m.rank}: the {axis} group of grid {m.grid} was never made")
    return built_transport(
        m,
        axis,
        dev,
        cpu=lambda: axis_transport(m, axis, "cpu"),
        mpi_comm=lambda: axes.comms[axis],
        torch_group=lambda: axes.groups[axis],
    )
