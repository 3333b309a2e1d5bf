#!/usr/bin/env bash
# Compares twell's CPU GEMM with OpenBLAS sgemm in one process on this
# machine. Fetches Debian's libopenblas0-pthread and libgfortran5 into a
# temporary folder (nothing is installed), then runs the Go benchmark.
# Usage: bench/openblas/run.sh [count]   (default 5 runs of each size)
set -euo pipefail
cd "$(dirname "$0")"
count=${1:-5}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && apt-get -o APT::Sandbox::User=root download libopenblas0-pthread libgfortran5 >/dev/null)
for f in "$tmp"/*.deb; do dpkg -x "$f" "$tmp/root"; done
export TWELL_OPENBLAS_DIR="$tmp/root/usr/lib/x86_64-linux-gnu/openblas-pthread"
export OPENBLAS_NUM_THREADS=$(nproc)
CGO_ENABLED=0 go test -run TestAgreesWithTwell -bench GEMM -benchtime 5x -count "$count" -v . 2>&1 | grep -E 'OpenBLAS:|^Benchmark|PASS|FAIL|ok' | sed 's/^ *//'
