"""The deadline of a kept ``all_gather_v`` (issue 47): a repeated two-rank call arms a slot the
watchdog registered once (:class:`mpidp.comm.deadline.Armed`) instead of registering its wait,
and a peer that never comes must still end the job at the deadline, naming the call."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from test_launch import MPIEXEC, clean_env

ROOT = Path(__file__).resolve().parents[2]

# Two calls of one key (the second is kept), then rank 1 sleeps and rank 0 calls a third time:
# mpidp.all_gather_v's kept call and the transport's own kept plan; MPIDP_TIMEOUT=2
JOB = """
import sys, time, torch, mpidp
m = mpidp.init(domain_parallel_size=2)
x = torch.ones(8, 4)
for _ in range(2):
    mpidp.all_gather_v(x, [8, 8], 0, m)
if m.rank == 0:
    print(f"rank 0 enters at {time.time():.2f}", flush=True)
    if sys.argv[1] == "kept":
        mpidp.all_gather_v(x, [8, 8], 0, m)
    else:
        t = m.transport()
        t.all_gather_v(x, [8, 8])
        t.all_gather_v(x, [8, 8])
time.sleep(60)
"""


def test_a_peer_that_never_comes_to_a_kept_call_ends_the_job_at_the_deadline():
    """Rank 0's kept call (and, in a second job, the transport's kept plan) waits for rank 1,
    which sleeps 60 s: the deadline (2 s) aborts the job within seconds, naming the call."""
    for how in ("kept", "transport"):
        res = subprocess.run(
            [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", "-c", JOB, how],
            env=clean_env(PYTHONPATH=str(ROOT), MPIDP_TIMEOUT="2"),
            capture_output=True,
            text=True,
            timeout=240,
            cwd=ROOT,
        )
        out = res.stdout + res.stderr
        assert res.returncode != 0 and re.search(r"rank 0 enters at [\d.]+", out), out
        found = re.search(r"mpidp CommTimeout: (.*?)(?:\n\n|\Z)", out, re.S)
        assert found, out
        msg = " ".join(found.group(1).split())
        assert msg.startswith("rank 0 of 2 (MPI group of 2): all_gather_v did not complete"), msg
        waited = float(re.search(r"after ([\d.]+) s \(deadline 2 s\)", msg).group(1))
        assert 2 <= waited < 4, msg
