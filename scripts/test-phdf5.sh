#!/usr/bin/env bash
# Opt-in test stage: the I/O tests in the parallel-HDF5 environment (scripts/setup-phdf5.sh),
# where write_sharded and RolloutWriter also run through the mpio driver with collective
# writes, at 1-4 ranks, under Debian's MPICH. Run: bash scripts/setup-phdf5.sh &&
# bash scripts/test-phdf5.sh   (or MPIDP_TEST_PHDF5=1 bash scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${MPIDP_PHDF5_VENV:-.venv-phdf5}"
py="$PWD/$venv/bin/python"
mpiexec=/usr/bin/mpiexec.mpich
per_run="${MPIDP_TEST_TIMEOUT:-600}"
export MPIEXEC_TIMEOUT="$per_run" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$py" -c "import h5py, sys; sys.exit(not h5py.get_config().mpi)" || {
  echo "test-phdf5: $venv has no MPI-enabled h5py; run scripts/setup-phdf5.sh first" >&2
  exit 1
}
fail=0
for n in ${MPIDP_TEST_RANKS:-1 2 3 4}; do
  echo; echo "=== I/O tests with parallel HDF5 (mpio), $n ranks"
  timeout $((per_run + 30)) "$mpiexec" -n "$n" "$py" -m mpi4py -m pytest -q --with-mpi \
    -p no:cacheprovider tests/mpi/test_io.py || { echo "FAILED at $n ranks"; fail=1; }
done
[ "$fail" -eq 0 ] && echo "parallel-HDF5 I/O tests: all passed"
exit "$fail"
