#!/usr/bin/env bash
# Runs, on a GPU machine without Go, what scripts/gpu-build.sh built: every
# GPU test binary (verbose, from its package folder, with a missing GPU
# counted as a failure), `twell devices`, and with BENCH=1 `twell bench gemm`.
#
#   scripts/gpu-run.sh [LOGDIR]      (default gpubin/logs)
#
# Writes LOGDIR/devices.txt, LOGDIR/tests.log (all test output) and, with
# BENCH=1, LOGDIR/gemm.txt and LOGDIR/gemm.json. Exits non-zero if any test
# binary or the benchmark failed. BENCH_ARGS adds flags to bench gemm; RUN,
# a regular expression, runs only the tests it matches (go test's -run).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
log=${1:-$root/gpubin/logs}
mkdir -p "$log"
log=$(cd "$log" && pwd)
bin=$root/gpubin
if [ ! -x "$bin/twell" ] && [ -f "$bin/pack.txz" ]; then
  tar -xJf "$bin/pack.txz" -C "$bin"
fi
if [ ! -x "$bin/twell" ] || [ ! -f "$bin/tests.txt" ]; then
  echo "gpu-run: run scripts/gpu-build.sh first (on a machine with Go)" >&2
  exit 2
fi
export TWELL_REQUIRE_GPU=1
status=0
"$bin/twell" devices -v 2>&1 | tee "$log/devices.txt" || status=1
: > "$log/tests.log"
while read -r test dir; do
  echo "=== $test (in $dir)" >> "$log/tests.log"
  (cd "$root/$dir" && "$bin/$test" -test.v -test.count=1 -test.timeout=15m -test.run="${RUN:-.}") >> "$log/tests.log" 2>&1
  rc=$?
  echo "$test: exit $rc" | tee -a "$log/tests.log"
  [ $rc -eq 0 ] || status=1
done < "$bin/tests.txt"
echo "tests: $(grep -c -- '--- PASS' "$log/tests.log") passed, $(grep -c -- '--- FAIL' "$log/tests.log") failed, $(grep -c -- '--- SKIP' "$log/tests.log") skipped"
if [ "${BENCH:-0}" = 1 ]; then
  # shellcheck disable=SC2086
  "$bin/twell" bench gemm -json "$log/gemm.json" ${BENCH_ARGS:-} 2>&1 | tee "$log/gemm.txt" || status=1
fi
exit $status
