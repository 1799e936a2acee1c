"""Driver: for each case and P in (2, 3), launch harness.py under mpiexec, poll the per-rank
JSON files, kill the job when it hangs, merge into <outdir>/<group>.json.
usage: python run_zoo.py <group: pnm|credit> [case ...] [--P 2,3,2x2] [--timeout 300]"""

import glob
import json
import math
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the mpidp checkout (bench/zoo/..)
VENVS = os.environ.get("MPIDP_ZOO_VENVS", "/tmp/mpidp-zoo")  # setup.sh's environments
args = sys.argv[1:]
group = args.pop(0)
Ps, timeout = [2, 3], 300
if "--P" in args:
    i = args.index("--P")
    Ps = args[i + 1].split(",")  # N ranks of bands or LATxLON blocks (2x2)
    del args[i : i + 2]
if "--timeout" in args:
    i = args.index("--timeout")
    timeout = int(args[i + 1])
    del args[i : i + 2]
venv = os.path.join(VENVS, group)
outdir = os.path.join(VENVS, "out", group)
os.makedirs(outdir, exist_ok=True)
sys.path.insert(0, HERE)
env = dict(
    os.environ,
    OMP_NUM_THREADS="1",
    MPIR_CVAR_ENABLE_HEAVY_YIELD="1",
    PYTHONPATH=f"{ROOT}:{HERE}",
    ZOO_GROUP=group,
    PYTHONWARNINGS="ignore",
)
if not args:
    out = subprocess.run(
        [f"{venv}/bin/python", "-c", f"import cases_{group} as c; print(' '.join(c.CASES))"],
        env=env,
        capture_output=True,
        text=True,
    )
    args = out.stdout.split()
    if not args:
        print(out.stderr)
        sys.exit(1)
merged_path = os.path.join(VENVS, "out", f"{group}.json")
merged = json.load(open(merged_path)) if os.path.exists(merged_path) else {}
for case in args:
    for P in map(str, Ps):
        n_ranks = math.prod(int(k) for k in P.split("x"))  # "2x2": 4 ranks
        for f in glob.glob(f"{outdir}/{case}_P{P}_r*.json"):
            os.remove(f)
        t0 = time.time()
        log = open(f"{outdir}/{case}_P{P}.log", "w")
        proc = subprocess.Popen(
            [
                f"{venv}/bin/mpiexec",
                "-n",
                str(n_ranks),
                f"{venv}/bin/python",
                "-m",
                "mpi4py",
                os.path.join(HERE, "harness.py"),
                case,
                outdir,
            ],
            env=dict(env, ZOO_DOMAIN=P),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=HERE,
        )
        first_file, killed = None, None
        while proc.poll() is None:
            time.sleep(1)
            n = len(glob.glob(f"{outdir}/{case}_P{P}_r*.json"))
            if n and first_file is None:
                first_file = time.time()
            if n == n_ranks and time.time() - first_file > 10:
                killed = "all ranks reported; job did not exit"
            elif n and time.time() - first_file > 60:
                killed = f"only {n}/{n_ranks} ranks reported within 60 s of the first (others hung)"
            elif time.time() - t0 > timeout:
                killed = f"timeout {timeout}s"
            if killed:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
        ranks = []
        for r in range(n_ranks):
            f = f"{outdir}/{case}_P{P}_r{r}.json"
            ranks.append(
                json.load(open(f)) if os.path.exists(f) else {"rank": r, "status": "no report"}
            )
        statuses = [r.get("status") for r in ranks]
        order = ["crash", "refused", "mismatch", "no report", "match"]
        overall = next(s for s in order if s in statuses)
        rep = next(r for r in ranks if r.get("status") == overall)
        entry = {
            "status": overall,
            "rank_statuses": statuses,
            "wall_seconds": round(time.time() - t0, 1),
            "killed": killed,
            "report": rep,
            "max_rel_err": max((r.get("max_rel_err", 0) for r in ranks), default=None),
        }
        if overall == "no report":
            entry["log_tail"] = open(f"{outdir}/{case}_P{P}.log").read().splitlines()[-15:]
        merged[f"{case}|P{P}"] = entry
        json.dump(merged, open(merged_path, "w"), indent=1)
        print(
            f"{case:24s} P={P} {overall:9s} {entry['wall_seconds']:6.1f}s "
            f"{(rep.get('message_first_line') or rep.get('max_rel_err') or '')!s:.200}",
            flush=True,
        )
