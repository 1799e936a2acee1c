"""The MPI world as a manager finds it: whether mpi4py loads an MPI, which library it is, the
CPUs a node's ranks may run on, and the rank numbering, where MPI is the truth when it sees
more than one process (decision 1) and a launcher that disagrees with it is refused.

Pure facts and one collective (:func:`resolve_ranks`, over the world when MPI spans the job);
:class:`~mpidp.runtime.manager.DistributedManager` builds its layout from them.
"""

from __future__ import annotations

import os
from typing import Any

from mpidp.errors import LaunchError
from mpidp.runtime.bootstrap import LaunchInfo

__all__ = ["mpi_library", "mpi_world", "install_alarm", "resolve_ranks", "usable_cpus"]

MPI_LAUNCHERS = ("openmpi", "mpich", "pals", "pmix")


def mpi_world() -> Any:
    """``MPI.COMM_WORLD``, or None when mpi4py or an MPI library cannot be loaded."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError):
        return None
    return MPI.COMM_WORLD


def install_alarm(world: Any) -> None:
    """Every rank hears of an error that ends another and of calls out of step
    (:mod:`mpidp.comm.alarm`). Once per process; collective over the world the first time."""
    from mpidp.comm import alarm
    from mpidp.comm.deadline import start_watchdog

    alarm.install(world, start_watchdog)


def usable_cpus() -> set[int]:
    """The CPUs this process may run on: its affinity, or every CPU where there is none."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return set(range(os.cpu_count() or 1))


def mpi_library() -> str:
    from mpi4py import MPI

    return MPI.Get_library_version().strip().splitlines()[0].strip()


def _shared_type() -> int:
    from mpi4py import MPI

    return int(MPI.COMM_TYPE_SHARED)


def resolve_ranks(info: LaunchInfo, comm: Any, transport_policy: str) -> tuple[LaunchInfo, int]:
    """This rank's numbering and its node's core count: MPI's when ``comm`` (the world, or
    None) sees more than one process, else the launcher's ``info``. Collective over ``comm``
    then (the node's ranks pool their CPUs)."""
    node_cores = len(usable_cpus())
    if comm is not None and comm.Get_size() > 1:
        if (
            info.world_size > 1
            and info.launcher != "torchrun"
            and info.world_size != comm.Get_size()
        ):
            raise LaunchError(
                f"rank {comm.Get_rank()}: launcher {info.launcher} reports {info.world_size} "
                f"processes but MPI sees {comm.Get_size()}; unset stale launcher variables "
                f"or set MPIDP_LAUNCHER"
            )
        local = comm.Split_type(_shared_type())
        try:
            # the node's ranks together: a launcher that binds each rank to its own cores
            # (srun --cpu-bind) leaves every rank one core, but the node is not oversubscribed
            node_cores = len(set().union(*local.allgather(sorted(usable_cpus()))))
            return LaunchInfo(
                launcher=info.launcher if info.world_size > 1 else "mpi",
                rank=comm.Get_rank(),
                world_size=comm.Get_size(),
                local_rank=local.Get_rank(),
                local_world_size=local.Get_size(),
                host=info.host,
                job_id=info.job_id,
                nodelist=info.nodelist,
            ), node_cores
        finally:
            local.Free()
    if (
        info.world_size > 1
        and info.launcher == "slurm"
        and comm is not None
        and transport_policy != "torch"
    ):
        raise LaunchError(
            f"rank {info.rank}: srun started {info.world_size} tasks (SLURM_NTASKS="
            f"{info.world_size}) but MPI in this process sees a world of 1: srun --mpi=none "
            f"(or MpiDefault=none) starts every task as an MPI singleton; launch with "
            f"srun --mpi=pmi2 (MPICH) or --mpi=pmix (Open MPI), or pass transport='torch' "
            f"(mpidp info --transport torch) to run without MPI"
        )
    if info.world_size > 1 and info.launcher in MPI_LAUNCHERS:
        library = mpi_library() if comm is not None else "no MPI library could be loaded"
        raise LaunchError(
            f"rank {info.rank}: {info.launcher} started {info.world_size} processes but MPI in "
            f"this process sees a world of 1 ({library}): mpi4py loaded another MPI than the "
            f"launcher's; launch with that library's mpiexec or point MPI4PY_LIBMPI at the "
            f"launcher's libmpi"
        )
    return info, node_cores
