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
# (twell train -preset tiny, on the CPU) and checked. The float32 check is
# twell's CPU engine (-device cpu) against PyTorch, tolerance 1e-3 nats per
# token (TOL overrides); its exit status is this script's. When a GPU is
# present, twell's GPU engine (bf16) is compared too, for information only.
# Logs, the items files and the JSON summaries go to LOGDIR.
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
  "$bin" train -preset tiny -device cpu -overwrite -out "$log/tiny" > "$log/train.txt" 2>&1 || { cat "$log/train.txt"; exit 1; }
  ckpt=$log/tiny/checkpoint
fi
rm -rf "$log/data"
"$bin" data -tokenizer "$ckpt/tokenizer.json" -out "$log/data" -sample > "$log/data.txt" 2>&1 || { cat "$log/data.txt"; exit 1; }
evalargs=(-model "$ckpt" -data "$log/data" -max-tokens 20000 -tasks tasks/lastword.jsonl -tasks tasks/nextsentence.jsonl)

"$bin" eval "${evalargs[@]}" -device cpu -items "$log/items-cpu.jsonl" -json "$log/eval-cpu.json" > "$log/eval-cpu.txt" 2>&1 ||
  { cat "$log/eval-cpu.txt"; exit 1; }
python3 scripts/eval-crosscheck.py "$ckpt" "$log/items-cpu.jsonl" --tolerance "$tol" --json "$log/xcheck-cpu.json" > "$log/xcheck-cpu.txt" 2>&1
status=$?
echo "twell cpu (float32) vs PyTorch: exit $status" >> "$log/xcheck-cpu.txt"

if nvidia-smi > /dev/null 2>&1; then
  if "$bin" eval "${evalargs[@]}" -device cuda -items "$log/items-cuda.jsonl" -json "$log/eval-cuda.json" > "$log/eval-cuda.txt" 2>&1; then
    python3 scripts/eval-crosscheck.py "$ckpt" "$log/items-cuda.jsonl" --tolerance "$tol" --json "$log/xcheck-cuda.json" > "$log/xcheck-cuda.txt" 2>&1
    echo "twell cuda (bf16, for information) vs PyTorch: exit $?" >> "$log/xcheck-cuda.txt"
  else
    echo "twell eval -device cuda failed (for information only)" >> "$log/xcheck-cuda.txt"
    cat "$log/eval-cuda.txt" >> "$log/xcheck-cuda.txt"
  fi
  nvidia-smi --query-gpu=name,driver_version --format=csv >> "$log/xcheck-cuda.txt"
  cat "$log/xcheck-cuda.txt"
fi
cat "$log/eval-cpu.txt" "$log/xcheck-cpu.txt"
exit $status
