"""ShardedTensor vs converted layers: the U-Net training step, interleaved runs.

    python bench/sharded.py --json docs/bench/sharded.json

The same WeatherUNet step as bench/unet.py (721 x 1440, float32, one thread per rank), at
P = 2 and 4, two rounds each, alternating: "mpidp" is the converted model on a plain band,
"sharded" the unchanged serial model fed a ShardedTensor (its layers learn no partition, its
halo exchanges agree once). Reports the median step of each run, the ratio sharded / mpidp
per round, and the collectives one step sends (calls per primitive, from a counted step).
Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--grid", type=int, nargs=2, default=[721, 1440])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    rows = []
    for ranks in (2, 4):
        for r in range(args.rounds):
            for mode in ("mpidp", "sharded") if r % 2 == 0 else ("sharded", "mpidp"):
                cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py"]
                cmd += [str(HERE / "unet.py"), "--worker", "--mode", mode, "--grid"]
                cmd += [*map(str, args.grid), "--steps", str(args.steps)]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
                if out.returncode != 0:
                    raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append({**row, "round": r})
    print(f"U-Net step {tuple(args.grid)}, float32, 1 thread per rank, median of {args.steps}")
    print(f"{'P':>3} {'round':>5} {'mpidp s':>9} {'sharded s':>10} {'ratio':>7}")
    for ranks in (2, 4):
        for r in range(args.rounds):
            pair = {x["mode"]: x for x in rows if x["ranks"] == ranks and x["round"] == r}
            ratio = pair["sharded"]["s"] / pair["mpidp"]["s"]
            a, b = pair["mpidp"]["s"], pair["sharded"]["s"]
            print(f"{ranks:>3} {r:>5} {a:>9.3f} {b:>10.3f} {ratio:>7.3f}")
    for ranks in (2, 4):
        for mode in ("mpidp", "sharded"):
            one = next(x for x in rows if x["ranks"] == ranks and x["mode"] == mode)
            print(f"P = {ranks} {mode:<8} calls per step: {one['calls_per_step']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
