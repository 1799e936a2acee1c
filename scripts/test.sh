#!/usr/bin/env bash
# shellcheck disable=SC2030,SC2031  # start_beside: its subshell records its own times and bad, by design
# The whole test suite: lint, type check, unit tests, MPI tests at 1-4 ranks, launch tests
# (examples and launchers run for real), real launchers (a SLURM started on loopback, Open
# MPI's mpirun; their setup installs what they need or fails loudly), and, with
# MPIDP_TEST_PHDF5=1, the I/O tests again with parallel HDF5.
# The 1-rank MPI stage runs beside the lint, type, unit and 1-rank composition stages (each
# of them one process: on 2 cores one core was idle); its output follows theirs.
# Every MPI run has a timeout and goes through `python -m mpi4py`, so a rank that fails
# aborts the job instead of leaving the others waiting.
#
# The full suite first prints what it needs (scripts/prereqs.sh): root and apt-get for the
# real-launcher stage, network and disk for the stages that build environments. A stage whose
# variable is 0 is skipped on purpose (MPIDP_TEST_CLUSTER=0: real launchers; MPIDP_TEST_ZOO=0:
# the third-party zoo, which builds its own environments); a stage that cannot run here with
# its variable unset fails at once, naming the variable. The summary lists both.
#
# `--quick`: the development tier (a few minutes): ruff, mypy, unit tests, and the MPI tests
# at 3 ranks (uneven bands, an interior rank, both transports, and dp 3 x domain 1 where the
# data-parallel average is checked) without the gradcheck tests; no composition, one-rank,
# launch or cluster stages. MPIDP_TEST_RANKS overrides the rank counts (none: no MPI stage).
#
# Limits: every stage runs under a limit of a few times MPIDP_TEST_TIMEOUT (default 600 s; the
# MPI stages 2x, the launch and zoo stages 3x), generous for a loaded 2-core machine: quiet,
# the longest stage (launch) took about 7 minutes as one stage (now two halves at once) and the
# 3-rank MPI stage about 4. A stage
# killed by its limit says so in one line (the stage, the last test it started, the limit and
# the variable); the summary gives each stage's time and result (passed, FAILED, KILLED) and
# names the ones that did not pass again at the end.
set -euo pipefail
quick=0
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi
cd "$(dirname "$0")/.."
venv="${MPIDP_VENV:-.venv}"
export PATH="$PWD/$venv/bin:$PATH"
py="$PWD/$venv/bin/python"
per_run="${MPIDP_TEST_TIMEOUT:-600}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Bytecode written and kept: where the environment says not to write it (PYTHONDONTWRITEBYTECODE,
# set on these machines), each of the suite's hundreds of processes compiled the mpidp modules it
# imported and pytest rewrote the test modules again (about 2 CPU-s a rank for tests/mpi).
unset PYTHONDONTWRITEBYTECODE
# MPICH's waiting ranks spin (and sched_yield) at 100% CPU: with more ranks than cores they
# starve the ranks that compute. Sleeping instead took the 4-rank composition tests from 244 s
# to 28 s and a 4-rank FSDP2 training from 76 s to 19 s on 2 cores (docs/launching.md).
export MPIR_CVAR_ENABLE_HEAVY_YIELD="${MPIR_CVAR_ENABLE_HEAVY_YIELD:-1}"
# The suite oversubscribes on purpose (4 and 8 ranks on 2 cores): no OversubscribedWarning from
# every job (the launch tests' jobs, whose environment drops MPIDP_*, still show it to a failure).
export MPIDP_WARN_OVERSUBSCRIBED="${MPIDP_WARN_OVERSUBSCRIBED:-0}"
# shellcheck disable=SC1091  # stage_gate, print_not_run, prereqs_banner
. scripts/prereqs.sh
if [ "$quick" = 0 ]; then prereqs_banner; fi
fail=0
# Each stage's wall time and result, printed at the end (the 25-minute budget is for everything
# but the third-party zoo stage, which has 10 minutes of its own).
times=()
bad=()
last_test="$(mktemp "${TMPDIR:-/tmp}/mpidp-last-test.XXXXXX")"
trap 'rm -f "$last_test" "$cpu_file"*' EXIT
# children_cpu: sets cpu to the CPU seconds (user + system) of this shell's finished children
# so far, for the total (`times` in this shell: a pipeline's or a $(...)'s subshell has no
# children); a stage's own comes from the subshell it runs in (run_stage)
cpu_file="$(mktemp "${TMPDIR:-/tmp}/mpidp-cpu.XXXXXX")"
cpu=0
# cpu_of FILE: the children's user + system seconds from what `times` wrote to FILE (0 if none)
cpu_of() {
  awk 'NR == 2 { split($1, u, "m"); split($2, s, "m"); printf "%d", u[1] * 60 + u[2] + s[1] * 60 + s[2] }' \
    "$1" 2>/dev/null || echo 0
}
children_cpu() {
  local f="$cpu_file.$BASHPID"  # a file per shell: a stage beside has a shell of its own
  times >"$f"
  cpu=$(cpu_of "$f")
}
# run_stage NAME FACTOR CMD...: CMD under a limit of FACTOR x MPIDP_TEST_TIMEOUT seconds (an mpiexec
# inside it gets a little more, so that the limit, not MPICH's own timeout, ends it); records
# the stage's time and result. A stage over its limit is killed and says so.
run_stage() {
  local name="$1" factor="$2" limit=$(($2 * per_run)) rc=0 t0=$SECONDS result
  local own="$cpu_file.$BASHPID.stage"
  shift 2
  echo; echo "=== $name"
  : >"$last_test"
  # in a subshell that writes its own children's CPU at the end: the shell's own count would
  # also take in a stage beside this one that ended meanwhile
  (
    rc=0
    MPIDP_TEST_LAST="$last_test" MPIEXEC_TIMEOUT=$((limit + 60)) timeout "$limit" "$@" || rc=$?
    times >"$own"
    exit "$rc"
  ) || rc=$?
  if [ "$rc" = 0 ]; then
    result=passed
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    result=KILLED
    echo
    echo "!!! stage '$name' KILLED at its limit of $limit s ($factor x MPIDP_TEST_TIMEOUT=$per_run);" \
      "the last test it started: $(cat "$last_test" 2>/dev/null | grep . || echo 'none (still starting)');" \
      "on a loaded machine give it longer: MPIDP_TEST_TIMEOUT=$((2 * per_run)) bash scripts/test.sh"
  else
    result=FAILED
    echo; echo "!!! stage '$name' FAILED (exit $rc)"
  fi
  cpu=$(cpu_of "$own")
  times+=("$(printf '%5d s %5d cpu-s  %-7s %s' $((SECONDS - t0)) "${cpu:-0}" "$result" "$name")")
  if [ "$result" != passed ]; then bad+=("$result: $name"); fail=1; fi
}
report_times() {
  children_cpu
  echo; echo "stage times (wall; CPU of its processes: 2 cores give at most 2 cpu-s a second)" \
    "and results (total $SECONDS s, $cpu cpu-s):"
  for line in "${times[@]}"; do echo "  $line"; done
  if [ "${#bad[@]}" -gt 0 ]; then
    echo; echo "stages that did not pass:"
    for line in "${bad[@]}"; do echo "  $line"; done
  fi
}

# start_beside KEY CMD...: CMD (run_stage NAME FACTOR ..., or a function running several stages)
# in the background, its output kept in a file, so that stages that leave a core idle (one
# process; jobs that mostly wait or install) run beside the stages that follow; join_beside KEY
# waits for it, prints its output and records its stages' times and results. Several at once.
declare -A beside_pid=() beside_dir=()
start_beside() {
  local key="$1" dir
  shift
  dir="$(mktemp -d "${TMPDIR:-/tmp}/mpidp-beside.XXXXXX")"
  (
    last_test="$dir/last" times=() bad=() fail=0
    "$@" >"$dir/out" 2>&1
    printf '%s\n' "${times[@]}" >"$dir/times"
    printf '%s\n' "${bad[@]}" >"$dir/bad"
  ) &
  beside_pid[$key]=$! beside_dir[$key]="$dir"
}
join_beside() {
  local line dir="${beside_dir[$1]}"
  wait "${beside_pid[$1]}" || true
  echo; echo "--- (ran beside the stages above: $1)"; cat "$dir/out"
  while IFS= read -r line; do [ -n "$line" ] && times+=("$line"); done <"$dir/times"
  while IFS= read -r line; do [ -n "$line" ] && { bad+=("$line"); fail=1; }; done <"$dir/bad"
  rm -rf "$dir"
  unset "beside_pid[$1]" "beside_dir[$1]"
}

# From the start, beside everything else (the lint, type and unit stages and the MPI stages keep
# about 1.3 of 2 cores busy: one process; ranks that wait for each other), the stages that
# mostly wait or install, one after the other: the real launchers (apt-get, pip, short jobs), the
# faults, launchers and test-script jobs (2- and 3-rank jobs that wait out a deadline of 2-5 s,
# for a rank to abort, for a one-process command: 185 CPU-s in a 350-s stage), and the
# third-party zoo (its environments built from PyPI the first time, then MPI jobs that fill
# the idle core). Nothing of them shares a port, a file or a folder with the MPI stages or
# with the examples (MPI and torchrun pick free ports; each test has its own folders), and
# their checks hold on a loaded machine: the fault tests time the end of a job from its fault,
# not from its launch, and look for each rank's own message, not for which rank's abort ended
# the job. Whether the optional stages run is decided here, before anything starts (their
# reasons go to the summary).
with_cluster=0 with_zoo=0
if [ "$quick" = 0 ]; then
  if stage_gate cluster; then with_cluster=1; fi  # root and apt-get (scripts/prereqs.sh)
  if stage_gate zoo; then with_zoo=1; fi  # the disk its environments need
fi
launch_tests=(tests/launch/test_faults.py tests/launch/test_launch.py
  tests/launch/test_test_script.py tests/launch/test_agv_deadline.py)
beside_mpi_stages() {
  if [ "$with_cluster" = 1 ]; then
    # shellcheck disable=SC2016  # $0 is expanded by the inner bash: the suite's python
    run_stage "real launchers: SLURM (srun, sbatch) and Open MPI (mpirun)" 1 bash -c \
      'bash scripts/setup-launch.sh || { echo "!!! its setup could not install what it needs"; exit 1; }
       exec "$0" -m pytest -q tests/cluster' "$py"
  fi
  run_stage "launch tests: faults, launchers, the test script" 3 "$py" -m pytest -q \
    "${launch_tests[@]}"
  # Unchanged PhysicsNeMo and CREDIT models against serial at 2 and 3 ranks, and eight of them
  # on 2 x 2 blocks at 4, each package in an environment of its own (built once, about 5
  # minutes for both; the runs take about 3).
  if [ "$with_zoo" = 1 ]; then
    run_stage "third-party zoo: unchanged PhysicsNeMo and CREDIT models, 2 and 3 ranks and 2 x 2 blocks" 3 \
      bash scripts/test-zoo.sh
  fi
}
if [ "$quick" = 0 ]; then start_beside lane beside_mpi_stages; fi

all_ranks="${MPIDP_TEST_RANKS:-1 2 3 4}"
one_beside=0
if [ "$quick" = 0 ] && [[ " $all_ranks " == *" 1 "* ]]; then
  one_beside=1  # the 1-rank MPI stage beside the lint, type and unit stages
  start_beside one run_stage "MPI tests, 1 rank" 2 mpiexec -n 1 "$py" -m mpi4py -m pytest -q --with-mpi \
    tests/mpi --ignore=tests/mpi/test_parallel.py
fi
run_stage "ruff" 1 "$py" -m ruff check mpidp tests examples bench docs
run_stage "mypy" 1 "$py" -m mypy
run_stage "imports" 1 "$venv/bin/lint-imports" --no-cache
run_stage "unit tests" 1 "$py" -m pytest -q tests/unit
if [ "$quick" = 1 ]; then
  # gradcheck tests verify the Functions' math; the full suite runs them at 3 ranks
  export MPIDP_GRADCHECK_RANKS="${MPIDP_GRADCHECK_RANKS:-none}"
  ranks="${MPIDP_TEST_RANKS:-3}"
  if [ "$ranks" = none ]; then ranks=""; fi
  for n in $ranks; do
    run_stage "MPI tests, $n ranks" 2 mpiexec -n "$n" "$py" -m mpi4py -m pytest -q --with-mpi \
      tests/mpi --ignore=tests/mpi/test_parallel.py
  done
  report_times
  echo
  if [ "$fail" -ne 0 ]; then echo "quick tier: FAILED"; exit 1; fi
  echo "quick tier: passed (the full suite: bash scripts/test.sh)"
  exit 0
fi
# Above 3 ranks, the files whose cases 4 ranks add to (two interior ranks, dp 2 x domain 2
# meshes, 4-way transposes and redistributions, multi-hop halos through thin bands, sharded
# I/O and checkpoints at 4, the grids of blocks 2 x 2, 1 x 4 and 4 x 1, rebalancing at 4);
# the model-level files (zoo, coverage, attention, windows, spectral models, graphs, anemoi)
# have an interior rank and uneven cuts at 3 and run at 1-3.
# MPIDP_TEST_WIDE=all runs every file at every rank count.
wide=(test_halo test_collectives test_transports test_sharded test_sharded_models test_layers
  test_fft test_io test_manager test_training test_harness test_one_front_end test_silent_hunt
  test_layouts test_scatter test_explain test_placements test_compat_credit test_compat_anemoi
  test_compat_physicsnemo test_partial test_zarr test_zarr_anemoi test_zarr_write test_prefetch
  test_compat_credit_losses test_dropin_setups test_latent_attention test_index_gathers
  test_flat_heads test_empty_bands_converted test_blocks test_blocks_layers test_blocks_fft
  test_blocks_sharded test_blocks_models test_io_blocks test_layout_invariance
  test_rebalance test_blocks_sharded_fft test_compat_pnm_blocks test_blocks_zoo_rules test_plan_traffic test_per_axis_rules
  test_rollout_blocks test_compat_pnm_devmesh test_overlap_blocks test_blocks_tokens
  test_plan_spectral_channels test_dispatch_cache test_fixes6
  test_tokens_mha test_tokens_peraxis test_agv_fast test_compat_groups test_fixes7
  test_dispatch_cache2 test_house8 test_tokens_batch test_agv_fast2 test_outside8
  test_kept_layers test_subclass_convert test_dispatch9 test_outside10)
if [ "$one_beside" = 1 ]; then
  run_stage "DDP / FSDP2 / tensor-parallel composition tests, 1 rank" 1 \
    mpiexec -n 1 "$py" -m mpi4py -m pytest -q --with-mpi tests/mpi/test_parallel.py
  join_beside one
fi
for n in $all_ranks; do
  if [ "$one_beside" = 1 ] && [ "$n" = 1 ]; then continue; fi  # (done beside the above)
  files=(tests/mpi)
  if [ "$n" -gt 3 ] && [ "${MPIDP_TEST_WIDE:-}" != all ]; then
    files=("${wide[@]/#/tests/mpi/}"); files=("${files[@]/%/.py}")
  fi
  if [ "${#files[@]}" -gt 1 ]; then echo; echo "(at $n ranks: ${wide[*]})"; fi
  run_stage "MPI tests, $n ranks" 2 mpiexec -n "$n" "$py" -m mpi4py -m pytest -q --with-mpi \
    "${files[@]}" --ignore=tests/mpi/test_parallel.py
done
# DDP / FSDP2 / tensor parallelism (mpidp.parallel) in jobs of their own: every layout builds
# gloo process groups, and whatever of them outlives a test (threads, sockets) slowed the MPI
# tests that followed in the same 4-rank job several times over (2 cores, oversubscribed).
for n in $all_ranks; do
  if [ "$one_beside" = 1 ] && [ "$n" = 1 ]; then continue; fi
  run_stage "DDP / FSDP2 / tensor-parallel composition tests, $n ranks" 1 \
    mpiexec -n "$n" "$py" -m mpi4py -m pytest -q --with-mpi tests/mpi/test_parallel.py
done
# The 3-D mesh: dp 2 x tp 2 x domain 2 with DDP and with FSDP2, eight ranks oversubscribed on
# however many cores there are (about 80 s on 2 cores). MPIDP_TEST_BIG_RANKS= skips it.
big="${MPIDP_TEST_BIG_RANKS-8}"
if [ -n "$big" ]; then
  oversub=()
  mpiexec --version 2>&1 | grep -q "Open MPI\|OpenRTE\|PRRTE" && oversub=(--oversubscribe)
  run_stage "composition tests, $big ranks oversubscribed (dp 2 x tp 2 x domain 2)" 1 \
    mpiexec "${oversub[@]}" -n "$big" "$py" -m mpi4py -m pytest -q --with-mpi \
    tests/mpi/test_parallel.py -k five_steps
fi
# Latitude x longitude blocks at 6 ranks oversubscribed: the grids 2 x 3 and 3 x 2 (the
# primitives, the layers, the models, the front end, I/O, layout invariance; about 60 s on 2
# cores). MPIDP_TEST_BLOCK_RANKS= skips it.
six="${MPIDP_TEST_BLOCK_RANKS-6}"
if [ -n "$six" ]; then
  oversub=()
  mpiexec --version 2>&1 | grep -q "Open MPI\|OpenRTE\|PRRTE" && oversub=(--oversubscribe)
  blocks=(test_blocks test_blocks_fft test_blocks_layers test_blocks_models test_blocks_sharded
    test_io_blocks test_layout_invariance test_blocks_sharded_fft test_compat_pnm_blocks test_blocks_zoo_rules test_plan_traffic test_per_axis_rules
    test_rollout_blocks test_compat_pnm_devmesh test_overlap_blocks test_blocks_tokens
    test_dispatch_cache test_tokens_mha test_tokens_peraxis test_fixes7 test_dispatch_cache2 test_tokens_batch test_outside8
    test_kept_layers)
  files=("${blocks[@]/#/tests/mpi/}"); files=("${files[@]/%/.py}")
  run_stage "blocks, $six ranks oversubscribed (2 x 3, 3 x 2)" 1 \
    mpiexec "${oversub[@]}" -n "$six" "$py" -m mpi4py -m pytest -q --with-mpi "${files[@]}"
fi
# Real jobs: examples trained at 1-4 ranks, torchrun, and every doc page's code in one job at
# 1 rank and one at 2: trainings that keep both cores busy (394-437 s quiet with the faults
# beside them, three times that on a loaded machine: three times the limit).
run_stage "launch tests: examples, docs" 3 "$py" -m pytest -q tests/launch \
  "${launch_tests[@]/#/--ignore=}"
join_beside lane
if [ "${MPIDP_TEST_PHDF5:-0}" = 1 ]; then  # opt-in: builds a second environment (minutes)
  run_stage "parallel HDF5 (mpio) I/O tests" 2 bash -c \
    'bash scripts/setup-phdf5.sh && bash scripts/test-phdf5.sh'
fi
report_times
echo
print_not_run
if prereqs_failed; then fail=1; fi
if [ "$fail" -ne 0 ]; then
  echo "test suite: FAILED (${#bad[@]} stage(s) did not pass: see the list above)"; exit 1
fi
echo "test suite: all steps passed"
