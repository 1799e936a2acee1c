#!/usr/bin/env bash
# Opt-in: a second environment (.venv-phdf5, or $MPIDP_PHDF5_VENV) whose h5py is built with
# MPI, so mpidp.io writes through HDF5's mpio driver with collective writes.
#
# Parallel HDF5 cannot come from PyPI (the h5py wheels have no MPI). This follows the recipe
# measured in ENVIRONMENT.md: Debian's libhdf5-mpich (which brings Debian's MPICH), then mpi4py
# and h5py compiled against that MPI. The PyPI `mpich` package must NOT be in this environment:
# two MPI libraries in one process abort at the first MPI call. Needs apt (root) and about
# 6 minutes on 2 cores. The default install (scripts/setup.sh) stays pip-only.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${MPIDP_PHDF5_VENV:-.venv-phdf5}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
hdf5_dir=/usr/lib/x86_64-linux-gnu/hdf5/mpich
start=$(date +%s)

if [ ! -d "$hdf5_dir" ] || [ ! -x /usr/bin/mpicc ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup-phdf5: needs libhdf5-mpich-dev; run as root or: sudo apt-get install libhdf5-mpich-dev" >&2
    exit 1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    libhdf5-mpich-dev pkg-config >/dev/null
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" "torch==2.13.0" numpy "Cython>=3,<4" pkgconfig "setuptools>=77" wheel
if ! "$venv/bin/python" -c "import mpi4py" 2>/dev/null; then
  # -O1 -g0: with the default -O3 -g the compiler needs more than 21 GB and 30 minutes here.
  CFLAGS="-O1 -g0" MPICC=/usr/bin/mpicc "${pip[@]}" --no-binary=mpi4py mpi4py
fi
if ! "$venv/bin/python" -c "import h5py, sys; sys.exit(not h5py.get_config().mpi)" 2>/dev/null; then
  CFLAGS="-O1 -g0" CC=/usr/bin/mpicc HDF5_MPI=ON HDF5_DIR="$hdf5_dir" \
    "${pip[@]}" --no-build-isolation --no-binary=h5py --force-reinstall --no-deps h5py
fi
# mpidp itself without the PyPI MPICH extra; the test tools from the same extras as setup.sh.
"${pip[@]}" --no-build-isolation -e ".[test]" xarray h5netcdf
"$venv/bin/python" - <<'EOF'
import h5py, mpi4py
from mpi4py import MPI
assert h5py.get_config().mpi, "h5py was built without MPI"
print("parallel HDF5:", h5py.version.hdf5_version, "| MPI:", MPI.Get_library_version().splitlines()[0])
EOF
echo "setup-phdf5: $venv ready in $(( $(date +%s) - start )) s"
