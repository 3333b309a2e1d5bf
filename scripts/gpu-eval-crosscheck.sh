#!/usr/bin/env bash
# The eval cross-check on the GPU machine (which has PyTorch and
# transformers but no Go and no network): twell eval writes the token ids
# and log-likelihoods it scored (-items), and scripts/eval-crosscheck.py
# recomputes them with transformers' LlamaForCausalLM in float32. Build the
# twell binary first, on a machine with Go:
#   scripts/gpu-build.sh        (or: CGO_ENABLED=0 go build -o gpubin/twell ./cmd/twell)
#
#   scripts/gpu-eval-crosscheck.sh [CHECKPOINT] [LOGDIR]   (default LOGDIR /tmp/eval-xcheck)
#
# Without CHECKPOINT a tiny model is trained on the bundled sample
# (twell train -preset tiny, on the CPU) and checked. Each twell run is
# compared with PyTorch at a tolerance of 1e-3 nats per token (TOL
# overrides):
#   cpu-dense  twell's CPU engine with -mlp dense, as `twell eval` runs on
#              the CPU by default: float32 throughout, the numerical check;
#   cpu-auto   the CPU engine with -mlp auto, for information: where the
#              model is sparse enough, the TwELL path holds the gate
#              activations in bf16 (about 1e-2 nats per token);
#   cuda-auto  when a GPU is present, the GPU engine (bf16), for
#              information only.
# Exits 0 when the cpu-dense run is within the tolerance, 1 otherwise, 2 when
# something could not run. Logs, items files and JSON summaries go to LOGDIR;
# LOGDIR/summary.txt has one line per run.
set -uo pipefail
cd "$(dirname "$0")/.."
ckpt=${1:-}
log=${2:-/tmp/eval-xcheck}
tol=${TOL:-1e-3}
bin=gpubin/twell
if [ ! -x "$bin" ]; then
  echo "gpu-eval-crosscheck: $bin is missing; build it with scripts/gpu-build.sh on a machine with Go" >&2
  exit 2
fi
mkdir -p "$log"
if [ -z "$ckpt" ]; then
  "$bin" train -preset tiny -device cpu -overwrite -out "$log/tiny" > "$log/train.txt" 2>&1 || { cat "$log/train.txt"; exit 2; }
  ckpt=$log/tiny/checkpoint
fi
rm -rf "$log/data"
"$bin" data -tokenizer "$ckpt/tokenizer.json" -out "$log/data" -sample > "$log/data.txt" 2>&1 || { cat "$log/data.txt"; exit 2; }
evalargs=(-model "$ckpt" -data "$log/data" -max-tokens 20000 -tasks tasks/lastword.jsonl -tasks tasks/nextsentence.jsonl)
: > "$log/summary.txt"

# check NAME DEVICE MLP: twell eval, then eval-crosscheck.py; returns the latter's exit status.
check() {
  local name=$1 dev=$2 path=$3
  if ! "$bin" eval "${evalargs[@]}" -device "$dev" -mlp "$path" -items "$log/items-$name.jsonl" -json "$log/eval-$name.json" > "$log/eval-$name.txt" 2>&1; then
    echo "$name: twell eval failed (see $log/eval-$name.txt)" >> "$log/summary.txt"
    return 2
  fi
  python3 scripts/eval-crosscheck.py "$ckpt" "$log/items-$name.jsonl" --tolerance "$tol" --json "$log/xcheck-$name.json" > "$log/xcheck-$name.txt" 2>&1
  local rc=$?
  echo "$name: exit $rc; $(tail -n 1 "$log/xcheck-$name.txt")" >> "$log/summary.txt"
  return $rc
}

check cpu-dense cpu dense
dense=$?
check cpu-auto cpu auto
auto=$?
if nvidia-smi > /dev/null 2>&1; then
  check cuda-auto cuda auto
  echo "(cuda-auto is for information only) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n 1)" >> "$log/summary.txt"
fi
for f in "$log"/xcheck-*.txt; do
  echo "=== $f"
  cat "$f"
done
echo "(cpu-auto is for information only: exit $auto)" >> "$log/summary.txt"
cat "$log/summary.txt"
[ $dense -eq 2 ] && exit 2
[ $dense -eq 0 ]
