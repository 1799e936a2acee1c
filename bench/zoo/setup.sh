#!/usr/bin/env bash
# One third-party zoo environment: bash bench/zoo/setup.sh <pnm|credit> <package spec>
#   bash bench/zoo/setup.sh pnm 'nvidia-physicsnemo==2.2.*'
#   bash bench/zoo/setup.sh credit miles-credit==2026.2.0
# Each is about 2 GB, in $MPIDP_ZOO_VENVS (default /tmp/mpidp-zoo); torch stays pinned to the
# CPU wheel. The torchvision these packages pull is a CUDA build that does not import with the
# CPU torch: empty stand-ins for its two registration modules let the pure-Python parts import.
# An environment already built for the same spec (its stamp file) is kept: a no-op.
set -euo pipefail
root="${MPIDP_ZOO_VENVS:-/tmp/mpidp-zoo}"
v="$root/$1"
want="$2 torch==2.13.0 mpi4py mpich numpy h5py einops pytest python-hostlist"
if [ -f "$v/.mpidp-stamp" ] && [ "$(cat "$v/.mpidp-stamp")" = "$want" ]; then
  echo "zoo environment $1 up to date in $v"
  exit 0
fi
mkdir -p "$root"
rm -rf "$v"
pins="$root/constraints-$1.txt"  # one per environment: scripts/test-zoo.sh builds them at once
echo "torch==2.13.0" > "$pins"
python3.11 -m venv "$v"
# One resolver run for everything (torch is in $want): pip prints its "ERROR: pip's dependency
# resolver does not currently take into account all the packages that are installed" when an
# install lands on packages an earlier one put there (the two installs this script used to
# run). pip check then fails the build loudly on any conflict that is left.
# shellcheck disable=SC2086  # the spec words are separate requirements
# --no-compile: no bytecode for the whole 2 GB at install (half of the build's CPU); the runs
# compile and keep what they import (scripts/test-zoo.sh writes bytecode).
"$v/bin/pip" install -q --no-compile -c "$pins" $want
"$v/bin/pip" check
sp=$("$v/bin/python" -c 'import site; print(site.getsitepackages()[0])')
cat > "$sp/tvstub.py" <<'PY'
import sys, types
for _n in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
    sys.modules.setdefault(_n, types.ModuleType(_n))
PY
echo "import tvstub" > "$sp/tvstub.pth"
echo "$want" > "$v/.mpidp-stamp"
echo "zoo environment $1 ready in $v"
