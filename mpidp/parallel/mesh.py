"""The ``(dp, tp, domain)`` device mesh over the world, domain innermost, and the manager that
matches it (:func:`build_device_mesh`, :class:`ParallelMesh`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mpidp.comm import TorchTransport, Transport
from mpidp.errors import ConfigError
from mpidp.ops.training import sum_in_buckets, sync_gradients
from mpidp.parallel.config import MESH_DIMS, ParallelismConfig
from mpidp.runtime.groups import destroy_groups, group_references, release_groups
from mpidp.runtime.manager import (
    MESH_MANAGERS,
    DistributedManager,
    get_manager,
    init,
    is_initialized,
)

_MPI_GROUPS: dict[tuple[int, ...], Any] = {}


def _group_ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


class ParallelMesh:
    """What :func:`build_device_mesh` returns: the 3-D ``mesh`` (dims ``"dp"``, ``"tp"``,
    ``"domain"``), the ``submeshes`` present, the ``config`` and the ``manager`` whose domain
    group is the mesh's domain dimension.

    ``meshes["tp"]`` is a sub-mesh (KeyError naming those present when absent); ``"tp" in
    meshes``, ``meshes.get("dp")``; ``mesh, submeshes = meshes`` unpacks.
    A sub-mesh is present for ``"dp"`` when data is ``ddp``/``fsdp2`` or dp > 1, for ``"tp"``
    when tensor > 1 and for ``"domain"`` when domain > 1.
    """

    def __init__(
        self,
        mesh: DeviceMesh,
        submeshes: dict[str, DeviceMesh],
        config: ParallelismConfig,
        manager: DistributedManager,
    ) -> None:
        self.mesh = mesh
        self.submeshes = submeshes
        self.config = config
        self.manager = manager
        self._closed = False
        self.dp_size, self.tp_size, self.domain_size = (int(s) for s in mesh.mesh.shape)
        coordinate = mesh.get_coordinate()
        assert coordinate is not None  # every rank of the world is in the mesh
        self.dp_rank, self.tp_rank, self.domain_rank = (int(c) for c in coordinate)
        self._group_references = group_references(self._groups())

    def __getitem__(self, name: str) -> DeviceMesh:
        if name not in self.submeshes:
            raise KeyError(
                f"no {name!r} sub-mesh in {self.config.as_dict()}: present are "
                f"{sorted(self.submeshes)} (a dimension of size 1 is absent, except dp when "
                f"data is ddp/fsdp2)"
            )
        return self.submeshes[name]

    def __contains__(self, name: object) -> bool:
        return name in self.submeshes

    def get(self, name: str, default: Any = None) -> Any:
        return self.submeshes.get(name, default)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.mesh, self.submeshes))

    def close(self) -> None:
        """Free the mesh's process groups and MPI communicators (local); the manager's
        ``shutdown`` calls it. The meshes are unusable afterwards."""
        if self._closed:
            return
        self._closed = True
        for name in MESH_DIMS:
            comm = _MPI_GROUPS.pop(_group_ranks(self.mesh[name]), None)
            if comm is not None:
                comm.Free()

        def destroy() -> None:
            if dist.is_initialized():
                destroy_groups(self.mesh)

        # the groups go once nothing holds them: the cyclic collector runs when something
        # (a DDP/FSDP2 model, live or garbage) took one since (mpidp.runtime.groups)
        release_groups(self._group_references, self._groups(), destroy)

    def _groups(self) -> list[Any]:
        """The process group of each mesh dimension (none once torch.distributed is gone)."""
        if not dist.is_initialized():
            return []
        return [self.mesh.get_group(d) for d in range(self.mesh.ndim)]

    def __enter__(self) -> ParallelMesh:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def sync_gradients(self, model: nn.Module) -> None:
        """The gradient reduction this layout still needs after ``backward()``: the domain sum
        (:func:`sync_domain_gradients`) when DDP/FSDP2 average over dp or dp is 1; with
        ``data="none"`` and dp > 1, :func:`mpidp.sync_gradients` (domain sum and dp average in
        one all-reduce). Collective."""
        if self.config.data == "none" and self.dp_size > 1:
            sync_gradients(model, self.manager)
        else:
            sync_domain_gradients(model, self.manager)

    def __repr__(self) -> str:
        return (
            f"ParallelMesh(dp={self.dp_size}, tp={self.tp_size}, domain={self.domain_size}, "
            f"data={self.config.data!r}, coordinate=({self.dp_rank}, {self.tp_rank}, "
            f"{self.domain_rank}), submeshes={sorted(self.submeshes)})"
        )


def build_device_mesh(
    parallelism_conf: ParallelismConfig | Mapping[str, Any],
    device: str | torch.device | None = None,
    *,
    manager: DistributedManager | None = None,
) -> ParallelMesh:
    """The ``(dp, tp, domain)`` DeviceMesh of ``parallelism_conf`` and its sub-meshes.

    Initialises mpidp (:func:`mpidp.init` with ``domain_parallel_size=domain`` and ``device``)
    unless ``manager`` is given or mpidp is initialised already; that manager's domain size must
    be the config's. ``device`` (default: the manager's) picks the mesh's device type. The world
    must be a multiple of tensor x domain (ConfigError naming the sizes otherwise; the check
    runs before any communication, the same on every rank). Collective over the world.
    """
    conf = ParallelismConfig.coerce(parallelism_conf)
    if manager is None and is_initialized():
        manager = get_manager()
    world = manager.world_size if manager is not None else DistributedManager.world_from_launcher()
    dp, tp, domain = conf.sizes(world)
    if manager is None:
        manager = init(domain_parallel_size=conf.domain, device=device)
    elif manager.grid != conf.grid:
        raise ConfigError(
            f"rank {manager.rank}: the manager's domain grid is {manager.grid} but the "
            f"parallelism config asks for {conf.grid}; build the manager with "
            f"domain_parallel_size={conf.domain} (or let build_device_mesh initialise mpidp)"
        )
    dev = torch.device(device) if device is not None else manager.device
    mesh = init_device_mesh(dev.type, (dp, tp, domain), mesh_dim_names=MESH_DIMS)
    present = {
        "dp": conf.data != "none" or dp > 1,
        "tp": tp > 1,
        "domain": domain > 1,
    }
    submeshes = {name: mesh[name] for name in MESH_DIMS if present[name]}
    _register_mpi_groups(manager, mesh)
    if manager not in MESH_MANAGERS:
        MESH_MANAGERS.append(manager)
        manager._on_shutdown.append(lambda: MESH_MANAGERS.remove(manager))
    meshes = ParallelMesh(mesh, submeshes, conf, manager)
    manager._on_shutdown.append(meshes.close)
    return meshes


def _register_mpi_groups(manager: DistributedManager, mesh: DeviceMesh) -> None:
    """One MPI communicator per mesh dimension (collective over the world), when MPI spans the
    job: the tensor-parallel layers then move CPU tensors through MPI, as the domain layers do."""
    if not manager.mpi_available or manager.world_size == 1:
        return
    from mpi4py import MPI

    coord = mesh.get_coordinate()
    assert coord is not None
    for axis, name in enumerate(MESH_DIMS):
        ranks = _group_ranks(mesh[name])
        color = 0
        for i, size in enumerate(mesh.mesh.shape):
            if i != axis:
                color = color * int(size) + int(coord[i])
        if ranks in _MPI_GROUPS:
            # Split anyway: every rank must take part, whatever it has cached.
            MPI.COMM_WORLD.Split(color=color, key=int(coord[axis])).Free()
            continue
        _MPI_GROUPS[ranks] = MPI.COMM_WORLD.Split(color=color, key=int(coord[axis]))


def _transport(mesh: DeviceMesh, device: torch.device) -> Transport:
    """The transport over a 1-D (sub-)mesh for tensors on ``device``."""
    comm = _MPI_GROUPS.get(_group_ranks(mesh))
    if comm is not None and device.type == "cpu":
        from mpidp.comm.mpi import MPITransport

        return MPITransport(comm)
    return TorchTransport(mesh.get_group(), device)


def _one_dim(mesh: Any, what: str) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise ConfigError(
            f"{what} must be a 1-D DeviceMesh (meshes[...]), got {type(mesh).__name__}"
        )
    if mesh.ndim != 1:
        raise ConfigError(
            f"{what} must be a 1-D DeviceMesh, got {mesh.ndim} dims {mesh.mesh_dim_names}; "
            f"pass meshes['tp'] / meshes['dp'] / meshes['domain']"
        )
    return mesh


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (FSDP2's sharded parameters and gradients)."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


def sync_domain_gradients(
    model: nn.Module, manager: DistributedManager | ParallelMesh | None = None
) -> None:
    """Sum every gradient over the domain group, in place: after ``backward()`` when DDP or
    FSDP2 own the data-parallel average (the domain ranks' gradients are parts of one sample's
    gradient). Works on FSDP2's sharded gradients (the ranks of a domain group hold the same
    shard) and tensor-parallel shards (they share a tp coordinate). One all-reduce per bucket
    of about 32 MB. Collective over the domain group."""
    m = manager.manager if isinstance(manager, ParallelMesh) else manager or get_manager()
    if m.domain_world_size == 1:
        return
    sum_in_buckets(
        [local_tensor(p.grad) for p in model.parameters() if p.grad is not None], m, "domain"
    )
