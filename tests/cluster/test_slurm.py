"""Real launches under a real SLURM (see conftest.py): srun with PMI2 gives mpidp 4 ranks and
the right mesh, the sbatch and srun launchers train, and srun --mpi=none (MPI singletons)
stops with a clear error on every task."""

from __future__ import annotations

import json
import subprocess

from conftest import BIN, ROOT
from test_launch import clean_env

PY = str(BIN / "python")


def run(slurm_env, cmd, timeout=300, **extra):
    env = clean_env(SLURM_CONF=slurm_env["SLURM_CONF"], **extra)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_srun_pmi2_gives_four_ranks_two_by_two(slurm):
    res = run(
        slurm,
        [
            "srun",
            "--mpi=pmi2",
            "-n",
            "4",
            "--overcommit",
            PY,
            "-m",
            "mpidp",
            "info",
            "-d",
            "2",
            "--json",
        ],
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["world_size"] == 4 and doc["mesh"] == {"dp": 2, "domain": 2}
    assert [r["mesh_coords"] for r in doc["ranks"]] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert {r["launcher"] for r in doc["ranks"]} == {"slurm"}
    assert {r["transport"] for r in doc["ranks"]} == {"mpi"}
    assert len({r["pid"] for r in doc["ranks"]}) == 4


def test_srun_launcher_trains_in_an_allocation(slurm, tmp_path):
    res = run(
        slurm,
        [
            "salloc",
            "-n",
            "4",
            "--overcommit",
            "bash",
            "launchers/srun.sh",
            "examples/train.py",
            "--steps",
            "3",
            "--no-plot",
            "--out",
            str(tmp_path),
        ],
        SRUN_FLAGS="--overcommit",
        PYTHON=PY,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert (m["world"], m["dp"], m["domain"], m["launcher"]) == (4, 2, 2, "slurm")
    assert "dp 2 x domain 2" in res.stdout


def test_sbatch_launcher_runs_the_training(slurm, tmp_path):
    out = tmp_path / "job.out"
    res = run(
        slurm,
        [
            "sbatch",
            "--wait",
            "-n",
            "4",
            "--overcommit",
            "-o",
            str(out),
            "launchers/slurm.sbatch",
            "--steps",
            "3",
            "--no-plot",
            "--out",
            str(tmp_path / "run"),
        ],
        timeout=400,
        SRUN_FLAGS="--overcommit",
        PYTHON=PY,
    )
    text = out.read_text() if out.exists() else ""
    assert res.returncode == 0, res.stderr + text[-3000:]
    assert "4 tasks" in text and "dp 2 x domain 2" in text, text[-3000:]
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (m["world"], m["launcher"], m["steps"]) == (4, "slurm", 3)


def test_srun_mpi_none_singletons_are_an_error_on_every_task(slurm):
    res = run(slurm, ["srun", "--mpi=none", "-n", "4", "--overcommit", PY, "-m", "mpidp", "info"])
    assert res.returncode != 0
    for rank in range(4):
        assert f"rank {rank}: srun started 4 tasks (SLURM_NTASKS=4) but MPI" in res.stderr
    assert "--mpi=pmi2" in res.stderr


def test_srun_mpi_none_with_the_torch_transport_forms_one_job(slurm):
    res = run(
        slurm,
        [
            "srun",
            "--mpi=none",
            "-n",
            "2",
            "--overcommit",
            PY,
            "-m",
            "mpidp",
            "info",
            "--json",
            "--transport",
            "torch",
        ],
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout[res.stdout.index("{") :])
    assert doc["world_size"] == 2
    assert {r["launcher"] for r in doc["ranks"]} == {"slurm"}
    assert {r["transport"] for r in doc["ranks"]} == {"torch"}


def test_python_is_this_suites(slurm):
    """The tasks run the environment under test, not whatever python3 is on PATH."""
    res = run(slurm, ["srun", "-n", "1", PY, "-c", "import sys; print(sys.executable)"])
    assert res.returncode == 0 and res.stdout.strip() == PY, res.stderr


def test_physicsnemo_initialize_under_srun_mpi_none_forms_one_job(slurm):
    """PhysicsNeMo initialises from SLURM's variables alone (its env-only path): its
    DistributedManager.initialize() with only the import changed forms one job of the tasks
    srun --mpi=none started, instead of asking for an argument it cannot pass."""
    script = (
        "from mpidp.compat.physicsnemo.distributed import DistributedManager as D\n"
        "import torch, torch.distributed as dist\n"
        "D.initialize(); m = D()\n"
        "t = torch.ones(1) * (m.rank + 1); dist.all_reduce(t)\n"
        "print('task', m.rank, 'of', m.world_size, 'sum', int(t))\n"
        "D.cleanup(barrier=True)\n"
    )
    res = run(slurm, ["srun", "--mpi=none", "-n", "2", "--overcommit", PY, "-c", script])
    assert res.returncode == 0, res.stderr
    lines = sorted(line for line in res.stdout.splitlines() if line.startswith("task"))
    assert lines == ["task 0 of 2 sum 3", "task 1 of 2 sum 3"], res.stdout
