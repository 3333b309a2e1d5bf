#!/bin/bash
# Session 4, device call 5: full-model bench after the MLP paths settle, + PyTorch HF prefill.
cd "$(dirname "$0")/.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $O/log.txt 2>&1
B=gpubin/twell
timeout 240 $B bench model -device cuda -preset sparselm-1.5b -json $O/model.json -save /tmp/slm -reps 3 > $O/model.txt 2>&1
echo "bench model rc=$?" >> $O/model.txt; pack
timeout 90 python3 scripts/hf-prefill-bench.py /tmp/slm -json $O/hf.json >> $O/model.txt 2>&1
echo "hf rc=$?" >> $O/model.txt; pack
grep -v "^  [a-z]*: \(prefill\|decode\) " $O/model.txt | tail -16
