"""Real launches in subprocesses: mpiexec, torchrun, a SLURM-style environment without MPI.

These start their own jobs, so they run outside mpiexec (scripts/test.sh runs them last).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
TIMEOUT = 240
HANGDUMP = Path(__file__).resolve().parent / "hangdump"


def _mpiexec() -> str:
    """The MPI launcher of this environment: $MPIDP_TEST_MPIEXEC, else the environment's own
    mpiexec (the PyPI MPICH), else the first on PATH (a system MPI, as the README documents)."""
    given = os.environ.get("MPIDP_TEST_MPIEXEC")
    found = given or shutil.which("mpiexec", path=str(BIN)) or shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec: set MPIDP_TEST_MPIEXEC or put the MPI's bin on PATH")
    return found


# The name mpidp.runtime.bootstrap gives the launcher of each MPI family (its marker variables).
_LAUNCHER_OF_VENDOR = {
    "MPICH": "mpich",  # Hydra: PMI_RANK
    "Intel MPI": "mpich",  # Hydra
    "MVAPICH": "mpich",
    "MVAPICH2": "mpich",
    "Open MPI": "openmpi",  # OMPI_COMM_WORLD_RANK
}


def _expected_launcher() -> str:
    """What `mpidp info` must report for a job started with MPIEXEC: $MPIDP_TEST_LAUNCHER, else
    the name for the MPI mpi4py was built against (asked in a subprocess, so that this process
    never initialises MPI)."""
    given = os.environ.get("MPIDP_TEST_LAUNCHER")
    if given:
        return given
    code = "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI\n"
    code += "print(MPI.get_vendor()[0])"
    vendor = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    if vendor not in _LAUNCHER_OF_VENDOR:
        raise RuntimeError(
            f"MPI vendor {vendor!r}: set MPIDP_TEST_LAUNCHER to the launcher name `mpidp info` "
            "reports under it (mpich, openmpi, pals, pmix, slurm)"
        )
    return _LAUNCHER_OF_VENDOR[vendor]


MPIEXEC = _mpiexec()
LAUNCHER = _expected_launcher()

# A tiny job: initialise, check an all-reduce through the default transport, print a verdict.
JOB = """
import sys, torch, mpidp
m = mpidp.init(domain_parallel_size=int(sys.argv[1]), transport=sys.argv[2])
total = m.transport("world").all_reduce(torch.ones(1) * m.rank).item()
assert total == m.world_size * (m.world_size - 1) / 2, total
print(f"OK rank={m.rank} size={m.world_size} launcher={m.launch_info.launcher} "
      f"transport={m.transport().name} {m}", flush=True)
m.shutdown()
"""


def clean_env(**extra: str) -> dict[str, str]:
    """This environment minus any launcher variables (the suite itself may run under one)."""
    prefixes = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "PALS_", "SLURM_", "MPIDP_", "HYDRA_")
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}
    env["OMP_NUM_THREADS"] = "1"
    env["MPIDP_TEST_HANG_DUMP"] = "180"  # hangdump/sitecustomize.py: stacks of a stuck job
    env.update(extra)
    paths = [str(HANGDUMP), *filter(None, [env.get("PYTHONPATH")])]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run(cmd: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            cmd, env=clean_env(**extra), capture_output=True, text=True, timeout=TIMEOUT
        )
    except subprocess.TimeoutExpired as exc:
        raise timed_out(exc) from None


def timed_out(exc: subprocess.TimeoutExpired) -> AssertionError:
    """What a job that ran out of time printed, the stacks of hangdump included."""
    out, err = (s.decode() if isinstance(s, bytes) else s or "" for s in (exc.stdout, exc.stderr))
    return AssertionError(
        f"{exc.cmd} timed out after {exc.timeout} s:\n{out[-3000:]}\n{err[-12000:]}"
    )


class Job:
    """A command started at once; :meth:`wait` waits for it. Jobs that leave a core idle (one
    process) run beside another job this way instead of after it. The outputs go to files (a
    pipe nobody reads would stop a job that prints much)."""

    def __init__(self, cmd: list[str], cwd: Path, timeout: int = 400, **env: str) -> None:
        self.cmd, self.timeout = cmd, timeout
        self.files = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            cmd, env=clean_env(**env), stdout=self.files[0], stderr=self.files[1], text=True,
            cwd=cwd,
        )  # fmt: skip
        self.done: subprocess.CompletedProcess[str] | None = None

    def wait(self) -> subprocess.CompletedProcess[str]:
        """The finished job; one over its time is killed and reported with exit status 124,
        what it printed as its stdout and :func:`timed_out`'s message as its stderr."""
        if self.done is None:
            late = False
            try:
                self.proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                late = True
            out, err = self._read()
            code = 124 if late else self.proc.returncode
            if late:
                err = str(timed_out(subprocess.TimeoutExpired(self.cmd, self.timeout, out, err)))
            self.done = subprocess.CompletedProcess(self.cmd, code, out, err)
        return self.done

    def _read(self) -> tuple[str, str]:
        texts = []
        for f in self.files:
            f.seek(0)
            texts.append(f.read())
            f.close()
        return texts[0], texts[1]

    def stop(self) -> None:
        """Ends the job if it still runs (a test that failed before waiting for it)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_info_table_one_process_without_launcher():
    res = run([sys.executable, "-m", "mpidp", "info"])
    assert res.returncode == 0, res.stderr
    assert "mpidp: 1 ranks, mesh dp x domain = 1 x 1" in res.stdout
    assert "single" in res.stdout


def test_explain_simulates_its_ranks_and_prints_the_layouts_and_bytes():
    """``mpidp explain -d 3`` from a shell (no launcher): it simulates 3 ranks in its one
    process (tests/mpi/test_explain.py: the same table as a job of 3 ranks) and prints the table
    once; a refusal exits 1. ``-n``, the spelling of the previous release, still works."""
    res = run([str(BIN / "mpidp"), "explain", "--model", "unet", "--shape", "1x3x29x16", "-d", "3"])
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("mpidp explain: WeatherUNet on (1, 3, 29, 16), 3 ranks") == 1
    assert "inc.0 (PeriodicConv2d)" in res.stdout and "[10, 10, 9]" in res.stdout
    assert "every op has a band form" in res.stdout
    res = run([str(BIN / "mpidp"), "explain", "--shape", "1x3x29x16", "-n", "2", "--json"])
    doc = json.loads(res.stdout)
    assert res.returncode == 0 and doc["ranks"] == 2 and len(doc["sent_per_rank"]) == 2


def test_info_json_one_process():
    res = run([str(BIN / "mpidp"), "info", "--json"])
    assert res.returncode == 0, res.stderr
    assert len(json.loads(res.stdout)["ranks"]) == 1


def test_info_rejects_bad_domain_size_on_every_rank():
    res = run(
        [MPIEXEC, "-n", "3", sys.executable, "-m", "mpi4py", "-m", "mpidp", "info", "-d", "2"]
    )
    assert res.returncode != 0
    for rank in range(3):
        assert f"rank {rank}: world size 3 is not divisible by domain_parallel_size 2" in res.stderr


def test_info_shows_a_grid_of_blocks():
    """``mpidp info -d 2x2``: the domain group as a 2 x 2 grid, each rank's place in it."""
    res = run(
        [MPIEXEC, "-n", "4", sys.executable, "-m", "mpi4py", "-m", "mpidp", "info", "-d", "2x2"]
    )
    assert res.returncode == 0, res.stderr
    assert "1 x 4 (a 2 x 2 grid of latitude x longitude blocks)" in res.stdout
    # the same through the `mpidp` console script under mpiexec (no `python -m mpi4py`)
    res = run([MPIEXEC, "-n", "4", str(BIN / "mpidp"), "info", "-d", "2x2", "--json"])
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["world_size"] == 4 and doc["grid"] == [2, 2]
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3]
    assert [r["grid_coords"] for r in doc["ranks"]] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert {r["launcher"] for r in doc["ranks"]} == {LAUNCHER}
    assert len({r["pid"] for r in doc["ranks"]}) == 4


def test_two_jobs_at_once_do_not_collide():
    """Two jobs started together on one node both initialise (no fixed port), a 2-rank and a
    3-rank one, each a ``python -c`` program under mpiexec that prints the manager."""
    procs = [
        subprocess.Popen(
            [MPIEXEC, "-n", str(n), sys.executable, "-c", JOB, str(n), "auto"],
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (2, 3)
    ]
    for n, proc in zip((2, 3), procs, strict=True):
        out, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err
        assert out.count("OK rank=") == n and "transport=mpi" in out
        assert out.count("DistributedManager(rank=") == n, out


def test_torchrun_without_mpi_rendezvous():
    res = run(
        [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "mpidp",
            "info",
            "--json",
            "-d",
            "2",
        ]
    )
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout[res.stdout.index("{") :])
    assert {r["launcher"] for r in doc["ranks"]} == {"torchrun"}
    assert {r["transport"] for r in doc["ranks"]} == {"torch"}  # MPI does not span the job


def _slurm_task(job: str, r: int) -> subprocess.Popen[str]:
    """Task ``r`` of a 2-task `srun --mpi=none` step of job ``job`` on this node, running JOB
    with transport='torch'."""
    env = dict(
        SLURM_NTASKS="2",
        SLURM_STEP_NODELIST="localhost",
        SLURM_JOB_ID=job,
        SLURM_STEP_ID="0",
        SLURM_STEP_TASKS_PER_NODE="2",
        SLURM_PROCID=str(r),
        SLURM_LOCALID=str(r),
    )
    return subprocess.Popen(
        [sys.executable, "-c", JOB, "1", "torch"],
        env=clean_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_slurm_environment_without_mpi_uses_slurm_rendezvous_when_asked():
    """What `srun --mpi=none -n 2` gives: SLURM variables, MPI singletons. With
    transport='torch' mpidp forms one 2-rank job from SLURM's numbering."""
    job = str(random.randint(10_000, 99_999))
    procs = [_slurm_task(job, r) for r in range(2)]
    done = [(proc, *proc.communicate(timeout=TIMEOUT)) for proc in procs]
    outs = []
    for proc, out, err in done:
        if proc.returncode == -signal.SIGABRT and "terminate called without" in err and "OK" in out:
            # Known, rare (about one full-suite run in four on this machine, not reproduced in
            # isolation): a C++ thread of gloo or the TCPStore aborts at interpreter exit
            # after the job finished and shut down cleanly. Open question (issue 16's note):
            # the test is reported as xfailed, never as passed, whenever it happens.
            pytest.xfail(f"open question: teardown abort after a successful job: {err.strip()}")
        assert proc.returncode == 0, err
        outs.append(out)
    assert "OK rank=0 size=2 launcher=slurm transport=torch" in outs[0]
    assert "OK rank=1 size=2 launcher=slurm transport=torch" in outs[1]


def test_a_job_that_reaches_another_jobs_rendezvous_refuses_to_join():
    """Two `srun --mpi=none` steps whose derived ports collide on one node (issue 19: job J
    step 7 and job J + 1 step 0 used to): a rank of the second job reaches the first job's
    store, sees its token and raises, and the first job completes as one job of its own."""
    from mpidp.runtime.bootstrap import slurm_port

    seen: dict[int, str] = {}
    base = random.randint(100_000, 900_000)
    for j in range(base, base + 100_000):
        port = slurm_port(str(j), "0")
        if port in seen:
            first, second = seen[port], str(j)
            break
        seen[port] = str(j)

    owner = _slurm_task(first, 0)
    stranger = _slurm_task(second, 1)  # its client retries until the first job's store is up
    out, err = stranger.communicate(timeout=TIMEOUT)
    partner = _slurm_task(first, 1)
    results = [(p, *p.communicate(timeout=TIMEOUT)) for p in (owner, partner)]
    assert stranger.returncode != 0 and "LaunchError" in err, err
    want = (
        f"belongs to another job (slurm job {first} step 0 of 2 ranks); this rank is of "
        f"slurm job {second} step 0 of 2 ranks"
    )
    assert want in " ".join(err.split()), err
    for r, (proc, out, err) in enumerate(results):
        if proc.returncode == -signal.SIGABRT and "terminate called without" in err and "OK" in out:
            pytest.xfail(f"open question: teardown abort after a successful job: {err.strip()}")
        assert proc.returncode == 0, err
        assert f"OK rank={r} size=2 launcher=slurm transport=torch" in out


def test_mpi_launcher_but_mpi_sees_one_process_is_an_error():
    """Open MPI's variables with MPICH's mpi4py: the classic wrong-library launch."""
    res = run(
        [sys.executable, "-c", JOB, "1", "auto"], OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2"
    )
    assert res.returncode != 0
    assert (
        "rank 1: openmpi started 2 processes but MPI in this process sees a world of 1"
        in res.stderr
    )
    assert "MPI4PY_LIBMPI" in res.stderr


def test_slurm_singletons_are_an_error_on_every_task():
    """The same environment with the default transport: each task sees MPI's world of 1 while
    SLURM says 2, so it stops with the fix instead of training alone as rank 0."""
    base = dict(SLURM_NTASKS="2", SLURM_STEP_NODELIST="localhost", SLURM_JOB_ID="7")
    for r in range(2):
        res = run([sys.executable, "-c", JOB, "1", "auto"], **base, SLURM_PROCID=str(r))
        assert res.returncode != 0
        assert f"rank {r}: srun started 2 tasks (SLURM_NTASKS=2) but MPI" in res.stderr
        assert "--mpi=pmi2" in res.stderr and "transport='torch'" in res.stderr
