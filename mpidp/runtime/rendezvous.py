"""How the processes of a job join torch.distributed: through a store rank 0 opens on a port the
OS picks (MPI runs the job: its address travels in one broadcast), torchrun's own environment,
or a port derived from the job (SLURM without MPI), each rank first checking that the address
resolves and that the store belongs to its own job."""

from __future__ import annotations

import dataclasses
import datetime
import socket
from typing import Any

import torch
import torch.distributed as dist

from mpidp.errors import BackendError, LaunchError
from mpidp.runtime.bootstrap import LaunchInfo

__all__ = ["Rendezvous", "init_process_group"]


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Who joins: ``rank`` of ``world_size``, started by ``launch``, on ``host``."""

    rank: int
    world_size: int
    launch: LaunchInfo
    host: str
    timeout: datetime.timedelta

    def check_address(self, addr: str | None, port: str | None) -> None:
        """Every rank resolves the rendezvous address itself before joining, so an address
        that does not resolve is an error on every rank at once (rank 0's store would
        otherwise wait the whole timeout for ranks that can never reach it, with no word of
        why)."""
        if not addr:
            return
        try:
            socket.getaddrinfo(addr, None)
        except OSError as exc:
            raise LaunchError(
                f"rank {self.rank} of {self.world_size} ({self.launch.launcher}): "
                f"MASTER_ADDR={addr!r} (MASTER_PORT={port!r}) does not resolve on {self.host} "
                f"({exc}); every rank must reach rank 0 there: set MASTER_ADDR to rank 0's host "
                f"name or IP address"
            ) from None

    def job_store(self, addr: str, port: int, env: dict[str, str]) -> dist.Store:
        """The rendezvous at a port derived from the job (SLURM without MPI), which a job that
        got the same port may also reach: rank 0 writes this job's token, every other rank
        checks it before joining, so a stranger raises instead of mixing two trainings."""
        job = env.get("SLURM_JOB_ID", env.get("SLURM_JOBID", "?"))
        step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "?"))
        token = f"{self.launch.launcher} job {job} step {step} of {self.world_size} ranks"
        self.check_address(addr, str(port))
        try:
            store = dist.TCPStore(
                addr,
                port,
                self.world_size,
                self.rank == 0,
                timeout=self.timeout,
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as exc:
            raise LaunchError(
                f"rank {self.rank} ({token}): cannot open the rendezvous at {addr}:{port}: "
                f"{exc}; another job may hold that port: launch with srun --mpi=pmi2 (no port "
                f"needed) or set MASTER_PORT"
            ) from None
        key = "mpidp/job-token"
        if self.rank == 0:
            store.set(key, token)
        else:
            store.wait([key], self.timeout)
            theirs = store.get(key).decode()
            if theirs != token:
                raise LaunchError(
                    f"rank {self.rank}: the rendezvous at {addr}:{port} belongs to another job "
                    f"({theirs}); this rank is of {token}. Two jobs on one node got the same "
                    f"port: nothing was joined; launch with srun --mpi=pmi2 or set MASTER_PORT"
                )
        return store

    def mpi_store(self, comm: Any, env: dict[str, str]) -> dist.Store:
        """Rank 0 opens a store on a port the OS picks and broadcasts where it is over
        ``comm``: nothing to export, and two jobs on one node never collide."""
        store, where, error = None, None, None
        if self.rank == 0:
            try:
                addr = env.get("MPIDP_MASTER_ADDR") or socket.gethostname()
                store = dist.TCPStore(
                    "0.0.0.0",
                    0,
                    self.world_size,
                    True,
                    timeout=self.timeout,
                    wait_for_workers=False,
                )
                where = (addr, store.port)
            except (OSError, RuntimeError) as exc:
                error = f"rank 0 could not open a rendezvous port: {exc}"
        where, error = comm.bcast((where, error), root=0)
        if error:
            raise BackendError(
                f"rank {self.rank}: {error}; set MPIDP_MASTER_ADDR to a reachable address"
            )
        if store is None:
            store = dist.TCPStore(where[0], where[1], self.world_size, False, timeout=self.timeout)
        return store


def init_process_group(
    who: Rendezvous,
    backend: str,
    device: torch.device,
    env: dict[str, str],
    mpi_comm: Any = None,
) -> dist.Store | None:
    """Join torch.distributed with ``backend`` on ``device``; ``mpi_comm``: the world
    communicator when MPI runs the job (the store's address travels over it). Returns the store
    made here (None under torchrun's own rendezvous)."""
    kwargs: dict[str, Any] = dict(
        backend=backend, rank=who.rank, world_size=who.world_size, timeout=who.timeout
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if backend == "nccl":  # a bound gloo group breaks torch 2.11's DeviceMesh (split_group
            kwargs["device_id"] = device  # deep-copies gloo's options, which cannot be copied)
    if who.world_size == 1:
        kwargs["store"] = dist.HashStore()
    elif mpi_comm is not None:
        kwargs["store"] = who.mpi_store(mpi_comm, env)
    elif who.launch.launcher == "torchrun":
        who.check_address(env.get("MASTER_ADDR"), env.get("MASTER_PORT"))
        kwargs["init_method"] = "env://"
    else:
        addr, port = who.launch.master_addr, who.launch.master_port
        if addr is None or port is None:
            raise LaunchError(
                f"rank {who.rank}: {who.launch.launcher} started {who.world_size} processes "
                f"without MPI and without a rendezvous address; launch with mpiexec, "
                f"srun --mpi=pmi2 or torchrun"
            )
        kwargs["store"] = who.job_store(addr, port, env)
    try:
        dist.init_process_group(**kwargs)
    except (RuntimeError, OSError, ValueError) as exc:
        where = (
            f"MASTER_ADDR={env.get('MASTER_ADDR')!r} MASTER_PORT={env.get('MASTER_PORT')!r}"
            if "init_method" in kwargs
            else "its rendezvous store"
        )
        fix = (
            f"two ranks of this job chose one GPU ({device}): NCCL needs a GPU of its own per "
            f"rank; start at most {torch.cuda.device_count()} rank(s) per node (one per "
            f"visible GPU), give each rank its own CUDA_VISIBLE_DEVICES, or pass "
            f"backend='gloo' to run several ranks on one GPU"
            if "Duplicate GPU" in str(exc)
            else "check that the address is rank 0's host and reachable from this node, and "
            "that the port is free"
        )
        raise LaunchError(
            f"rank {who.rank} of {who.world_size} ({who.launch.launcher}): "
            f"torch.distributed ({backend}) could not start through {where}: "
            f"{type(exc).__name__}: {exc}; {fix}"
        ) from None
    return kwargs.get("store")
