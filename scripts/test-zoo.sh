#!/usr/bin/env bash
# The third-party stage: unchanged PhysicsNeMo and CREDIT models on ShardedTensors against
# serial (tests/zoo), on bands at 2 and 3 ranks and on 2 x 2 blocks at 4 (the convolutional
# and window models: tests/zoo/test_zoo.py's ON_BLOCKS; MPIDP_ZOO_RANKS="2 3 2x2" by default),
# each package in an environment of its own built by bench/zoo/setup.sh (about 2 GB and 2-3
# minutes each from PyPI the first time; kept in $MPIDP_ZOO_VENVS, default /tmp/mpidp-zoo, and
# reused while its spec is unchanged). An environment that cannot be built fails the stage
# loudly; MPIDP_TEST_ZOO=0 skips the stage on purpose (scripts/test.sh says so in its summary).
set -euo pipefail
cd "$(dirname "$0")/.."
per_run="${MPIDP_TEST_TIMEOUT:-600}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MPIR_CVAR_ENABLE_HEAVY_YIELD=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore
unset PYTHONDONTWRITEBYTECODE  # the environments are built without bytecode: the runs keep it
root="${MPIDP_ZOO_VENVS:-/tmp/mpidp-zoo}"
fail=0
names=(pnm credit)  # one environment per index: its name here, its package spec below
specs=("nvidia-physicsnemo==2.2.*" miles-credit==2026.2.0)
# Every environment's build starts at once (mostly downloads; a no-op once built): the second is
# ready by the time the first one's runs end. Each build's output is shown before its runs.
builds="$(mktemp -d "${TMPDIR:-/tmp}/mpidp-zoo-builds.XXXXXX")"
trap 'rm -rf "$builds"' EXIT
for i in "${!names[@]}"; do
  name=${names[$i]} spec=${specs[$i]}
  (bash bench/zoo/setup.sh "$name" "$spec" >"$builds/$name.log" 2>&1; echo $? >"$builds/$name.rc") &
done
for i in "${!names[@]}"; do
  name=${names[$i]} spec=${specs[$i]}
  while [ ! -f "$builds/$name.rc" ]; do sleep 1; done
  cat "$builds/$name.log"
  if [ "$(cat "$builds/$name.rc")" != 0 ]; then
    echo "!!! zoo: could not build the $name environment ($spec)"; fail=1; continue
  fi
  for domain in ${MPIDP_ZOO_RANKS:-2 3 2x2}; do  # N ranks of bands or LATxLON blocks
    n=$(( ${domain/x/*} ))
    echo "--- zoo $name ($spec), domain $domain ($n ranks)"
    MPIDP_ZOO_DOMAIN="$domain" timeout $((per_run + 30)) "$root/$name/bin/mpiexec" -n "$n" \
      "$root/$name/bin/python" -m mpi4py -m pytest -q -rs -p no:cacheprovider tests/zoo \
      || { echo "!!! zoo $name FAILED on domain $domain"; fail=1; }
  done
done
wait
exit "$fail"
