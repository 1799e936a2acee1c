#!/usr/bin/env bash
# Create .venv (or $MPIDP_VENV) and install mpidp with what the examples, tests and dev tools
# need, and Zarr support (the zarr extra).
# torch is pinned to 2.13.0: that is the CPU wheel this project is built and tested against.
# MPIDP_MPI=system skips the PyPI MPICH, for machines whose own MPI should be used.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${MPIDP_VENV:-.venv}"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
extras="zarr,examples,test,dev"
[ "${MPIDP_MPI:-pypi}" = system ] || extras="mpich,$extras"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[$extras]"
echo "mpidp installed in $venv ($("$venv/bin/python" -c 'import mpidp; print(mpidp.__version__)'))"
