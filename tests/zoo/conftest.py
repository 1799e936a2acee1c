"""The zoo runs under ``mpiexec -n P``: only the first rank reports (one summary, not P). A
failure on any rank is still printed when it happens (tests/conftest.py), and every rank's exit
status counts."""

from __future__ import annotations

import pytest
from mpi4py import MPI


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    if MPI.COMM_WORLD.Get_rank() != 0:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)
