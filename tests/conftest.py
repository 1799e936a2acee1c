"""Shared by every test stage: a failure is printed the moment it happens, not only in the
summary, so a stage that a timeout kills later still shows what failed and why; and the test
each stage starts is written where scripts/test.sh reads it when a stage is killed by its
limit (``MPIDP_TEST_LAST``; by the first rank of an MPI run). And once the tests are collected,
what exists then (torch, mpidp, the test modules and items: alive to the end) is frozen out of
the cyclic collector, so that its collections walk only what the tests make: every
DistributedManager's shutdown runs one (``gc.collect()``, for DDP's cycles), and with the
whole heap walked they were about a quarter of the CPU of MPI test files that make managers
(the 1-rank MPI stage: 96 shutdowns, 21.0 of 61.7 s of CPU; frozen 2.9 of 46.2 s).
Nothing a test makes is frozen: it is collected as before."""

from __future__ import annotations

import gc
import os
import sys

import pytest

_LAST = os.environ.get("MPIDP_TEST_LAST")
_FIRST = all(os.environ.get(v, "0") == "0" for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK"))


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    if _LAST and _FIRST:
        with open(_LAST, "w") as f:
            f.write(nodeid + "\n")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        print(f"\n!!! FAILED {report.nodeid} ({report.when})", file=sys.__stderr__)
        print(report.longreprtext[-6000:], file=sys.__stderr__, flush=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()
