"""PhysicsNeMo's ``DistributedManager`` (a Borg) over mpidp's one :class:`mpidp.DistributedManager`.

``DistributedManager.initialize()`` is the one collective: it attaches the shared state to
mpidp's default manager (``mpidp.init()`` when mpidp is not initialised yet; the one already
there otherwise, whatever its domain size). After it, ``DistributedManager()`` on any rank,
alone, returns that shared state without communicating. mpidp's own ``DistributedManager(...)``
builds a new manager, a collective: code that calls it on one rank hangs, so PhysicsNeMo code
must import this one.

Named groups (``create_process_subgroup``, ``create_orthogonal_process_group``) are
torch.distributed process groups, as in PhysicsNeMo, each with an MPI communicator beside it so
that mpidp's transport rule (MPI for CPU tensors when MPI runs the job) holds for them too;
:func:`transport_for` turns any group a PhysicsNeMo call passes into mpidp's transport, with
``None`` meaning the world.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import mpidp
from mpidp.comm import TorchTransport, Transport
from mpidp.errors import ConfigError
from mpidp.ops.collectives import resolve_transport

__all__ = [
    "DistributedManager",
    "PhysicsNeMoUndefinedGroupError",
    "PhysicsNeMoUninitializedDistributedManagerWarning",
    "transport_for",
]

_METHODS = ("ENV", "SLURM", "OPENMPI")


class PhysicsNeMoUndefinedGroupError(ConfigError):
    """A process group or mesh axis was queried by a name nobody created."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"cannot query process group {name!r} before it is explicitly created; create it "
            f"with DistributedManager.create_process_subgroup({name!r}, size) (every rank) first"
        )


class PhysicsNeMoUninitializedDistributedManagerWarning(ConfigError, Warning):
    """``DistributedManager()`` before ``DistributedManager.initialize()`` (raised, as in
    PhysicsNeMo)."""

    def __init__(self) -> None:
        super().__init__(
            "DistributedManager() was called before DistributedManager.initialize(); call "
            "DistributedManager.initialize() on every rank once, first"
        )


class _Named:
    """One named group as this rank sees it: every member list, its own process group and MPI
    communicator (None where MPI does not span the job)."""

    def __init__(self, ranks: list[list[int]], group: Any, comm: Any) -> None:
        self.ranks, self.group, self.comm = ranks, group, comm
        self.transports: dict[str, Transport] = {}


def _launch_transport() -> str:
    """``"torch"`` where the launcher started several tasks that MPI does not join (``srun
    --mpi=none``: every task an MPI singleton), which PhysicsNeMo initialises from SLURM's
    variables alone; else mpidp's choice (``"auto"``). Local: the same answer on every task."""
    from mpidp.runtime.bootstrap import detect_launch
    from mpidp.runtime.world import mpi_world

    comm = mpi_world()
    launched = detect_launch(dict(os.environ)).world_size
    return "torch" if launched > 1 and (comm is None or comm.Get_size() == 1) else "auto"


def _mpidp() -> mpidp.DistributedManager:
    """The mpidp manager under the shared state (raises the uninitialised error)."""
    core = DistributedManager._shared_state.get("_core")
    if core is None:
        raise PhysicsNeMoUninitializedDistributedManagerWarning()
    return core


class DistributedManager:
    """PhysicsNeMo's distributed manager: every instance shares one state (Borg).

    Call :meth:`initialize` once on every rank (collective); afterwards ``DistributedManager()``
    anywhere returns the shared state with no communication. Ranks, device and the world come
    from mpidp's manager; named groups and meshes are kept here.
    """

    _shared_state: ClassVar[dict[str, Any]] = {}
    # what each instance sees, through the shared __dict__ (declared for the type checker)
    _groups: dict[str, _Named]
    _global_mesh: DeviceMesh | None
    _mesh_dims: dict[str, int]
    _mesh_groups: dict[int, Any]
    _initialization_method: str
    _broadcast_buffers: bool
    _find_unused_parameters: bool

    def __new__(cls) -> DistributedManager:
        obj = super().__new__(cls)
        obj.__dict__ = cls._shared_state
        return obj

    def __init__(self) -> None:
        if not self._shared_state.get("_is_initialized", False):
            raise PhysicsNeMoUninitializedDistributedManagerWarning()

    # -- set-up -------------------------------------------------------------------------------

    @staticmethod
    def initialize() -> None:
        """Attach the shared state to mpidp (``mpidp.init()`` when not initialised yet).

        mpidp detects the launcher itself (torchrun, SLURM, Open MPI, MPICH, PALS, PMIx);
        ``PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD`` is checked for a valid value and
        otherwise left to that detection. Unlike PhysicsNeMo's, it seeds no RNG and writes no
        environment variable. Collective over the world the first time; a no-op (with
        PhysicsNeMo's warning) after."""
        if DistributedManager.is_initialized():
            warnings.warn("Distributed manager is already initialized", stacklevel=2)
            return
        method = os.environ.get("PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD")
        if method is not None and method not in _METHODS:
            raise ConfigError(
                f"PHYSICSNEMO_DISTRIBUTED_INITIALIZATION_METHOD={method!r} is not one of "
                f"{', '.join(_METHODS)}; unset it to let mpidp detect the launcher"
            )
        owns = not mpidp.is_initialized()
        core = mpidp.init(transport=_launch_transport()) if owns else mpidp.get_manager()
        DistributedManager._attach(core, owns)

    @staticmethod
    def _attach(core: mpidp.DistributedManager, owns: bool) -> None:
        DistributedManager._shared_state.clear()
        DistributedManager._shared_state.update(
            _core=core,
            _owns_core=owns,
            _is_initialized=True,
            _initialization_method=core.launch_info.launcher,
            _broadcast_buffers=False,
            _find_unused_parameters=False,
            _groups={},
            _global_mesh=None,
            _mesh_dims={},
            _mesh_groups={},
        )

    @staticmethod
    def setup(
        rank: int = 0,
        world_size: int = 1,
        local_rank: int | None = None,
        addr: str = "localhost",
        port: str = "12355",
        backend: str = "nccl",
        method: str = "env",
    ) -> None:
        """Initialise through mpidp with ``backend``; mpidp takes the ranks from the launcher,
        so ``rank``/``world_size``/``local_rank`` must agree with it (``addr``/``port``: mpidp
        opens its own rendezvous). Collective over the world."""
        if not DistributedManager.is_initialized():
            owns = not mpidp.is_initialized()
            DistributedManager._attach(
                mpidp.init(backend=backend, transport=_launch_transport())
                if owns
                else mpidp.get_manager(),
                owns,
            )
        core = _mpidp()
        given = (rank, world_size, core.local_rank if local_rank is None else local_rank)
        if given != (core.rank, core.world_size, core.local_rank):
            raise ConfigError(
                f"rank {core.rank}: setup(rank={rank}, world_size={world_size}, local_rank="
                f"{local_rank}) but the launcher says rank {core.rank} of {core.world_size}, "
                f"local rank {core.local_rank}; mpidp takes ranks from the launcher: call "
                f"DistributedManager.initialize() instead"
            )

    @staticmethod
    def initialize_env() -> None:
        """Same as :meth:`initialize` (mpidp detects torchrun's variables itself)."""
        DistributedManager.initialize()

    @staticmethod
    def initialize_open_mpi(addr: str, port: str) -> None:
        """Same as :meth:`initialize` (mpidp detects Open MPI itself; addr/port unused)."""
        DistributedManager.initialize()

    @staticmethod
    def initialize_slurm(port: str) -> None:
        """Same as :meth:`initialize` (mpidp detects SLURM itself; port unused)."""
        DistributedManager.initialize()

    @staticmethod
    def get_available_backend() -> str:
        """``"nccl"`` when CUDA and NCCL are available, else ``"gloo"``."""
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"

    @classmethod
    def is_initialized(cls) -> bool:
        """Whether :meth:`initialize` ran (local)."""
        return bool(cls._shared_state.get("_is_initialized", False))

    @staticmethod
    def cleanup(barrier: bool = False) -> None:
        """Forget the shared state; shut mpidp down too when :meth:`initialize` started it (a
        barrier first when ``barrier``). Collective when it shuts mpidp down."""
        state = DistributedManager._shared_state
        core = state.get("_core")
        for named in state.get("_groups", {}).values():
            if named.comm is not None and named.comm.Get_size() > 1:
                named.comm.Free()
        if core is not None and state.get("_owns_core"):
            core.shutdown(sync=barrier)
        state.clear()

    # -- ranks and device ---------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """Process rank"""
        return _mpidp().rank

    @property
    def local_rank(self) -> int:
        """Process rank on local machine"""
        return _mpidp().local_rank

    @property
    def world_size(self) -> int:
        """Number of processes in distributed environment"""
        return _mpidp().world_size

    @property
    def device(self) -> torch.device:
        """Process device (mpidp's: ``cuda:local_rank`` under NCCL, else ``cpu``)"""
        return _mpidp().device

    @property
    def distributed(self) -> bool:
        """Distributed environment: True once torch.distributed is initialised (mpidp makes a
        process group for one process too)"""
        return dist.is_available() and dist.is_initialized()

    @property
    def cuda(self) -> bool:
        """If cuda is available"""
        return torch.cuda.is_available()

    @property
    def broadcast_buffers(self) -> bool:
        """broadcast_buffers in PyTorch DDP"""
        return bool(self._broadcast_buffers)

    @broadcast_buffers.setter
    def broadcast_buffers(self, broadcast: bool) -> None:
        self._broadcast_buffers = broadcast

    @property
    def find_unused_parameters(self) -> bool:
        """find_unused_parameters in PyTorch DDP"""
        return bool(self._find_unused_parameters)

    @find_unused_parameters.setter
    def find_unused_parameters(self, find_params: bool) -> None:
        if find_params:
            warnings.warn(
                "Setting `find_unused_parameters` in DDP to true, use only if necessary.",
                stacklevel=2,
            )
        self._find_unused_parameters = find_params

    # -- named groups -------------------------------------------------------------------------

    @property
    def group_names(self) -> Any:
        """The names of every named process group created"""
        return self._groups.keys()

    def group(self, name: str | None = None) -> Any:
        """The process group named ``name``; None (the world) for None. Local."""
        if name is None:
            return None
        if name not in self._groups:
            raise PhysicsNeMoUndefinedGroupError(name)
        return self._groups[name].group

    def group_size(self, name: str | None = None) -> int:
        """Ranks in the group named ``name`` (the world for None)."""
        if name is None:
            return self.world_size
        return int(dist.get_world_size(group=self.group(name)))

    def group_rank(self, name: str | None = None) -> int:
        """This rank's rank in the group named ``name`` (the world for None)."""
        if name is None:
            return self.rank
        return int(dist.get_rank(group=self.group(name)))

    def group_name(self, group: Any = None) -> str | None:
        """The name of ``group`` (None for None, the world)."""
        if group is None:
            return None
        for name, named in self._groups.items():
            if named.group is group:
                return str(name)
        raise PhysicsNeMoUndefinedGroupError(repr(group))

    @staticmethod
    def create_process_subgroup(
        name: str, size: int, group_name: str | None = None, verbose: bool = False
    ) -> None:
        """Cut every group of the parent (``group_name``; None: the world) into runs of ``size``
        consecutive members. Collective over the world: every rank makes every subgroup."""
        manager = DistributedManager()
        if name in manager._groups:
            raise ConfigError(f"rank {manager.rank}: group {name!r} already exists")
        parents = (
            manager._groups[group_name].ranks if group_name else [list(range(manager.world_size))]
        )
        if size < 1 or len(parents[0]) % size:
            raise ConfigError(
                f"rank {manager.rank}: cannot divide group size {len(parents[0])} evenly into "
                f"subgroups of size {size}; pass a divisor of {len(parents[0])}"
            )
        ranks = [p[i : i + size] for p in parents for i in range(0, len(p), size)]
        manager._add_group(name, ranks, verbose)

    @staticmethod
    def create_orthogonal_process_group(
        orthogonal_group_name: str, group_name: str, verbose: bool = False
    ) -> None:
        """The groups made of the i-th members of every group of ``group_name``. Collective
        over the world."""
        manager = DistributedManager()
        if group_name not in manager._groups:
            raise ConfigError(f"rank {manager.rank}: group {group_name!r} does not exist")
        if orthogonal_group_name in manager._groups:
            raise ConfigError(
                f"rank {manager.rank}: group {orthogonal_group_name!r} already exists"
            )
        ranks = [list(r) for r in zip(*manager._groups[group_name].ranks, strict=True)]
        manager._add_group(orthogonal_group_name, ranks, verbose)

    def _add_group(self, name: str, ranks: list[list[int]], verbose: bool) -> None:
        mine = next(i for i, r in enumerate(ranks) if self.rank in r)
        group = None
        for r in ranks:  # every rank makes every group, in one order
            made = dist.new_group(ranks=r)
            group = made if self.rank in r else group
        core = _mpidp()
        world = core._world_comm
        comm = None
        if core.mpi_available and world is not None:
            comm = world.Split(color=mine, key=ranks[mine].index(self.rank))
        self._groups[name] = _Named(ranks, group, comm)
        if verbose and self.rank == 0:
            print(f"Process group '{name}':")
            for r in ranks:
                print("    ", r)

    # -- device meshes ------------------------------------------------------------------------

    @property
    def mesh_dims(self) -> dict[str, int]:
        """Mesh dimensions as a dictionary (axis name: size)"""
        return dict(self._mesh_dims)

    def mesh_names(self) -> Any:
        """The mesh axis names"""
        return self._mesh_dims.keys()

    def mesh_sizes(self) -> Any:
        """The mesh axis sizes"""
        return self._mesh_dims.values()

    @property
    def global_mesh(self) -> DeviceMesh:
        """The global mesh; a flat ``("world",)`` mesh is made (collectively) on first use."""
        if self._global_mesh is None:
            return self.initialize_mesh(mesh_shape=(-1,), mesh_dim_names=("world",))
        return self._global_mesh

    def initialize_mesh(
        self, mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...]
    ) -> DeviceMesh:
        """A device mesh over the world; one dimension may be -1. Collective over the world."""
        shape = list(mesh_shape)
        problem = ""
        if not shape or len(shape) != len(mesh_dim_names):
            problem = f"{len(shape)} sizes for {len(mesh_dim_names)} names"
        elif len(set(mesh_dim_names)) != len(mesh_dim_names):
            problem = f"repeated names {tuple(mesh_dim_names)}"
        elif shape.count(-1) > 1:
            problem = "more than one -1"
        else:
            known = int(torch.tensor([s for s in shape if s != -1] or [1]).prod())
            if -1 in shape and known and self.world_size % known == 0:
                shape[shape.index(-1)] = self.world_size // known
            if int(torch.tensor(shape).prod()) != self.world_size:
                problem = f"its sizes multiply to {shape} instead of the world {self.world_size}"
        if problem:
            raise ConfigError(
                f"rank {self.rank}: mesh {tuple(mesh_shape)} named {tuple(mesh_dim_names)}: "
                f"{problem}; give one name per size, sizes multiplying to {self.world_size}"
            )
        self._global_mesh = init_device_mesh(
            self.device.type, tuple(shape), mesh_dim_names=tuple(mesh_dim_names)
        )
        self._mesh_dims = dict(zip(mesh_dim_names, shape, strict=True))
        return self._global_mesh

    def mesh(self, name: str | None = None) -> DeviceMesh:
        """The global mesh (``name`` None) or its axis ``name``; never creates one."""
        if self._global_mesh is None:
            raise PhysicsNeMoUndefinedGroupError("global mesh (call initialize_mesh first)")
        if name is None:
            return self._global_mesh
        if name not in (self._global_mesh.mesh_dim_names or ()):
            raise PhysicsNeMoUndefinedGroupError(f"Mesh axis {name} not defined")
        return self._global_mesh[name]

    def get_mesh_group(self, mesh: DeviceMesh) -> Any:
        """The process group of ``mesh`` (a new one, cached, for a mesh of several dims)."""
        key = hash(mesh)
        if key not in self._mesh_groups:
            if mesh.ndim == 1:
                self._mesh_groups[key] = mesh.get_group()
            else:
                ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
                self._mesh_groups[key] = dist.new_group(ranks=ranks, use_local_synchronization=True)
        return self._mesh_groups[key]

    def __str__(self) -> str:
        return (
            f"Initialized process {self.rank} of {self.world_size} using method "
            f"'{self._initialization_method}'. Device set to {self.device}"
        )


def transport_for(group: Any, device: torch.device | str | None = None) -> Transport:
    """mpidp's transport for a group as PhysicsNeMo code passes it: None is the world (not
    mpidp's domain group); a named group of :class:`DistributedManager` keeps mpidp's rule (MPI
    for CPU tensors when MPI runs the job); any other torch.distributed group goes through
    torch.distributed; whatever else mpidp accepts (a Transport, ``"domain"``...) is mpidp's."""
    core = _mpidp()
    if group is None:
        return core.transport("world", device)
    dev = torch.device(device) if device is not None else core.device
    for named in DistributedManager._shared_state.get("_groups", {}).values():
        if named.group is group:
            return _named_transport(core, named, dev)
    if isinstance(group, dist.ProcessGroup) and group is not dist.group.WORLD:
        return TorchTransport(group, dev)
    return resolve_transport(group, dev)


def _named_transport(core: mpidp.DistributedManager, named: _Named, dev: torch.device) -> Transport:
    kind = core.transport_policy
    if kind == "auto":
        kind = "mpi" if dev.type == "cpu" and named.comm is not None else "torch"
    key = kind + dev.type
    if key not in named.transports:
        if kind == "mpi" and named.comm is not None:
            from mpidp.comm.mpi import MPITransport, deadline_seconds

            timeout = deadline_seconds(core.timeout.total_seconds())
            named.transports[key] = MPITransport(named.comm, timeout=timeout)
        else:
            named.transports[key] = TorchTransport(named.group, dev)
    return named.transports[key]
