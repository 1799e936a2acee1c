#!/usr/bin/env bash
# Launch an mpidp program with torchrun (no MPI needed).
#
#   bash launchers/torchrun.sh                                  # 4 processes, this machine
#   NPROC=8 bash launchers/torchrun.sh examples/train.py --steps 100
#   # several nodes: run the same line on every node (srun does that inside sbatch):
#   NNODES=4 NPROC=4 RDZV_HOST=node001 bash launchers/torchrun.sh examples/train.py
#
# Settings (environment variables):
#   NPROC      processes per node (default 4; one per GPU on GPU nodes)
#   NNODES     nodes (default 1: --standalone, torchrun picks a free port itself)
#   RDZV_HOST  the rendezvous host for several nodes (default: the first node of a SLURM job)
#   RDZV_PORT  its port (default 29500); RDZV_ID the job id (default SLURM_JOB_ID, else 1)
#   TORCHRUN   the torchrun command (default: torchrun on PATH)
#   THREADS    OpenMP/torch threads per process (default 1)
# mpidp reads RANK, WORLD_SIZE and LOCAL_RANK from torchrun and uses torch.distributed
# (NCCL on GPUs, gloo on CPUs) for everything.
set -euo pipefail

nproc="${NPROC:-4}"
nnodes="${NNODES:-1}"
torchrun="${TORCHRUN:-torchrun}"
script="${1:-examples/train.py}"
shift $(( $# > 0 ? 1 : 0 ))
export OMP_NUM_THREADS="${THREADS:-1}"
if [ "$nnodes" = 1 ]; then
  set -- "$torchrun" --standalone --nproc-per-node "$nproc" "$script" "$@"
else
  host="${RDZV_HOST:-}"
  if [ -z "$host" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    host="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
  fi
  if [ -z "$host" ]; then
    echo "torchrun.sh: NNODES=$nnodes needs RDZV_HOST (the first node's name)" >&2
    exit 1
  fi
  set -- "$torchrun" --nnodes "$nnodes" --nproc-per-node "$nproc" \
    --rdzv-backend c10d --rdzv-endpoint "$host:${RDZV_PORT:-29500}" \
    --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-1}}" "$script" "$@"
fi
echo "torchrun.sh: $*" >&2
exec "$@"
