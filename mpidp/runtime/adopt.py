"""Domain managers for process groups and device meshes that mpidp did not build.

PhysicsNeMo users build their mesh with ``DistributedManager().initialize_mesh(...)`` or
torch's ``init_device_mesh``; anemoi users their model groups with ``dist.new_group(...)``.
:func:`manager_for` gives every such group (or 1-D mesh, or named axis of a larger one) a
domain manager: the manager mpidp already has for exactly those ranks, else an
:class:`AdoptedManager`, made once per group and convention and cached, closed with the
manager it was made beside (or at :func:`release`). Adopting communicates nothing; the MPI
communicator of an adopted group (when MPI runs the job) is made at its first collective,
which every member of the group calls.

A 2-D mesh (``init_device_mesh(..., (P_lat, P_lon), mesh_dim_names=("lat", "lon"))``, or the
``mesh["lat", "lon"]`` of a ``(dp, lat, lon)`` mesh) is a grid of blocks
(:mod:`mpidp.runtime.grid`): its dim 0 is the latitude column, dim 1 the longitude row, its
ranks row-major the domain ranks. The axis groups are the mesh's own; the communicators and
the torch group over the whole grid that the mesh lacks are made at their first collective
(collective over that group's members alone).

``gradients`` is the convention of the project whose set-up made the group: ``"shares"``
(mpidp's: a plain tensor used on a band holds this rank's share of its gradient, summed by
:func:`mpidp.sync_gradients`) or ``"whole"`` (PhysicsNeMo's and DTensor's: every rank holds
the whole gradient of every plain tensor it used; the shares are summed in the backward, at
the point of use).
"""

from __future__ import annotations

import os
import socket
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mpidp.comm import TorchTransport, Transport
from mpidp.errors import ConfigError
from mpidp.runtime.bootstrap import LaunchInfo
from mpidp.runtime.grid import AXES, GridAxes, axis_transport
from mpidp.runtime.manager import (
    DEFAULT_TIMEOUT,
    MESH_MANAGERS,
    DistributedManager,
    Neighbors,
    get_manager,
    is_initialized,
)
from mpidp.runtime.partition import Balanced
from mpidp.runtime.transports import built_transport

__all__ = [
    "AdoptedManager",
    "GRADIENTS",
    "axis_manager",
    "group_ranks",
    "manager_for",
    "mesh_ndim",
    "release",
]

GRADIENTS = ("shares", "whole")
_ADOPTED: dict[tuple[Any, ...], AdoptedManager] = {}


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of a process group or 1-D device mesh, in group order. Local."""
    if isinstance(group, DeviceMesh):
        return tuple(int(r) for r in group.mesh.flatten().tolist())
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(int(r) for r in dist.get_process_group_ranks(group))


def _domain_mesh(mesh: DeviceMesh, rank: int) -> DeviceMesh:
    """``mesh`` as a domain: bands (1-D) or a grid of blocks (2-D, ranks in row-major order so
    that each axis group's order is the grid's, as torch orders a group's ranks)."""
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim > 2:
        raise ConfigError(
            f"rank {rank}: a {mesh.ndim}-D device mesh {names} as the domain: a domain is cut "
            f"over one mesh dim (bands) or two (latitude x longitude blocks), and the other "
            f"dims (data parallel) hold other samples; pass the domain's dims, e.g. "
            f"mesh['lat', 'lon'] (and the data-parallel dim to DDP)"
        )
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if mesh.ndim == 2 and ranks != sorted(ranks):
        raise ConfigError(
            f"rank {rank}: the 2-D device mesh {names} holds ranks {ranks}, not in increasing "
            f"row-major order: its axis groups would order their ranks otherwise than the grid; "
            f"build the mesh from increasing ranks (init_device_mesh does)"
        )
    return mesh


def manager_for(domain: Any, *, gradients: str | None = None) -> DistributedManager:
    """The domain manager of ``domain``: a :class:`~mpidp.DistributedManager` (itself), a 1-D
    DeviceMesh, a torch ProcessGroup, or None (mpidp's default manager). ``gradients``: the
    convention (None: whichever the found manager has; mpidp's own managers are ``"shares"``).
    A 1-D mesh or a group of the user's is bands (the grid ``(P, 1)``), also where a manager of
    blocks over the same ranks exists; a 2-D mesh is its grid; the domain group of mpidp's own
    manager (or the manager itself) under another convention keeps that manager's grid, blocks
    too. Local: no communication."""
    if gradients is not None and gradients not in GRADIENTS:
        raise ConfigError(f"gradients={gradients!r}; pass one of {GRADIENTS}")
    if isinstance(domain, DistributedManager):
        if gradients is None or domain.gradients == gradients:
            return domain
        return _adopt(domain.domain_group, domain.domain_mesh, gradients, domain, True)
    if domain is None:
        m = get_manager()
        return m if gradients in (None, m.gradients) else manager_for(m, gradients=gradients)
    if not dist.is_initialized():
        raise ConfigError(
            f"a domain group {domain!r} but torch.distributed is not initialised; initialise "
            f"it first (mpidp.init(), or your project's own set-up)"
        )
    mesh = _domain_mesh(domain, dist.get_rank()) if isinstance(domain, DeviceMesh) else None
    group = _group_of(mesh) if mesh is not None else domain
    ranks = group_ranks(mesh if mesh is not None else group)
    if dist.get_rank() not in ranks:
        raise ConfigError(
            f"rank {dist.get_rank()}: the domain group {list(ranks)} does not hold this rank; "
            f"pass the group (or mesh) this rank belongs to"
        )
    own = _own_managers()
    grid = _grid_of(domain, mesh, len(ranks), own)
    for m in own:
        if m.domain_ranks == ranks and gradients in (None, m.gradients):
            if grid is None or m.grid == grid:
                return m
    # mpidp's own domain group (grid None) under another convention: its manager's grid
    owner = next((m for m in own if grid is None and group is m.domain_group), None)
    return _adopt(group, mesh, gradients or "shares", owner, owner is not None)


#: the dim names of the meshes mpidp builds (a manager's, mpidp.parallel.build_device_mesh's):
#: their "domain" dim is one dim whatever the manager's grid
_BUILT = {("dp", "domain"), ("dp", "tp", "domain")}


def _grid_of(
    domain: Any, mesh: DeviceMesh | None, size: int, own: list[DistributedManager]
) -> tuple[int, ...] | None:
    """The grid a manager must have to serve ``domain``: a 2-D mesh's shape; bands ``(P, 1)``
    for a 1-D mesh or a group of the user's (one dim: nothing in it names a longitude cut, so
    a manager of blocks over the same ranks would take each band for a block); None (the
    manager's, blocks too) for mpidp's own domain group or the "domain" dim of a mesh mpidp
    built, which is one dim over a grid of blocks."""
    if mesh is not None and mesh.ndim == 2:
        return tuple(mesh.shape)
    if mesh is None:
        return None if any(domain is m.domain_group for m in own) else (size, 1)
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    built = root is not mesh and tuple(root.mesh_dim_names or ()) in _BUILT
    return None if built and mesh.mesh_dim_names == ("domain",) else (size, 1)


def _group_of(mesh: DeviceMesh) -> Any:
    """The torch group over a domain mesh's ranks, when it has one already: a 2-D mesh's
    axis that holds every rank, or the world; else None (made at the first collective)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    for k in (0, 1):
        if mesh.size(k) == mesh.size():
            return mesh.get_group(k)
    if mesh.size() == dist.get_world_size():  # ranks in order: checked by _domain_mesh
        return dist.group.WORLD
    return None


def axis_manager(m: DistributedManager, k: int) -> DistributedManager:
    """The manager of the bands along dim ``k`` of ``m``'s 2-D mesh: that dim's group through
    this rank (``k`` 0: the latitude column), with ``m``'s gradient convention. Local."""
    return manager_for(m.domain_mesh.get_group(k), gradients=m.gradients)


def mesh_ndim(m: DistributedManager) -> int:
    """The dims of ``m``'s domain mesh: 2 for an adopted 2-D mesh (placements in pairs), else
    1. Local."""
    mesh = getattr(m, "_mesh", None) if isinstance(m, AdoptedManager) else None
    return 1 if mesh is None else int(mesh.ndim)


def _own_managers() -> list[DistributedManager]:
    found = [*MESH_MANAGERS, *([get_manager()] if is_initialized() else [])]
    return [m for m in found if not m._closed]


def _adopt(
    group: Any, mesh: DeviceMesh | None, gradients: str, base: Any, base_grid: bool = False
) -> AdoptedManager:
    base = base if base is not None else (get_manager() if is_initialized() else None)
    ranks = group_ranks(mesh if mesh is not None else group)
    if mesh is not None and mesh.ndim == 2:  # a sliced mesh is a new object; its groups are not
        axes = (id(mesh.get_group(0)), id(mesh.get_group(1)))
        key: tuple[Any, ...] = (ranks, gradients, id(base), *axes)
    else:
        key = (ranks, gradients, id(base), id(group), base_grid)
    made = _ADOPTED.get(key)
    if made is None or made._closed:
        made = _ADOPTED[key] = AdoptedManager(group, ranks, mesh, gradients, base, base_grid)
        if base is not None:
            base._on_shutdown.append(made.shutdown)
    return made


def release() -> None:
    """Close every adopted manager (their MPI communicators; the groups stay the user's)."""
    for m in list(_ADOPTED.values()):
        m.shutdown()
    _ADOPTED.clear()


class _Comms(dict[str, Any]):
    """The MPI communicators of a 2-D mesh's axes, each made at its first use."""

    def __init__(self, m: AdoptedManager, ranks: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        self._m, self._ranks = m, ranks

    def __missing__(self, axis: str) -> Any:
        made = self[axis] = self._m._comm_of(self._ranks[axis])
        return made


class _MeshAxes(GridAxes):
    """The latitude column (mesh dim 0) and longitude row (mesh dim 1) of an adopted 2-D
    mesh: the mesh's own groups (the user's, never destroyed here) and MPI communicators made
    at the first collective along each axis (collective over that axis group alone)."""

    def __init__(self, m: AdoptedManager, mesh: DeviceMesh) -> None:
        i_lat, i_lon = m.grid_coords
        grid = mesh.mesh.reshape(m.grid)
        ranks = {
            "lat": tuple(int(r) for r in grid[:, i_lon].tolist()),
            "lon": tuple(int(r) for r in grid[i_lat, :].tolist()),
        }
        groups = {"lat": mesh.get_group(0), "lon": mesh.get_group(1)}
        super().__init__(_Comms(m, ranks), groups, free_comms=True)

    def close(self) -> None:
        """Free the communicators made here (collective over each axis group)."""
        for comm in self.comms.values():
            comm.Free()
        self.comms.clear()


class AdoptedManager(DistributedManager):
    """A domain manager over a group mpidp did not build: the group's ranks are the domain
    (in the group's order), the rest of the job as the base manager (mpidp's default, when
    there is one) or torch.distributed sees it. It owns no process group; its data-parallel
    partners are unknown to it (``dp_world_size`` 1). Over a 2-D mesh its :attr:`grid` is the
    mesh's shape; with ``base_grid`` (the domain group of mpidp's own manager ``base`` under
    another gradient convention) ``base``'s grid, blocks too."""

    def __init__(
        self,
        group: Any,
        ranks: tuple[int, ...],
        mesh: DeviceMesh | None,
        gradients: str,
        base: DistributedManager | None,
        base_grid: bool = False,
    ) -> None:
        # no DistributedManager.__init__: nothing here is collective
        self._base = base
        self._mesh = mesh
        self.gradients = gradients
        self.partition = base.partition if base is not None else Balanced()
        self._args = cast(Any, ("adopted", ranks, gradients))
        self.timeout = base.timeout if base is not None else DEFAULT_TIMEOUT
        self.shard_dim = base.shard_dim if base is not None else -2
        self.transport_policy = base.transport_policy if base is not None else "torch"
        self._world_comm = base._world_comm if base is not None else None
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if base is not None:
            self.launch_info = base.launch_info
            self.local_rank, self.local_world_size = base.local_rank, base.local_world_size
            self.host, self.device = base.host, base.device
        else:
            self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            self.host = socket.gethostname()
            self.launch_info = LaunchInfo(
                "torch.distributed", self.rank, self.world_size, self.local_rank,
                self.local_world_size, self.host,
            )  # fmt: skip
            self.device = torch.device(
                f"cuda:{torch.cuda.current_device()}"
                if dist.get_backend(group) == "nccl"
                else "cpu"
            )
        self.backend = str(dist.get_backend(group))
        self.domain_ranks = ranks
        self.domain_world_size = len(ranks)
        self.domain_rank = ranks.index(self.rank)
        self.dp_world_size, self.dp_rank = 1, 0
        self.domain_group = group
        self.data_parallel_group = cast(Any, None)  # unknown: refused by _group_key
        self.domain_comm = None  # made at the first MPI collective (:meth:`_comm`)
        self.dp_comm = None
        self._owns_process_group = False
        self._transports: dict[tuple[str, str], Transport] = {}
        self._on_shutdown = []
        self._closed = False
        two = mesh is not None and mesh.ndim == 2
        # ``base_grid``: the domain group of mpidp's own manager ``base`` under another
        # gradient convention: its grid, blocks too, and its axis groups (the base closes them)
        own = base_grid and base is not None
        self._grid = (
            (mesh.size(0), mesh.size(1)) if two else base.grid if own else (len(ranks), 1)  # type: ignore[union-attr]
        )
        self._blocks = self._grid[1] > 1
        if own:
            self._grid_axes = getattr(base, "_grid_axes", None)
        else:
            self._grid_axes = (
                _MeshAxes(self, mesh) if mesh is not None and min(self._grid) > 1 else None
            )
            if self._grid_axes is not None:
                self._on_shutdown.append(self._grid_axes.close)

    @property
    def mpi_available(self) -> bool:
        return self._base is not None and self._base.mpi_available

    @property
    def domain_mesh(self) -> DeviceMesh:
        """The mesh given (2-D for blocks), or one made over the group (no communication)."""
        if self._mesh is None:
            self._mesh = DeviceMesh.from_group(self.domain_group, self.device.type)
        return self._mesh

    def _comm(self) -> Any:
        """The group's MPI communicator, made the first time (collective over the group)."""
        if self.domain_comm is None:
            self.domain_comm = self._comm_of(self.domain_ranks)
        return self.domain_comm

    def _comm_of(self, ranks: tuple[int, ...]) -> Any:
        """A new MPI communicator over the global ``ranks`` (collective over them alone)."""
        world = self._world_comm
        assert world is not None
        return world.Create_group(world.group.Incl(list(ranks)), hash(ranks) % 32768)

    def _torch_group(self) -> Any:
        """The torch group over the domain; a 2-D mesh that lacks one gets it the first time
        (collective over the domain's ranks alone)."""
        if self.domain_group is None:
            self.domain_group = dist.new_group(
                list(self.domain_ranks), use_local_synchronization=True
            )
        return self.domain_group

    def neighbor_ranks(self, periodic: bool = False) -> Neighbors:
        """Global ranks of the group's ranks before and after this one, in the group's order
        (None at an edge unless ``periodic``): the group's own ranks, whatever they are."""
        p, i, ranks = self.domain_world_size, self.domain_rank, self.domain_ranks
        before = i - 1 if i > 0 else (p - 1 if periodic else None)
        after = i + 1 if i < p - 1 else (0 if periodic else None)
        return Neighbors(
            None if before is None else ranks[before], None if after is None else ranks[after]
        )

    def _group_key(self, group: Any) -> str:
        key = DistributedManager._group_key(self, group)
        if key == "dp":  # the data-parallel partners of an adopted group are not known
            raise ConfigError(
                f"rank {self.rank}: group {group!r} on the manager adopted for the domain group "
                f"{list(self.domain_ranks)}: it knows that group ('domain') and the world only"
            )
        return key

    def transport(self, group: Any = None, device: str | torch.device | None = None) -> Transport:
        """The transport over the adopted group (or the world) for tensors on ``device``:
        MPI for CPU tensors when MPI runs the job, else the group's own torch backend."""
        key = self._group_key(group)
        if key in AXES:  # the mesh's dims, or bands: the latitude column is the group
            return axis_transport(self, key, device)
        dev = torch.device(device) if device is not None else self.device
        if key == "world":
            if self._base is not None:
                return self._base.transport("world", dev)
            world = cast(Any, dist.group.WORLD)
            return self._remember(("world", dev.type), TorchTransport(world, dev))
        return built_transport(
            self,
            "domain",
            dev,
            cpu=self.transport,
            mpi_comm=self._comm,
            torch_group=self._torch_group,
        )

    def _remember(self, key: tuple[str, str], made: Transport) -> Transport:
        made.whole = self.gradients == "whole"
        self._transports[key] = made
        return made

    def shutdown(self, sync: bool = True) -> None:
        """Free the communicator made here; the group stays its owner's. Local."""
        if self._closed:
            return
        self._closed = True
        for close in reversed(self._on_shutdown):
            close()
        if self.domain_comm is not None:
            self.domain_comm.Free()
            self.domain_comm = None
        self._transports.clear()

    def __repr__(self) -> str:
        return (
            f"AdoptedManager(ranks={list(self.domain_ranks)}, domain_rank={self.domain_rank}, "
            f"gradients={self.gradients}, backend={self.backend}, device={self.device})"
        )
