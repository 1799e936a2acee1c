#!/usr/bin/env bash
# Launch an mpidp program with mpirun / mpiexec on one machine or a list of hosts.
#
#   bash launchers/mpirun.sh                              # examples/train.py on 4 ranks
#   NP=8 bash launchers/mpirun.sh examples/train.py --steps 100
#   HOSTFILE=hosts.txt NP=16 bash launchers/mpirun.sh my_train.py
#
# Works with Open MPI (mpirun) and MPICH / Intel MPI (Hydra mpiexec); it asks the launcher
# which one it is and passes that one's flags. Settings (environment variables):
#   NP            number of ranks (default 4); mpidp makes them dp x domain
#   MPIRUN        the launcher (default: mpirun, else mpiexec, from PATH)
#   PYTHON        the Python of the environment that has mpidp (default: python3 on PATH)
#   HOSTFILE      a host list for several machines (Open MPI: --hostfile, MPICH: -f)
#   OVERSUBSCRIBE 1 (default) allows more ranks than cores: fine for a laptop or a test,
#                 set 0 on a cluster so that a wrong rank count fails instead of crawling
#   THREADS       OpenMP/torch threads per rank (default: cores / NP, at least 1)
#   BIND          Open MPI binding (default none, which oversubscribed laptops need; on a
#                 cluster use core, or numa with THREADS > 1)
# The program runs under `python -m mpi4py`, so an exception on one rank aborts the whole
# job instead of leaving the other ranks waiting.
set -euo pipefail

np="${NP:-4}"
launcher="${MPIRUN:-$(command -v mpirun || command -v mpiexec || true)}"
python="${PYTHON:-python3}"
if [ -z "$launcher" ]; then
  echo "mpirun.sh: no mpirun or mpiexec on PATH; activate the environment (pip install mpich)" \
    "or set MPIRUN" >&2
  exit 1
fi
script="${1:-examples/train.py}"
shift $(( $# > 0 ? 1 : 0 ))

cores="$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)"
threads="${THREADS:-$(( cores / np > 0 ? cores / np : 1 ))}"
flags=()
if "$launcher" --version 2>&1 | grep -q "Open MPI\|OpenRTE\|PRRTE"; then
  # Open MPI: -x exports a variable to every rank; as root it refuses to start unless told
  # that this is intended.
  flags+=(-np "$np" -x OMP_NUM_THREADS="$threads" --bind-to "${BIND:-none}")
  [ "${OVERSUBSCRIBE:-1}" = 1 ] && flags+=(--oversubscribe)
  [ "$(id -u)" = 0 ] && flags+=(--allow-run-as-root)
  [ -n "${HOSTFILE:-}" ] && flags+=(--hostfile "$HOSTFILE")
else
  # MPICH Hydra / Intel MPI: -n ranks, -genv exports; Hydra oversubscribes without asking.
  flags+=(-n "$np" -genv OMP_NUM_THREADS "$threads")
  # More ranks than cores: MPICH's waiting ranks spin at 100% CPU and starve the ones that
  # compute (a 4-rank FSDP2 training on 2 cores: 76 s spinning, 19 s sleeping). Open MPI
  # yields on its own when it sees the node oversubscribed.
  if [ "$np" -gt "$cores" ] && [ -z "${MPIR_CVAR_ENABLE_HEAVY_YIELD:-}" ]; then
    flags+=(-genv MPIR_CVAR_ENABLE_HEAVY_YIELD 1)
  fi
  [ -n "${HOSTFILE:-}" ] && flags+=(-f "$HOSTFILE")
fi

echo "mpirun.sh: $launcher ${flags[*]} $python -m mpi4py $script $*" >&2
exec "$launcher" "${flags[@]}" "$python" -m mpi4py "$script" "$@"
