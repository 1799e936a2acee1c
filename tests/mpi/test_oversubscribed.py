"""The oversubscription warning: rank 0 only, once per process, only when the node's ranks
outnumber its cores (the core count is monkeypatched, so the verdict does not depend on the
machine). Every rank of these jobs runs on one host, as the suite's mpiexec starts them."""

from __future__ import annotations

import warnings

import pytest
from mpi4py import MPI

import mpidp
import mpidp.runtime.oversubscribed
import mpidp.runtime.world
from mpidp.errors import OversubscribedWarning

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD.Get_size()
RANK = MPI.COMM_WORLD.Get_rank()


def warnings_of_two_managers(monkeypatch, cpus, **env):
    """The OversubscribedWarnings of two managers built one after the other in this process,
    each rank seeing ``cpus(rank)`` as its affinity."""
    monkeypatch.setattr(mpidp.runtime.world, "usable_cpus", lambda: cpus(RANK))
    monkeypatch.setattr(mpidp.runtime.oversubscribed, "_warned_oversubscribed", False)
    monkeypatch.delenv("MPIDP_WARN_OVERSUBSCRIBED", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            with mpidp.init(domain_parallel_size=1):
                pass
    return [str(w.message) for w in seen if issubclass(w.category, OversubscribedWarning)]


def test_more_ranks_than_cores_warns_on_rank_0_once(monkeypatch):
    got = warnings_of_two_managers(monkeypatch, lambda rank: {0})
    if WORLD == 1 or RANK != 0:
        assert got == []
        return
    assert len(got) == 1, got
    assert got[0].startswith(f"rank 0: {WORLD} ranks share 1 core on ")
    for part in (
        "1.24 s at 4 ranks",
        "76 s instead of 19 s",
        "run at most 1 rank per node",
        "MPIDP_WARN_OVERSUBSCRIBED=0",
    ):
        assert part in got[0], got[0]


def test_as_many_cores_as_ranks_is_quiet(monkeypatch):
    assert warnings_of_two_managers(monkeypatch, lambda rank: set(range(WORLD))) == []


def test_cores_of_the_node_are_the_union_of_its_ranks(monkeypatch):
    """A launcher that binds each rank to a core of its own (srun --cpu-bind=cores) leaves each
    rank one CPU; the node still has a core per rank."""
    assert warnings_of_two_managers(monkeypatch, lambda rank: {rank}) == []


def test_the_variable_silences_it(monkeypatch):
    got = warnings_of_two_managers(monkeypatch, lambda rank: {0}, MPIDP_WARN_OVERSUBSCRIBED="0")
    assert got == []
