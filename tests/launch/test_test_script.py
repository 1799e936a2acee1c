"""The README's test command on a machine too slow for its limits: scripts/test.sh run for
real (the quick tier without its MPI stage) with a limit of 10 s, which the unit stage overruns.
Each killed stage says so in one line (the stage, the last test it started, the limit and the
variable that lengthens it), the summary marks it KILLED and names it again, and the suite
ends FAILED. And the zoo stage's pytest under mpiexec prints one summary, not one per rank."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from test_launch import MPIEXEC, clean_env

ROOT = Path(__file__).resolve().parents[2]


def test_a_stage_over_its_limit_says_so_and_the_summary_marks_it_killed():
    env = clean_env(MPIDP_TEST_TIMEOUT="10", MPIDP_TEST_RANKS="none")  # no MPI stage to wait for
    res = subprocess.run(
        ["bash", "scripts/test.sh", "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-3000:]
    line = re.search(r"^!!! stage 'unit tests' KILLED at its limit of 10 s .*$", out, re.M)
    assert line, out[-3000:]
    assert "1 x MPIDP_TEST_TIMEOUT=10" in line.group(0)
    assert re.search(r"the last test it started: (tests/unit/\S+|none \(still starting\))", line[0])
    assert "MPIDP_TEST_TIMEOUT=20 bash scripts/test.sh" in line.group(0)
    assert re.search(r"^ +\d+ s +\d+ cpu-s  KILLED  unit tests$", out, re.M), out[-2000:]
    assert re.search(r"^stages that did not pass:\n(  .*\n)*  KILLED: unit tests$", out, re.M)
    assert "quick tier: FAILED" in out


def test_the_zoo_under_mpiexec_reports_once():
    """tests/zoo as scripts/test-zoo.sh runs it, at 2 ranks, here without the third-party
    packages (every case skips): rank 0's summary alone."""
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "pytest", "-q", "-rs"]
    res = subprocess.run(
        [*cmd, "-p", "no:cacheprovider", "tests/zoo"],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert len(re.findall(r"^\d+ (passed|skipped)", out, re.M)) == 1, out[-3000:]
