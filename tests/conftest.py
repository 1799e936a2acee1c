"""Shared by every test stage: a failure is printed the moment it happens, not only in the
summary, so a stage that a timeout kills later still shows what failed and why."""

from __future__ import annotations

import sys

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        print(f"\n!!! FAILED {report.nodeid} ({report.when})", file=sys.__stderr__)
        print(report.longreprtext[-6000:], file=sys.__stderr__, flush=True)
