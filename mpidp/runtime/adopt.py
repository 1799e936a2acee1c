"""Domain managers for process groups and device meshes that mpidp did not build.

PhysicsNeMo users build their mesh with ``DistributedManager().initialize_mesh(...)`` or
torch's ``init_device_mesh``; anemoi users their model groups with ``dist.new_group(...)``.
:func:`manager_for` gives every such group (or 1-D mesh, or named axis of a larger one) a
domain manager: the manager mpidp already has for exactly those ranks, else an
:class:`AdoptedManager`, made once per group and convention and cached, closed with the
manager it was made beside (or at :func:`release`). Adopting communicates nothing; the MPI
communicator of an adopted group (when MPI runs the job) is made at its first collective,
which every member of the group calls.

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
from mpidp.runtime.grid import AXES, axis_transport
from mpidp.runtime.manager import (
    DEFAULT_TIMEOUT,
    MESH_MANAGERS,
    DistributedManager,
    get_manager,
    is_initialized,
)
from mpidp.runtime.partition import Balanced
from mpidp.runtime.transports import built_transport

__all__ = ["AdoptedManager", "GRADIENTS", "group_ranks", "manager_for", "release"]

GRADIENTS = ("shares", "whole")
_ADOPTED: dict[tuple[Any, ...], AdoptedManager] = {}


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of a process group or 1-D device mesh, in group order. Local."""
    if isinstance(group, DeviceMesh):
        return tuple(int(r) for r in group.mesh.flatten().tolist())
    if group is None or group is dist.group.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(int(r) for r in dist.get_process_group_ranks(group))


def _one_dim(mesh: DeviceMesh, rank: int) -> DeviceMesh:
    if mesh.ndim != 1:
        raise ConfigError(
            f"rank {rank}: a {mesh.ndim}-D device mesh {tuple(mesh.mesh_dim_names or ())} as "
            f"the domain: bands are cut over one mesh dim; pass that axis, mesh['name']"
        )
    return mesh


def manager_for(domain: Any, *, gradients: str | None = None) -> DistributedManager:
    """The domain manager of ``domain``: a :class:`~mpidp.DistributedManager` (itself), a 1-D
    DeviceMesh, a torch ProcessGroup, or None (mpidp's default manager). ``gradients``: the
    convention (None: whichever the found manager has; mpidp's own managers are ``"shares"``).
    Local: no communication."""
    if gradients is not None and gradients not in GRADIENTS:
        raise ConfigError(f"gradients={gradients!r}; pass one of {GRADIENTS}")
    if isinstance(domain, DistributedManager):
        if gradients is None or domain.gradients == gradients:
            return domain
        return _adopt(domain.domain_group, domain.domain_mesh, gradients, domain)
    if domain is None:
        m = get_manager()
        return m if gradients in (None, m.gradients) else manager_for(m, gradients=gradients)
    if not dist.is_initialized():
        raise ConfigError(
            f"a domain group {domain!r} but torch.distributed is not initialised; initialise "
            f"it first (mpidp.init(), or your project's own set-up)"
        )
    mesh = _one_dim(domain, dist.get_rank()) if isinstance(domain, DeviceMesh) else None
    group = mesh.get_group() if mesh is not None else domain
    ranks = group_ranks(mesh if mesh is not None else group)
    if dist.get_rank() not in ranks:
        raise ConfigError(
            f"rank {dist.get_rank()}: the domain group {list(ranks)} does not hold this rank; "
            f"pass the group (or mesh) this rank belongs to"
        )
    for m in _own_managers():
        if m.domain_ranks == ranks and gradients in (None, m.gradients):
            return m
    return _adopt(group, mesh, gradients or "shares", None)


def _own_managers() -> list[DistributedManager]:
    found = [*MESH_MANAGERS, *([get_manager()] if is_initialized() else [])]
    return [m for m in found if not m._closed]


def _adopt(group: Any, mesh: DeviceMesh | None, gradients: str, base: Any) -> AdoptedManager:
    base = base if base is not None else (get_manager() if is_initialized() else None)
    ranks = group_ranks(mesh if mesh is not None else group)
    key = (ranks, gradients, id(base), id(group))
    made = _ADOPTED.get(key)
    if made is None or made._closed:
        made = _ADOPTED[key] = AdoptedManager(group, ranks, mesh, gradients, base)
        if base is not None:
            base._on_shutdown.append(made.shutdown)
    return made


def release() -> None:
    """Close every adopted manager (their MPI communicators; the groups stay the user's)."""
    for m in list(_ADOPTED.values()):
        m.shutdown()
    _ADOPTED.clear()


class AdoptedManager(DistributedManager):
    """A domain manager over a group mpidp did not build: the group's ranks are the domain
    (in the group's order), the rest of the job as the base manager (mpidp's default, when
    there is one) or torch.distributed sees it. It owns no process group; its data-parallel
    partners are unknown to it (``dp_world_size`` 1)."""

    def __init__(
        self,
        group: Any,
        ranks: tuple[int, ...],
        mesh: DeviceMesh | None,
        gradients: str,
        base: DistributedManager | None,
    ) -> None:
        # no DistributedManager.__init__: nothing here is collective
        self._base = base
        self._mesh_1d = mesh
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

    @property
    def mpi_available(self) -> bool:
        return self._base is not None and self._base.mpi_available

    @property
    def domain_mesh(self) -> DeviceMesh:
        """The mesh given, or one made over the group (no communication)."""
        if self._mesh_1d is None:
            self._mesh_1d = DeviceMesh.from_group(self.domain_group, self.device.type)
        return self._mesh_1d

    def _comm(self) -> Any:
        """The group's MPI communicator, made the first time (collective over the group)."""
        if self.domain_comm is None:
            world = self._world_comm
            assert world is not None
            tag = hash(self.domain_ranks) % 32768
            self.domain_comm = world.Create_group(world.group.Incl(list(self.domain_ranks)), tag)
        return self.domain_comm

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
        if key in AXES:  # bands: the latitude column is the group, the longitude row this rank
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
            torch_group=lambda: self.domain_group,
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
