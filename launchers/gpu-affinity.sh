#!/usr/bin/env bash
# One GPU per rank: show each rank only the GPU of its local rank, then run the command.
#   mpiexec ... bash launchers/gpu-affinity.sh python train.py
# The local rank comes from whichever launcher started the rank (PALS, SLURM, Open MPI,
# MPICH Hydra). GPUS_PER_NODE (default: the count nvidia-smi lists, else 4) wraps it around.
# Reverse the order (REVERSE=1) where GPU 0 sits next to the last cores (some Cray nodes).
set -euo pipefail
local_rank="${PALS_LOCAL_RANKID:-${SLURM_LOCALID:-${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-0}}}}"
gpus="${GPUS_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l || true)}"
[ "${gpus:-0}" -ge 1 ] 2>/dev/null || gpus=4
gpu=$(( local_rank % gpus ))
[ "${REVERSE:-0}" = 1 ] && gpu=$(( gpus - 1 - gpu ))
export CUDA_VISIBLE_DEVICES="$gpu"
exec "$@"
