#!/usr/bin/env bash
# HF cross-check on the GPU machine (which has PyTorch and transformers):
# makes checkpoints with PyTorch (scripts/hf-crosscheck-model.py), then
# compares the logits and greedy tokens of twell's CPU engine (cpu/llm) and
# GPU engine (gpu/llm) with them. Build the two test binaries first, on a
# machine with Go:
#   scripts/gpu-build.sh                      # gpubin/gpu_llm.test among others
#   CGO_ENABLED=0 go test -c -o gpubin/cpu_llm.test ./cpu/llm
#
#   scripts/gpu-hf-crosscheck.sh [LOGDIR]     (default /tmp/hf-logs)
set -uo pipefail
cd "$(dirname "$0")/.."
log=${1:-/tmp/hf-logs}
mkdir -p "$log"
hf=$(mktemp -d)
python3 scripts/hf-crosscheck-model.py "$hf" > "$log/hf-make.txt" 2>&1
echo "make rc=$?" >> "$log/hf-make.txt"
(cd cpu/llm && TWELL_HF_DIR=$hf timeout 120 ../../gpubin/cpu_llm.test -test.run TestHFCrossCheck -test.v) > "$log/hf-cpu.txt" 2>&1
echo "cpu rc=$?" >> "$log/hf-cpu.txt"
(cd gpu/llm && TWELL_HF_DIR=$hf TWELL_REQUIRE_GPU=1 timeout 120 ../../gpubin/gpu_llm.test -test.run TestHFCrossCheckGPU -test.v) > "$log/hf-gpu.txt" 2>&1
echo "gpu rc=$?" >> "$log/hf-gpu.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv >> "$log/hf-make.txt"
cat "$log/hf-make.txt" "$log/hf-cpu.txt" "$log/hf-gpu.txt"
