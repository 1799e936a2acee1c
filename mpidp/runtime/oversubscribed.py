"""The warning a node with more ranks than cores gets: what was found, its measured cost, and
the fixes not yet in effect. Rank 0 warns once per process, however many managers it builds;
``MPIDP_WARN_OVERSUBSCRIBED=0`` silences it where oversubscribing is on purpose."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from mpidp.errors import OversubscribedWarning
from mpidp.runtime.world import mpi_library

__all__ = ["oversubscribed_message", "warn_if_oversubscribed"]

_warned_oversubscribed = False  # rank 0 warns once per process, however many managers it builds


def warn_if_oversubscribed(
    rank: int, host: str, ranks: int, cores: int, world: Any, env: dict[str, str], stacklevel: int
) -> None:
    """Rank 0 warns once per process when its node runs ``ranks`` ranks on ``cores`` cores
    (``world``: the MPI world, or None; ``stacklevel``: the warning's, counted from this
    function's caller)."""
    global _warned_oversubscribed
    if rank != 0 or ranks <= cores or _warned_oversubscribed:
        return
    if env.get("MPIDP_WARN_OVERSUBSCRIBED", "1") == "0":
        return
    _warned_oversubscribed = True
    mpich = world is not None and "MPICH" in mpi_library()
    text = oversubscribed_message(host, ranks, cores, torch.get_num_threads(), mpich, env)
    warnings.warn(text, OversubscribedWarning, stacklevel=stacklevel + 1)


def oversubscribed_message(
    host: str, ranks: int, cores: int, threads: int, mpich: bool, env: dict[str, str]
) -> str:
    """The oversubscription warning: what was found, its measured cost, and the fixes not yet
    in effect (``threads``: torch threads per rank; ``mpich``: the MPI library is MPICH)."""
    settings, done = [], []
    if threads > 1:
        settings.append(f"OMP_NUM_THREADS=1 (each rank runs {threads} torch threads now)")
    else:
        done.append("one torch thread per rank")
    if mpich and env.get("MPIR_CVAR_ENABLE_HEAVY_YIELD") != "1":
        settings.append(
            "MPIR_CVAR_ENABLE_HEAVY_YIELD=1 (MPICH's waiting ranks then sleep instead of "
            "polling at 100% CPU)"
        )
    elif mpich:
        done.append("MPIR_CVAR_ENABLE_HEAVY_YIELD=1")
    fix = f"run at most {cores} rank{'s' if cores != 1 else ''} per node"
    if settings:
        fix += f", or set {' and '.join(settings)}"
    if done:
        fix += f". Already in effect: {', '.join(done)}"
    return (
        f"rank 0: {ranks} ranks share {cores} core{'s' if cores != 1 else ''} on {host}: they "
        f"take turns on the cores, so steps are slower than with fewer ranks (measured on "
        f"2 cores: a U-Net training step at 721 x 1440 took 1.24 s at 4 ranks and 0.98 s at 2, "
        f"docs/benchmarks.md; MPICH's polling ranks made a 4-rank FSDP2 training take 76 s "
        f"instead of 19 s, docs/launching.md). Fix: {fix}. Timings of this run measure "
        f"time-sharing. MPIDP_WARN_OVERSUBSCRIBED=0 silences this warning where "
        f"oversubscribing is on purpose."
    )
