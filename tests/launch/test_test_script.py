"""The README's test command on a machine too slow for its limits: scripts/test.sh run for
real (the quick tier without its MPI stage) with a limit of 10 s, which the unit stage overruns.
Each killed stage says so in one line (the stage, the last test it started, the limit and the
variable that lengthens it), the summary marks it KILLED and names it again, and the suite
ends FAILED. The zoo stage's pytest under mpiexec prints one summary, not one per rank. And the
MPI tests' harness (tests/mpi/conftest.py) ends a job whose ranks disagree on a test: a rank
that failed while its peers wait in a collective aborts the job after its verdict timeout."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
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


def test_the_mpi_harness_ends_a_job_whose_ranks_are_out_of_step(tmp_path):
    """The real tests/mpi/conftest.py beside a test in which rank 1 fails before a barrier that
    rank 0 waits in: rank 1 waits for rank 0's verdict for MPIDP_VERDICT_TIMEOUT seconds (3),
    then prints its failure and aborts the job; a red run, never a hang."""
    for name in ("conftest.py", "helpers.py"):
        shutil.copy(ROOT / "tests" / "mpi" / name, tmp_path / name)
    (tmp_path / "test_stuck.py").write_text(
        "from mpi4py import MPI\n\n\ndef test_stuck():\n"
        "    if MPI.COMM_WORLD.Get_rank() == 1:\n"
        "        raise AssertionError('rank 1 fails before the barrier')\n"
        "    MPI.COMM_WORLD.Barrier()\n"
    )
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "pytest", "-q", "--with-mpi"]
    t0 = time.monotonic()
    res = subprocess.run(
        [*cmd, "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, env=clean_env(MPIDP_VERDICT_TIMEOUT="3", PYTHONPATH=str(ROOT)),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    assert "[rank 1] test_stuck.py::test_stuck: outcome 2, peers did not reach the verdict " \
        "within 3 s (stuck in a collective); aborting the job" in out, out[-3000:]  # fmt: skip
    assert "rank 1 fails before the barrier" in out
    assert time.monotonic() - t0 < 90  # the timeout, not the subprocess limit, ended it
