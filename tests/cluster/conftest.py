"""A real single-node SLURM on loopback for the launcher tests: munge, slurmctld and slurmd
started with a generated slurm.conf (about 20 s), stopped by pid afterwards.

Needs root and the Debian packages that scripts/setup-launch.sh installs. When they are
missing the tests fail with that message; they are never skipped.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SBIN = ("/usr/sbin", "/usr/bin")
sys.path.insert(0, str(ROOT / "tests" / "launch"))

CONF = """\
ClusterName=mpidp
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={port}
SlurmdPort={dport}
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmdSpoolDir={d}/spool
StateSaveLocation={d}/state
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def _tool(name: str) -> str:
    for d in SBIN:
        if os.access(f"{d}/{name}", os.X_OK):
            return f"{d}/{name}"
    pytest.fail(
        f"{name} is not installed: the real-launcher tests need SLURM and munge; run "
        f"bash scripts/setup-launch.sh (root, apt-get) first",
        pytrace=False,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _munge_works() -> bool:
    try:
        enc = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        dec = subprocess.run(["unmunge"], input=enc.stdout, capture_output=True, timeout=10)
        return enc.returncode == 0 and dec.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """The environment (SLURM_CONF, PATH) under which srun/sbatch reach the test cluster."""
    if os.geteuid() != 0:
        pytest.fail("a test SLURM needs root (slurmd runs the tasks as root)", pytrace=False)
    tools = {n: _tool(n) for n in ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo")}
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("spool", "state"):
        (d / sub).mkdir()
    host = socket.gethostname()
    conf = d / "slurm.conf"
    conf.write_text(
        CONF.format(host=host, d=d, port=_free_port(), dport=_free_port(), cpus=os.cpu_count() or 2)
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs: list[subprocess.Popen] = []
    started_munge = not _munge_works()
    if started_munge:
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        procs.append(
            subprocess.Popen(
                ["runuser", "-u", "munge", "--", tools["munged"], "--foreground"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        deadline = time.time() + 20
        while not _munge_works():
            if time.time() > deadline:
                pytest.fail("munged did not start within 20 s", pytrace=False)
            time.sleep(0.2)
    log = open(d / "daemons.out", "w")
    for daemon in ("slurmctld", "slurmd"):
        procs.append(subprocess.Popen([tools[daemon], "-D"], env=env, stdout=log, stderr=log))
    try:
        deadline = time.time() + 60
        state = ""
        while time.time() < deadline:
            res = subprocess.run(
                [tools["sinfo"], "-h", "-o", "%t"], env=env, capture_output=True, text=True
            )
            state = res.stdout.strip()
            if state.startswith("idle"):
                break
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.5)
        else:
            state = state or "no answer"
        if not state.startswith("idle"):
            logs = "".join(
                f"\n--- {name}\n" + (d / name).read_text()[-2000:]
                for name in ("slurmctld.log", "slurmd.log", "daemons.out")
                if (d / name).exists()
            )
            pytest.fail(f"the test SLURM did not come up (node state {state!r}){logs}")
        yield env
    finally:
        for p in reversed(procs):  # by pid, never by name: other daemons may run here
            p.terminate()
        pidfile = Path("/run/munge/munged.pid")
        if started_munge and pidfile.exists():  # runuser may not pass the signal on
            try:
                os.kill(int(pidfile.read_text().split()[0]), 15)
            except (OSError, ValueError):
                pass
        for p in reversed(procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
