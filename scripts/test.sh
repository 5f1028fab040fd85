#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up (idempotent), then
#   0. lint: ruff and mypy (pyproject.toml), beside the unit tests; a report
#      fails the suite like a failed test (lint::ruff, lint::mypy in the summary),
#   1. unit tests (two pytest workers, one per core), then the launcher
#      tests (each starts mpirun itself),
#   2. multi-rank tests under mpiexec at 2, 4 and 8 ranks (oversubscribed),
#   3. SLURM tests on a throwaway single-node SLURM started here.
# Per-rank output of the multi-rank sessions goes to build/test-logs; a
# failing rank's log tail is printed. Ends with one line:
#   hpctrain: N passed, N failed, N skipped
# Usage: bash scripts/test.sh [--quick]   (--quick: unit + 2 ranks only)
set -uo pipefail
cd "$(dirname "$0")/.."
t_setup=$SECONDS
# --tests: also what only the tests need (the headless browser the report test renders pages in)
bash scripts/setup.sh --tests || { echo "hpctrain: set-up failed"; exit 1; }
# shellcheck disable=SC1091
source .venv/bin/activate

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_mpi_yield_when_idle=1
export PYTHONDONTWRITEBYTECODE=1
LOGDIR=build/test-logs
rm -rf "$LOGDIR" && mkdir -p "$LOGDIR"
status=0
quick=0; [ "${1:-}" = "--quick" ] && quick=1

# each section's wall time: printed when it ends ("section time: NAME 4m12s") and listed in the summary
times=()

fmt() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }
end_section() {
  [ -n "${sec_name:-}" ] || return 0
  local took=$((SECONDS - sec_t0))
  echo "section time: $sec_name $(fmt $took)"
  times+=("$(printf '  %-32s %s' "$sec_name" "$(fmt $took)")")
  sec_name=""
}
section() { end_section; printf '\n==== %s ====\n' "$*"; sec_name=$1; sec_t0=$SECONDS; }
times+=("$(printf '  %-32s %s' "set-up" "$(fmt $((SECONDS - t_setup)))")")

# lint runs beside the unit tests: mypy keeps one core busy for a minute, the two unit-test workers
# fill the cores around it (its report is printed once the unit tests end)
section "lint and unit tests" "(ruff and mypy beside the unit tests, one process each, two at a time)"
python scripts/lint.py "$LOGDIR/lint.xml" > "$LOGDIR/lint.log" 2>&1 &
lint_pid=$!
# (the limits only catch a hang: the unit tests take about 3 minutes on a quiet 2-core machine)
timeout 1200 python -m pytest -q -p no:cacheprovider -n 2 tests/unit --durations=15 --junitxml="$LOGDIR/unit.xml"
rc=$?; [ $rc -eq 5 ] && rc=0; [ $rc -ne 0 ] && status=1
echo "-- lint (ruff, mypy)"
if wait "$lint_pid"; then
  cat "$LOGDIR/lint.log"; echo "lint: clean"
else
  cat "$LOGDIR/lint.log"; status=1
  echo "hpctrain: lint failed: ruff or mypy reported problems (above); fix them or the suite fails"
fi

# only what needs a job of its own (a signal, a hang, a relaunch, a terminal, a wheel, peak RSS, the
# README's launch commands); messages, validation and tool output run in the MPI sessions below
# (tests/mpi/test_cli_*.py) or in the unit tests. Each starts MPI jobs of up to 8 ranks: two modules
# at a time (a module's shared job runs once), then one at a time those marked `alone`, which time a
# running job from outside (a hang, a straggler, a signal, a second run beside it)
section "launcher tests"
timeout 1500 python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not alone" tests/launch \
  --durations=15 --junitxml="$LOGDIR/launch.xml"
rc=$?; [ $rc -eq 5 ] && rc=0; [ $rc -ne 0 ] && status=1
timeout 1500 python -m pytest -q -p no:cacheprovider -m alone tests/launch --durations=15 \
  --junitxml="$LOGDIR/launch-alone.xml"
rc=$?; [ $rc -eq 5 ] && rc=0; [ $rc -ne 0 ] && status=1

sizes="2 4 8"; [ $quick = 1 ] && sizes="2"
for n in $sizes; do
  section "multi-rank tests, $n ranks"
  timeout 1500 mpiexec.openmpi -n "$n" python scripts/mpi_pytest.py "$LOGDIR" -q -p no:cacheprovider --durations=15 tests/mpi
  rc=$?
  if [ $rc -eq 5 ]; then echo "(no multi-rank tests need $n ranks)"; rc=0; fi
  if [ $rc -ne 0 ]; then
    status=1
    [ $rc -eq 124 ] && echo "hpctrain: the $n-rank session timed out (a hang): see $LOGDIR"
    for log in "$LOGDIR"/np"$n"-rank*.log; do
      [ -f "$log" ] && grep -qE "FAILED|ERROR|Error|Traceback" "$log" && { echo "---- tail of $log"; tail -n 40 "$log"; }
    done
  fi
done

if [ $quick = 0 ]; then
  section "SLURM tests" "(local single-node SLURM)"
  # three emulated nodes (one slurmd each): the restart-inside-the-allocation test loses one
  if HPCTRAIN_SLURM_NODES=3 bash slurm/local/start.sh > "$LOGDIR/slurm-start.log" 2>&1; then
    # shellcheck disable=SC1091
    source "${HPCTRAIN_SLURM_DIR:-/tmp/hpctrain-slurm}/env"
    # REQUIRE: a cluster that did not come up fails the tests instead of skipping them
    HPCTRAIN_REQUIRE_SLURM=1 timeout 900 python -m pytest -q -p no:cacheprovider tests/slurm --durations=15 \
      --junitxml="$LOGDIR/slurm.xml"
    rc=$?; [ $rc -eq 5 ] && rc=0; [ $rc -ne 0 ] && status=1
    bash slurm/local/stop.sh >> "$LOGDIR/slurm-start.log" 2>&1 || true
  else
    echo "hpctrain: could not start the local SLURM:"; tail -n 30 "$LOGDIR/slurm-start.log"; status=1
  fi
fi

end_section
section "summary"
python scripts/summarize_tests.py "$LOGDIR"/*.xml || status=1
echo "section times:"
printf '%s\n' "${times[@]}"
echo "  total                            $(fmt $SECONDS)"
exit $status
