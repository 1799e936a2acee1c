"""DistributedManager: torch.distributed + MPI, the device, and the dp x domain mesh.

Created once per process by :func:`init` (or ``DistributedManager.initialize``) and passed
around; :func:`get_manager` returns the one current default, and explicit arguments always win.
The manager never seeds RNGs and never writes environment variables.

The steps of its construction live beside it: what the ranks must agree on
(:mod:`~mpidp.runtime.agree`), the MPI world and the rank numbering
(:mod:`~mpidp.runtime.world`), the backend and device (:mod:`~mpidp.runtime.device`) and the
oversubscription warning (:mod:`~mpidp.runtime.oversubscribed`).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mpidp.comm import Transport
from mpidp.errors import BackendError, ConfigError
from mpidp.runtime.agree import agree, same_everywhere
from mpidp.runtime.bootstrap import detect_launch
from mpidp.runtime.device import BACKENDS, choose_device
from mpidp.runtime.grid import AXES, BlockSpec, GridAxes, axis_transport, block_spec, grid_shape
from mpidp.runtime.groups import destroy_groups, group_references, release_groups
from mpidp.runtime.oversubscribed import oversubscribed_message as oversubscribed_message
from mpidp.runtime.oversubscribed import warn_if_oversubscribed
from mpidp.runtime.partition import Balanced, PartitionPolicy, ShardSpec
from mpidp.runtime.rebalance import set_partition
from mpidp.runtime.rendezvous import Rendezvous, init_process_group
from mpidp.runtime.transports import built_transport
from mpidp.runtime.world import install_alarm, mpi_library, mpi_world, resolve_ranks

__all__ = ["DistributedManager", "Neighbors", "init", "get_manager", "is_initialized"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
TRANSPORTS = ("auto", "mpi", "torch")

_default: DistributedManager | None = None


class Neighbors(NamedTuple):
    """Global ranks of the domain neighbours; None beyond an edge of a non-periodic domain."""

    before: int | None
    after: int | None


def _as_timeout(timeout: float | datetime.timedelta) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        return timeout
    if timeout <= 0:
        raise ConfigError(f"timeout {timeout} s must be positive")
    return datetime.timedelta(seconds=float(timeout))


class DistributedManager:
    """The distributed state of one process: ranks, device, groups and communicators.

    Rank layout: ``rank = dp_rank * domain_world_size + domain_rank``; the domain dimension is
    innermost, so a domain group is a run of consecutive ranks (normally one node).

    Parameters
    ----------
    domain_parallel_size:
        Ranks that share one sample (P). The world must be a multiple of it; dp = world / P.
        A pair ``(P_lat, P_lon)`` makes the domain group a grid of latitude x longitude
        blocks (:mod:`mpidp.runtime.grid`; P = P_lat * P_lon); an int is bands, ``(P, 1)``.
    backend:
        ``"nccl"``, ``"gloo"`` or ``"mpi"``; default NCCL when CUDA is available, else gloo.
    shard_dim:
        The tensor dimension cut into bands (latitude: -2 of (B, C, H, W)).
    timeout:
        Seconds (or a timedelta) for the rendezvous and torch.distributed collectives.
    device:
        Overrides the device; default ``cuda:(local_rank mod visible devices)`` under NCCL,
        else ``cpu``.
    transport:
        ``"auto"`` (MPI for CPU tensors when MPI runs the job, torch.distributed otherwise),
        ``"mpi"`` or ``"torch"``.
    env:
        The launcher environment; default ``os.environ``. Read, never written.
    partition:
        The partition policy that cuts every length over the domain group
        (default :class:`~mpidp.runtime.partition.Balanced`); see :meth:`spec`.

    Collective over the world: every rank must construct it with the same arguments.
    """

    #: the gradient convention of plain tensors used on bands (mpidp.runtime.adopt): this rank's
    #: share
    gradients = "shares"
    #: the grid cuts the longitude (P_lon > 1): band code refuses (runtime.grid.blocks_refused)
    _blocks = False
    #: converted convolutions (on bands and blocks) compute their interior while the halo
    #: travels (forward and backward; :mod:`mpidp.ops.halo_overlap`); set it alike on every
    #: rank (one that differs is refused at the layer's first halo agreement)
    overlap = False

    def __init__(
        self,
        domain_parallel_size: int | tuple[int, int] = 1,
        backend: str | None = None,
        shard_dim: int = -2,
        timeout: float | datetime.timedelta = DEFAULT_TIMEOUT,
        device: str | torch.device | None = None,
        transport: str = "auto",
        env: dict[str, str] | None = None,
        partition: PartitionPolicy | None = None,
    ) -> None:
        self.partition: PartitionPolicy = partition if partition is not None else Balanced()
        self._args = (
            domain_parallel_size,
            backend,
            shard_dim,
            timeout,
            device,
            transport,
            self.partition,
        )
        self.timeout = _as_timeout(timeout)
        self.shard_dim = shard_dim
        self.transport_policy = transport
        env = dict(os.environ) if env is None else env
        self._world_comm = mpi_world()
        me = f"rank {self._world_comm.Get_rank()}: " if self._world_comm is not None else ""
        if transport not in TRANSPORTS:
            raise ConfigError(
                f"{me}transport {transport!r} is not one of {', '.join(TRANSPORTS)}; pass one "
                f"of those to mpidp.init(transport=...)"
            )
        if backend is not None and backend not in BACKENDS:
            raise ConfigError(
                f"{me}backend {backend!r} is not one of {', '.join(BACKENDS)}; pass one of "
                f"those, or None to let mpidp choose (nccl for CUDA, gloo otherwise)"
            )
        # what every rank must pass alike: checked before anything is built from it
        self._facts = {
            "domain_parallel_size": domain_parallel_size,
            "backend": backend,
            "shard_dim": shard_dim,
            "transport": transport,
            "partition": repr(self.partition),
            "timeout": self.timeout.total_seconds(),
            "MPIDP_DEBUG": env.get("MPIDP_DEBUG", ""),
            "MPIDP_TIMEOUT": env.get("MPIDP_TIMEOUT", ""),
        }
        if self._mpi_runs_job():
            assert self._world_comm is not None
            install_alarm(self._world_comm)
            same_everywhere(self._world_comm.allgather(self._facts), self._world_comm.Get_rank())
        self.launch_info = agree(self._world_comm, detect_launch, env)
        info, self._node_cores = resolve_ranks(
            self.launch_info, self._world_comm, self.transport_policy
        )
        self.rank, self.world_size = info.rank, info.world_size
        self.local_rank, self.local_world_size = info.local_rank, info.local_world_size
        self.host = info.host
        self._grid = grid_shape(domain_parallel_size, self.world_size, self.rank)
        self.domain_world_size = self._grid[0] * self._grid[1]
        self._blocks = self._grid[1] > 1
        self.dp_world_size = self.world_size // self.domain_world_size
        self.dp_rank, self.domain_rank = divmod(self.rank, self.domain_world_size)
        first = self.dp_rank * self.domain_world_size
        #: the global ranks of this rank's domain group, in domain-rank order
        self.domain_ranks = tuple(range(first, first + self.domain_world_size))
        self.backend, self.device = agree(
            self._world_comm, choose_device, self.rank, self.local_rank, backend, device
        )
        if transport == "mpi" and self._world_comm is None:
            raise BackendError(f"rank {self.rank}: transport='mpi' but mpi4py cannot load an MPI")
        self._owns_process_group = not dist.is_initialized()
        if self._owns_process_group:
            self._init_process_group(env)
        else:
            self._adopt_process_group()
        if not self._mpi_runs_job() and self.world_size > 1:  # torchrun, srun --mpi=none
            table: list[Any] = [None] * self.world_size
            dist.all_gather_object(table, self._facts)
            same_everywhere(table, self.rank)
        self.mesh: DeviceMesh = init_device_mesh(
            self.device.type,
            (self.dp_world_size, self.domain_world_size),
            mesh_dim_names=("dp", "domain"),
        )
        self.domain_group = self.mesh.get_group("domain")
        self.data_parallel_group = self.mesh.get_group("dp")
        self.domain_comm, self.dp_comm = self._split_comms()
        self._transports: dict[tuple[str, str], Transport] = {}
        #: :meth:`transport`'s answers by its arguments (a group named by None or its name)
        self._by_args: dict[tuple[Any, ...], Transport] = {}
        self._on_shutdown: list[Callable[[], None]] = []  # e.g. ParallelMesh.close
        self._closed = False
        self._grid_axes = GridAxes.build(self)
        if self._grid_axes is not None:
            self._on_shutdown.append(self._grid_axes.close)
        self._group_references = group_references(self._groups())
        self._warn_if_oversubscribed(env)

    # -- construction steps -------------------------------------------------------------------

    def _mpi_runs_job(self) -> bool:
        return self._world_comm is not None and self._world_comm.Get_size() > 1

    def _warn_if_oversubscribed(self, env: dict[str, str]) -> None:
        """Rank 0 warns once per process when its node runs more ranks than it has cores."""
        ranks, cores, world = self.local_world_size, self._node_cores, self._world_comm
        level = _caller_level()
        warn_if_oversubscribed(self.rank, self.host, ranks, cores, world, env, level)

    def _init_process_group(self, env: dict[str, str]) -> None:
        who = Rendezvous(self.rank, self.world_size, self.launch_info, self.host, self.timeout)
        comm = self._world_comm if self._mpi_runs_job() else None
        # the store is kept for an ordered teardown (shutdown)
        self._store = init_process_group(who, self.backend, self.device, env, comm)

    def _adopt_process_group(self) -> None:
        rank, size = dist.get_rank(), dist.get_world_size()
        if (rank, size) != (self.rank, self.world_size):
            raise ConfigError(
                f"rank {self.rank}: torch.distributed is already initialised as rank {rank} of "
                f"{size}, but the launcher says rank {self.rank} of {self.world_size}; let mpidp "
                f"initialise it or initialise it with the launcher's numbering"
            )
        self.backend = dist.get_backend()

    def _split_comms(self) -> tuple[Any, Any]:
        if not self._mpi_runs_job():
            if self._world_comm is None:
                return None, None
            from mpi4py import MPI

            # One process, or a job MPI does not span (torchrun): only COMM_SELF is meaningful.
            if self.world_size == 1:
                return MPI.COMM_SELF, MPI.COMM_SELF
            return None, None
        comm = self._world_comm
        domain = comm.Split(color=self.dp_rank, key=self.domain_rank)
        dp = comm.Split(color=self.domain_rank, key=self.dp_rank)
        return domain, dp

    # -- public API ---------------------------------------------------------------------------

    @staticmethod
    def world_from_launcher(env: dict[str, str] | None = None) -> int:
        """World size without initialising anything: MPI's when it spans the job, else the
        launcher's."""
        comm = mpi_world()
        if comm is not None and comm.Get_size() > 1:
            return int(comm.Get_size())
        return detect_launch(dict(os.environ) if env is None else env).world_size

    @classmethod
    def initialize(cls, **kwargs: Any) -> DistributedManager:
        """Same as :func:`mpidp.init`."""
        return init(**kwargs)

    @property
    def is_first_domain_rank(self) -> bool:
        return self.domain_rank == 0

    @property
    def is_last_domain_rank(self) -> bool:
        return self.domain_rank == self.domain_world_size - 1

    @property
    def grid(self) -> tuple[int, int]:
        """``(P_lat, P_lon)``: the domain group as a grid of blocks; bands are ``(P, 1)``."""
        return getattr(self, "_grid", (self.domain_world_size, 1))

    @property
    def grid_coords(self) -> tuple[int, int]:
        """``(i_lat, i_lon)``: this rank's place in the grid (domain rank = i_lat * P_lon +
        i_lon); its latitude column is ``transport("lat")``, its longitude row
        ``transport("lon")``."""
        i_lat, i_lon = divmod(self.domain_rank, self.grid[1])
        return i_lat, i_lon

    @property
    def domain_mesh(self) -> DeviceMesh:
        """The 1-D device mesh of this rank's domain group."""
        return self.mesh["domain"]

    @property
    def mpi_available(self) -> bool:
        """True when MPI communicators span this job (the MPI transport can be used)."""
        return self.domain_comm is not None

    def neighbor_ranks(self, periodic: bool = False) -> Neighbors:
        """Global ranks of the domain ranks before and after this one (None at an edge unless
        ``periodic``)."""
        base, p = self.dp_rank * self.domain_world_size, self.domain_world_size
        before = self.domain_rank - 1 if self.domain_rank > 0 else (p - 1 if periodic else None)
        after = self.domain_rank + 1 if self.domain_rank < p - 1 else (0 if periodic else None)
        return Neighbors(
            None if before is None else base + before, None if after is None else base + after
        )

    def spec(self, n: int) -> ShardSpec:
        """The partition of a length ``n`` over the domain group, by this manager's policy."""
        try:
            return self.partition.spec(n, self.domain_world_size)
        except ConfigError as err:
            raise ConfigError(f"rank {self.rank}: {err}") from None

    def set_partition(self, policy: PartitionPolicy, rows: int | None = None) -> None:
        """Cut every length by ``policy`` from now on (call it between steps; see
        :mod:`mpidp.runtime.rebalance`). Collective over the domain group: every rank passes
        the same policy, which must cut ``rows`` (the input's length) when given; otherwise the
        same ConfigError everywhere and the partition is unchanged."""
        set_partition(self, policy, rows)

    def block_spec(self, shape: Sequence[int], dims: Sequence[int] = (-2, -1)) -> BlockSpec:
        """The blocks of a tensor of global ``shape``: its ``dims`` (latitude, longitude) cut
        by this manager's policy over :attr:`grid` (bands: the longitude over one rank)."""
        extents = [shape[d] for d in dims]
        return block_spec(self.partition, extents, self.grid, dims, self.rank)

    def _group_key(self, group: Any) -> str:
        if isinstance(group, str) and group in AXES:
            return group
        if group is None or group == "domain" or group is self.domain_group:
            return "domain"
        if group in ("dp", "data_parallel") or group is self.data_parallel_group:
            return "dp"
        if group == "world" or group is dist.group.WORLD:
            return "world"
        raise ConfigError(
            f"rank {self.rank}: unknown group {group!r}; pass manager.domain_group, "
            f"manager.data_parallel_group, 'domain', 'dp', 'world', 'lat' or 'lon'"
        )

    def transport(self, group: Any = None, device: str | torch.device | None = None) -> Transport:
        """The transport for tensors on ``device`` (default: this manager's device) over
        ``group`` (default: the domain group).

        Rule: CUDA tensors go through torch.distributed; CPU tensors through MPI when MPI spans
        the job, unless ``transport`` was forced at construction.
        """
        # (a torch.device by its fields: dynamo, tracing a compiled model through here, cannot
        # name a device object in its guards)
        args = (
            (group, device.type, device.index)
            if isinstance(device, torch.device)
            else (group, device)
        )
        try:
            made = self._by_args.get(args)
        except TypeError:  # an unhashable group: resolved below, not kept
            made = None
        if made is not None:
            return made
        key = self._group_key(group)
        if key in AXES:  # the latitude column or longitude row of a grid
            made = axis_transport(self, key, device)
        else:
            dev = torch.device(device) if device is not None else self.device
            made = built_transport(
                self,
                key,
                dev,
                # the manager's own CPU transport (not a counting wrapper a caller installed)
                cpu=lambda: DistributedManager.transport(self, group, "cpu"),
                mpi_comm=lambda: self._mpi_comm_of(key),
                torch_group=lambda: self._torch_group_of(key),
            )
        if (group is None or type(group) is str) and self._transports:  # (not once shut down)
            self._by_args[args] = made
        return made

    def _mpi_comm_of(self, key: str) -> Any:
        comm = {"domain": self.domain_comm, "dp": self.dp_comm}.get(key)
        if comm is not None:
            return comm
        from mpi4py import MPI

        return MPI.COMM_WORLD if self._mpi_runs_job() else MPI.COMM_SELF

    def _torch_group_of(self, key: str) -> Any:
        group = {"domain": self.domain_group, "dp": self.data_parallel_group}.get(key)
        return group if group is not None else dist.group.WORLD

    def _remember(self, key: tuple[str, str], made: Transport) -> Transport:
        self._transports[key] = made
        return made

    def describe(self) -> dict[str, Any]:
        """This rank's facts as plain data (what ``mpidp info`` prints)."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "local_world_size": self.local_world_size,
            "host": self.host,
            "pid": os.getpid(),
            "launcher": self.launch_info.launcher,
            "device": str(self.device),
            "backend": self.backend,
            "transport": self.transport().name,
            "mpi_library": mpi_library() if self._world_comm is not None else None,
            "torch": torch.__version__,
            "mesh_shape": [self.dp_world_size, self.domain_world_size],
            "mesh_coords": [self.dp_rank, self.domain_rank],
            "grid": list(self.grid),
            "grid_coords": list(self.grid_coords),
            "dp_rank": self.dp_rank,
            "domain_rank": self.domain_rank,
        }

    def _groups(self) -> list[Any]:
        """The process groups that a model wrapped over this manager (DDP, FSDP2) may hold:
        the domain and data-parallel groups, and the default group when this manager made it
        (their references are counted at construction and again at shutdown)."""
        found: list[Any] = [self.domain_group, self.data_parallel_group]
        if self._owns_process_group and dist.is_initialized():
            found.append(dist.group.WORLD)
        return found

    def shutdown(self, sync: bool = True) -> None:
        """Free the communicators and, if this manager created it, the process group.

        Collective (a barrier first) unless ``sync`` is False, as when leaving a ``with`` block
        on an exception, where peers may never arrive."""
        global _default
        if self._closed:
            return
        self._closed = True
        for close in reversed(self._on_shutdown):
            close()
        self._on_shutdown.clear()
        for comm in {id(c): c for c in (self.domain_comm, self.dp_comm) if c is not None}.values():
            if self._mpi_runs_job():
                comm.Free()
        self._transports.clear()
        self._by_args.clear()

        def destroy() -> None:
            if not self._owns_process_group and dist.is_initialized():
                # The mesh's groups are this manager's; the default group (and with it every
                # group) is torn down by whoever created it. Local: no communication.
                destroy_groups(self.mesh)

        # the cyclic collector, only when something took one of the groups (mpidp.runtime.groups)
        release_groups(self._group_references, self._groups(), destroy)
        if self._owns_process_group and dist.is_initialized():
            # Every rank arrives before any tears down: a rank that destroys the group (rank 0
            # takes the rendezvous store with it) while a peer still uses it can abort the peer
            # ("terminate called without an active exception", seen with gloo under SLURM).
            store = getattr(self, "_store", None)
            if sync and self.world_size > 1:
                dist.barrier()
            if sync and self.world_size > 1 and isinstance(store, dist.TCPStore):
                # Rank 0 serves the rendezvous store: it tears down last, once every peer
                # has torn its group down and said so through the store.
                done = [f"mpidp/closed/{r}" for r in range(1, self.world_size)]
                if self.rank == 0:
                    store.wait(done, self.timeout)
                    dist.destroy_process_group()
                else:
                    dist.destroy_process_group()
                    store.set(f"mpidp/closed/{self.rank}", "1")
            else:
                dist.destroy_process_group()
        if _default is self:
            _default = None

    def __enter__(self) -> DistributedManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown(sync=exc[0] is None)

    def __deepcopy__(self, memo: dict[int, Any]) -> DistributedManager:
        """The manager itself: it is a handle on this process's communicators, so a deep copy
        of a converted model (an EMA copy, a dry run) shares it instead of failing to copy
        the process group's store."""
        return self

    def __repr__(self) -> str:
        return (
            f"DistributedManager(rank={self.rank}/{self.world_size}, local_rank={self.local_rank}, "
            f"launcher={self.launch_info.launcher}, backend={self.backend}, device={self.device}, "
            f"mesh=(dp={self.dp_world_size}, domain={self.domain_world_size}), "
            f"dp_rank={self.dp_rank}, domain_rank={self.domain_rank}, "
            f"transport={self.transport_policy})"
        )


def _caller_level() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside this module (the
    user's ``mpidp.init`` or ``DistributedManager`` line)."""
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        level, frame = level + 1, frame.f_back
    return level


def init(
    domain_parallel_size: int | tuple[int, int] = 1,
    backend: str | None = None,
    shard_dim: int = -2,
    timeout: float | datetime.timedelta = DEFAULT_TIMEOUT,
    device: str | torch.device | None = None,
    transport: str = "auto",
    partition: PartitionPolicy | None = None,
) -> DistributedManager:
    """Initialise mpidp and return the default :class:`DistributedManager`.

    Collective over the world. Calling it again with the same arguments returns the same
    manager; with different arguments it raises :class:`ConfigError` (shut the first one down
    before building another layout).
    """
    global _default
    partition = partition if partition is not None else Balanced()
    args = (domain_parallel_size, backend, shard_dim, timeout, device, transport, partition)
    if _default is not None:
        if _default._args != args:
            raise ConfigError(
                f"rank {_default.rank} of {_default.world_size}: mpidp is already initialised with "
                f"{_describe_args(_default._args)}; called again with {_describe_args(args)}: "
                f"call get_manager().shutdown() first or pass the same arguments"
            )
        return _default
    _default = DistributedManager(
        domain_parallel_size=domain_parallel_size,
        backend=backend,
        shard_dim=shard_dim,
        timeout=timeout,
        device=device,
        transport=transport,
        partition=partition,
    )
    return _default


def _describe_args(args: tuple[Any, ...]) -> str:
    names = (
        "domain_parallel_size",
        "backend",
        "shard_dim",
        "timeout",
        "device",
        "transport",
        "partition",
    )
    return ", ".join(f"{n}={v!r}" for n, v in zip(names, args, strict=False))


#: managers made for meshes (mpidp.parallel.build_device_mesh) besides the default one, so
#: that a mesh's domain group finds its manager (mpidp.runtime.adopt.manager_for)
MESH_MANAGERS: list[DistributedManager] = []


#: the manager of the rank a dry run simulates in this process (:func:`simulating`)
_simulated: contextvars.ContextVar[DistributedManager | None] = contextvars.ContextVar(
    "mpidp_simulated_manager", default=None
)


@contextlib.contextmanager
def simulating(manager: DistributedManager) -> Iterator[None]:
    """Inside this block :func:`get_manager` answers ``manager``: the rank that
    :func:`mpidp.preflight.explain.simulate` runs in this process, so that layers and user code
    that look up the default manager see the simulated one. Local."""
    token = _simulated.set(manager)
    try:
        yield
    finally:
        _simulated.reset(token)


def bound(manager: DistributedManager | None) -> DistributedManager:
    """The manager of a converted layer or model bound to ``manager`` (None: the default one);
    inside :func:`simulating`, the simulated rank's, whatever it was bound to (the dry run of a
    model converted for a real job simulates other ranks than this one)."""
    simulated = _simulated.get()
    if simulated is not None:
        return simulated
    return manager if manager is not None else get_manager()


def get_manager() -> DistributedManager:
    """The default manager (the one :func:`init` created); inside :func:`simulating`, the
    simulated rank's."""
    simulated = _simulated.get()
    if simulated is not None:
        return simulated
    if _default is None:
        raise ConfigError(
            "mpidp is not initialised: call mpidp.init(domain_parallel_size=...) first"
        )
    return _default


def is_initialized() -> bool:
    return _default is not None
