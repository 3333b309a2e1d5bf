#!/bin/bash
# HF cross-check on the GPU machine: makes the checkpoints with PyTorch
# (scripts/hf-crosscheck-model.py), then compares twell's CPU (model.test)
# and GPU (llm.test) logits and greedy tokens with them. Build the two test
# binaries first, on a machine with Go:
#   CGO_ENABLED=0 go test -c -o gpubin/model.test ./model
#   CGO_ENABLED=0 go test -c -o gpubin/llm.test ./gpu/llm
# Logs go to /tmp/o, and to $OUT/hf.tgz when OUT is set (the device tool).
cd "$(dirname "$0")/.."
O=/tmp/o; mkdir -p $O
python3 scripts/hf-crosscheck-model.py /tmp/hf > $O/hf-make.txt 2>&1; echo "make rc=$?" >> $O/hf-make.txt
(cd model && TWELL_HF_DIR=/tmp/hf timeout 60 ../gpubin/model.test -test.run TestHFCrossCheck -test.v) > $O/hf-cpu.txt 2>&1; echo "cpu rc=$?" >> $O/hf-cpu.txt
(cd gpu/llm && TWELL_HF_DIR=/tmp/hf TWELL_REQUIRE_GPU=1 timeout 90 ../../gpubin/llm.test -test.run TestHFCrossCheckGPU -test.v) > $O/hf-gpu.txt 2>&1; echo "gpu rc=$?" >> $O/hf-gpu.txt
nvidia-smi --query-gpu=name,driver_version --format=csv >> $O/hf-make.txt
cat $O/hf-make.txt $O/hf-cpu.txt $O/hf-gpu.txt
if [ -n "$OUT" ]; then tar czf "$OUT/hf.tgz" -C $O .; fi
