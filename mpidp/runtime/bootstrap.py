"""Launcher detection: environment mapping -> :class:`LaunchInfo`.

Pure: :func:`detect_launch` reads a mapping and returns a value; it never touches the real
environment, the network or MPI, so every launcher is testable with plain dicts.

Precedence, first match wins:

1. ``MPIDP_LAUNCHER`` forces one source (``torchrun``, ``openmpi``, ``mpich``, ``pals``,
   ``pmix``, ``slurm``, ``single``); its variables must then be present.
2. torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``): it starts the processes itself, also
   when it runs under srun or mpirun, so its numbering is the one that describes the world.
3. MPI launchers, which start one process per rank: Open MPI (``OMPI_COMM_WORLD_*``),
   Cray PALS (``PALS_RANKID``), MPICH Hydra / Intel MPI (``PMI_RANK``, ``PMI_SIZE``),
   PMIx (``PMIX_RANK``).
4. SLURM srun (``SLURM_PROCID``, ``SLURM_NTASKS``).
5. a single process.

MPI launchers come before SLURM because ``mpirun``/``mpiexec`` inside ``sbatch`` leaves the
batch step's ``SLURM_PROCID=0`` in every rank. ``srun --mpi=pmi2`` (or ``pmix``) exports
``PMI_RANK`` (``PMIX_RANK``) too; when those agree with SLURM's numbering and no launcher
specific local-rank variable is present, the launcher is reported as ``slurm``.
"""

from __future__ import annotations

import dataclasses
import functools
import socket
import zlib
from collections.abc import Callable, Mapping
from typing import NamedTuple

import hostlist

from mpidp.errors import LaunchError

__all__ = ["LaunchInfo", "LAUNCHERS", "detect_launch", "expand_nodelist", "slurm_port"]

LAUNCHERS = ("torchrun", "openmpi", "pals", "mpich", "pmix", "slurm", "single")
OVERRIDE_VAR = "MPIDP_LAUNCHER"

# Ports derived from a SLURM job id fall in [_PORT_BASE, _PORT_BASE + _PORT_SPAN): above the
# well-known range and below Linux's default ephemeral range (32768-60999).
_PORT_BASE = 12000
_PORT_SPAN = 20000


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """What the launcher says about this process.

    ``master_addr``/``master_port`` are set only when the environment provides a rendezvous
    (torchrun's ``MASTER_*``; for SLURM the first node and a port derived from the job id).
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    host: str
    master_addr: str | None = None
    master_port: int | None = None
    job_id: str | None = None
    nodelist: tuple[str, ...] = ()

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def __repr__(self) -> str:
        rdv = f", master={self.master_addr}:{self.master_port}" if self.master_addr else ""
        job = f", job_id={self.job_id}" if self.job_id else ""
        return (
            f"LaunchInfo({self.launcher}, rank={self.rank}/{self.world_size}, "
            f"local_rank={self.local_rank}/{self.local_world_size}, host={self.host}{rdv}{job})"
        )


def _int(env: Mapping[str, str], name: str) -> int:
    text = env[name].strip()
    if not text.lstrip("-").isdigit():
        raise LaunchError(f"{name}={env[name]!r} is not an integer; unset it or fix the launcher")
    return int(text)


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for name in names:
        if name in env:
            return name
    return None


def expand_nodelist(nodelist: str) -> tuple[str, ...]:
    """Expand a SLURM node list such as ``nid[001-004,010]`` (python-hostlist)."""
    try:
        return tuple(hostlist.expand_hostlist(nodelist))
    except hostlist.BadHostlist as exc:
        raise LaunchError(f"cannot expand SLURM node list {nodelist!r}: {exc}") from None


def _expand_tasks_per_node(text: str) -> list[int]:
    """``2(x3),1`` -> ``[2, 2, 2, 1]`` (SLURM's compressed tasks-per-node format)."""
    counts: list[int] = []
    for item in text.split(","):
        count, sep, rep = item.partition("(x")
        closed = rep.endswith(")")
        rep = rep[:-1] if closed else rep
        if not count.isdigit() or (sep and not (closed and rep.isdigit())):
            raise LaunchError(f"cannot read SLURM tasks per node {text!r}; expected e.g. '2(x3),1'")
        counts.extend([int(count)] * (int(rep) if rep else 1))
    return counts


def slurm_port(job_id: str, step_id: str | None = None) -> int:
    """A rendezvous port that is the same on every task of one SLURM step: a hash of the job
    and step ids (not a linear mix: ``job * 7 + step`` gave job J step 7 and job J + 1 step 0
    one port). Two steps can still share a port by chance (1 in 20000); the job token checked
    at join (DistributedManager) turns that into an error instead of one mixed job."""
    step = step_id if step_id is not None else "0"
    return _PORT_BASE + zlib.crc32(f"{job_id}.{step}".encode()) % _PORT_SPAN


def _torchrun(env: Mapping[str, str], host: str) -> LaunchInfo:
    world = _int(env, "WORLD_SIZE")
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
    return LaunchInfo(
        launcher="torchrun",
        rank=_int(env, "RANK"),
        world_size=world,
        local_rank=_int(env, "LOCAL_RANK"),
        local_world_size=_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world,
        host=host,
        master_addr=env.get("MASTER_ADDR"),
        master_port=port,
        job_id=env.get("TORCHELASTIC_RUN_ID"),
    )


class _MpiVars(NamedTuple):
    """Where one MPI launcher keeps a rank's numbers: the rank's variable, and for the world
    size, the node-local rank and size and the job id the variables to try, first found wins."""

    rank: str
    size: tuple[str, ...]
    local_rank: tuple[str, ...]
    local_size: tuple[str, ...]
    job: tuple[str, ...]


_MPI_VARS = {
    "openmpi": _MpiVars(
        "OMPI_COMM_WORLD_RANK",
        ("OMPI_COMM_WORLD_SIZE",),
        ("OMPI_COMM_WORLD_LOCAL_RANK",),
        ("OMPI_COMM_WORLD_LOCAL_SIZE",),
        ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"),
    ),
    "pals": _MpiVars(
        "PALS_RANKID",
        ("PALS_SIZE", "PMI_SIZE"),
        ("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"),
        ("PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE"),
        ("PALS_APID", "PBS_JOBID"),
    ),
    "mpich": _MpiVars(
        "PMI_RANK",
        ("PMI_SIZE",),
        ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
        ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"),
        ("PMI_JOBID", "PBS_JOBID"),
    ),
    "pmix": _MpiVars(
        "PMIX_RANK",
        ("PMIX_SIZE", "OMPI_COMM_WORLD_SIZE"),
        ("PMIX_LOCAL_RANK",),
        ("PMIX_LOCAL_SIZE",),
        ("PMIX_NAMESPACE",),
    ),
}


def _mpi_like(launcher: str, env: Mapping[str, str], host: str) -> LaunchInfo:
    v = _MPI_VARS[launcher]
    size_var = _first(env, v.size)
    if size_var is None:
        raise LaunchError(
            f"{v.rank} is set but none of {', '.join(v.size)} is: cannot tell the world "
            f"size; launch with a supported launcher or set {OVERRIDE_VAR}"
        )
    world = _int(env, size_var)
    lr_var = _first(env, v.local_rank)
    ls_var = _first(env, v.local_size)
    job_var = _first(env, v.job)
    # Without local variables assume one node: the manager replaces both with MPI's answer.
    return LaunchInfo(
        launcher=launcher,
        rank=_int(env, v.rank),
        world_size=world,
        local_rank=_int(env, lr_var) if lr_var else _int(env, v.rank),
        local_world_size=_int(env, ls_var) if ls_var else world,
        host=host,
        job_id=env[job_var] if job_var else None,
    )


def _slurm(env: Mapping[str, str], host: str) -> LaunchInfo:
    size_var = _first(env, ("SLURM_NTASKS", "SLURM_NPROCS"))
    if size_var is None:
        raise LaunchError(
            "SLURM_PROCID is set but SLURM_NTASKS is not: run the program with srun inside the "
            "allocation, or set MPIDP_LAUNCHER=single for one process"
        )
    world = _int(env, size_var)
    nodes_var = _first(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    nodes = expand_nodelist(env[nodes_var]) if nodes_var else ()
    tasks_var = _first(env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    local_world = world
    if tasks_var is not None:
        per_node = _expand_tasks_per_node(env[tasks_var])
        node_index = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        if node_index < len(per_node):
            local_world = per_node[node_index]
    job_id = env.get("SLURM_JOB_ID", env.get("SLURM_JOBID"))
    step_id = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return LaunchInfo(
        launcher="slurm",
        rank=_int(env, "SLURM_PROCID"),
        world_size=world,
        local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
        local_world_size=local_world,
        host=host,
        # an exported MASTER_ADDR / MASTER_PORT (a common sbatch idiom) wins over the derived
        master_addr=env.get("MASTER_ADDR") or (nodes[0] if nodes else None),
        master_port=(
            _int(env, "MASTER_PORT")
            if "MASTER_PORT" in env
            else (slurm_port(job_id, step_id) if job_id and nodes else None)
        ),
        job_id=job_id,
        nodelist=nodes,
    )


def _single(env: Mapping[str, str], host: str) -> LaunchInfo:
    return LaunchInfo("single", 0, 1, 0, 1, host)


_READERS: dict[str, Callable[[Mapping[str, str], str], LaunchInfo]] = {
    "torchrun": _torchrun,
    **{name: functools.partial(_mpi_like, name) for name in _MPI_VARS},
    "slurm": _slurm,
    "single": _single,
}

# The variables whose presence selects a launcher, in precedence order.
_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK")),
    *((name, (v.rank,)) for name, v in _MPI_VARS.items()),
    ("slurm", ("SLURM_PROCID",)),
)

# Local-rank variables that only a non-SLURM MPI launcher sets: their presence means the
# process was started by that launcher even when SLURM variables agree by coincidence.
_OWN_LOCAL_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PALS_LOCAL_RANKID")


def _select(env: Mapping[str, str]) -> str:
    forced = env.get(OVERRIDE_VAR, "").strip().lower()
    if forced:
        if forced not in _READERS:
            raise LaunchError(
                f"{OVERRIDE_VAR}={env[OVERRIDE_VAR]!r} is not a launcher; use one of "
                f"{', '.join(LAUNCHERS)}"
            )
        needed = dict(_MARKERS).get(forced, ())
        missing = [name for name in needed if name not in env]
        if missing:
            raise LaunchError(
                f"{OVERRIDE_VAR}={forced} but {', '.join(missing)} is not set; "
                f"unset {OVERRIDE_VAR} or launch with {forced}"
            )
        return forced
    for name, needed in _MARKERS:
        if all(var in env for var in needed):
            return name
    return "single"


def _srun_agrees(env: Mapping[str, str], name: str) -> bool:
    """True when srun itself started this MPI process (``--mpi=pmi2``/``pmix``): SLURM's
    numbering equals the PMI one and no other launcher's local-rank variable is present."""
    if "SLURM_PROCID" not in env or any(var in env for var in _OWN_LOCAL_VARS):
        return False
    rank_var, size_var = ("PMI_RANK", "PMI_SIZE") if name == "mpich" else ("PMIX_RANK", "PMIX_SIZE")
    size = env.get("SLURM_NTASKS", env.get("SLURM_NPROCS"))
    return env[rank_var] == env["SLURM_PROCID"] and env.get(size_var, size) == size


def _check(info: LaunchInfo) -> LaunchInfo:
    where = f"launcher {info.launcher}"
    if info.world_size < 1:
        raise LaunchError(f"{where}: world size {info.world_size} < 1; fix the launcher command")
    if not 0 <= info.rank < info.world_size:
        raise LaunchError(
            f"{where}: rank {info.rank} is outside [0, {info.world_size}); the environment "
            f"mixes two launches: unset stale variables or set {OVERRIDE_VAR}"
        )
    if not 0 <= info.local_rank < max(info.local_world_size, 1):
        raise LaunchError(
            f"{where}: rank {info.rank}: local rank {info.local_rank} is outside "
            f"[0, {info.local_world_size}); fix the launcher's local variables"
        )
    if info.local_world_size > info.world_size:
        raise LaunchError(
            f"{where}: rank {info.rank}: local world size {info.local_world_size} > world size "
            f"{info.world_size}; fix the launcher's local variables"
        )
    return info


def detect_launch(env: Mapping[str, str], host: str | None = None) -> LaunchInfo:
    """Describe this process from a launcher environment.

    Parameters
    ----------
    env:
        The environment, e.g. ``os.environ`` or a plain dict in tests.
    host:
        This machine's host name; defaults to :func:`socket.gethostname`.

    Raises
    ------
    LaunchError
        When variables are missing, not integers, or inconsistent (rank >= size).
    """
    host = host if host is not None else socket.gethostname()
    name = _select(env)
    if name in ("mpich", "pmix") and OVERRIDE_VAR not in env and _srun_agrees(env, name):
        name = "slurm"
    return _check(_READERS[name](env, host))
