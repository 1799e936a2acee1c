#!/usr/bin/env bash
# Launch an mpidp program with srun inside a SLURM allocation (sbatch, salloc).
#
#   salloc -N 1 -n 4 --gpus-per-task=1        # or from launchers/slurm.sbatch
#   bash launchers/srun.sh examples/train.py --steps 100
#
# One task per GPU: srun starts SLURM_NTASKS tasks; mpidp gives task i the GPU
# local_rank mod (visible GPUs), or cuda:0 when SLURM binds one GPU per task.
# Settings (environment variables):
#   PYTHON      the Python of the environment that has mpidp (default: python3)
#   SRUN_MPI    srun's MPI plugin: pmi2 for MPICH-based MPIs (the PyPI mpich, Cray MPICH),
#               pmix for Open MPI (default pmi2). Never none: with MPI installed every task
#               would start as its own world of 1, and mpidp stops with an error saying so.
#   SRUN_FLAGS  more srun flags, e.g. "--overcommit" to run more tasks than CPUs (tests),
#               "--gpus-per-task=1 --gpu-bind=single:1" on GPU nodes
#   THREADS     OpenMP/torch threads per task (default SLURM_CPUS_PER_TASK, else 1)
set -euo pipefail

if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "srun.sh: not inside a SLURM allocation; submit launchers/slurm.sbatch or use salloc" >&2
  exit 1
fi
python="${PYTHON:-python3}"
script="${1:-examples/train.py}"
shift $(( $# > 0 ? 1 : 0 ))
export OMP_NUM_THREADS="${THREADS:-${SLURM_CPUS_PER_TASK:-1}}"
# Word splitting of SRUN_FLAGS is intended: it holds several flags.
# shellcheck disable=SC2086
set -- srun --mpi="${SRUN_MPI:-pmi2}" --kill-on-bad-exit=1 ${SRUN_FLAGS:-} \
  "$python" -m mpi4py "$script" "$@"
echo "srun.sh: $*" >&2
exec "$@"
