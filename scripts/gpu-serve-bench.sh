#!/usr/bin/env bash
# Serving figures on a GPU machine (no Go there: build gpubin/twell first
# with scripts/gpu-build.sh): `twell bench serve` with the in-process server
# on the GPU, at 1, 8 and 64 requests in flight, TwELL (-mlp auto) against
# dense, on the sparselm-1.5b preset (random weights, gates calibrated to
# 0.5% skewed) or on a checkpoint.
#
#   scripts/gpu-serve-bench.sh OUTDIR [MODEL_DIR]
#
# Writes OUTDIR/serve-PATH-cN.json and .txt per run and prints the summary
# lines. MAX_TOKENS (default 128) tokens per request, -ignore-eos; each run
# first sends as many requests as it keeps in flight, not counted (-warmup).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-serve-bench.sh OUTDIR [MODEL_DIR]}
src=(-preset sparselm-1.5b)
[ -n "${2:-}" ] && src=(-model "$2")
bin=gpubin/twell
[ -x "$bin" ] || { echo "gpu-serve-bench: $bin is missing; build it with scripts/gpu-build.sh" >&2; exit 2; }
mkdir -p "$out"
status=0
for c in 1 8 64; do
  for p in auto dense; do
    n=$((c < 8 ? 16 : 4 * c))
    "$bin" bench serve "${src[@]}" -device cuda -mlp "$p" -concurrency "$c" -max-concurrent 64 -requests "$n" -warmup "$c" \
      -max-tokens "${MAX_TOKENS:-128}" -ignore-eos -seed 1 -json "$out/serve-$p-c$c.json" > "$out/serve-$p-c$c.txt" 2>&1 || status=1
    echo "== $p, $c in flight"
    grep -E "output throughput|time to first|time per output" "$out/serve-$p-c$c.txt"
  done
done
exit $status
