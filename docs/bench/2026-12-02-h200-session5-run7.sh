#!/bin/bash
# Session 5, device call 7: q/k/v projection + RoPE + cache write fused for decode steps, weight
# loads issued before x is staged; tests, decode kernel times (ncu), the full model bench.
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
B=gpubin/twell
(cd gpu && timeout 120 ../gpubin/gpu.test -test.v -test.run 'TestSmallBatch|TestMLPMatches|TestForwardChooses' > $O/gpu-tests.txt 2>&1; echo "gpu tests rc=$?" >> $O/gpu-tests.txt)
(cd gpu/llm && timeout 120 ../../gpubin/llm.test -test.v -test.run 'TestLogits|TestDecode|TestBatched|TestGraph|TestAttentionLong' > $O/llm-tests.txt 2>&1; echo "llm tests rc=$?" >> $O/llm-tests.txt)
pack
grep -E "^(--- |ok|FAIL|PASS)|rc=|rel err|diff" $O/gpu-tests.txt $O/llm-tests.txt | grep -v "^.*--- PASS.*/" | tail -30
timeout 80 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum,launch__grid_size --csv --log-file $O/ncu-dec.csv \
  $B bench model -device cuda -preset sparselm-1.5b -layers 2 -batch 2 -prompt-len 256 -reps 1 -decode-batch 1 -decode-steps 8 > $O/ncu-dec-model.txt 2>&1
pack
if grep -q "llm tests rc=0" $O/llm-tests.txt; then
  timeout 200 $B bench model -device cuda -preset sparselm-1.5b -json $O/model.json -reps 3 > $O/model.txt 2>&1
  echo "bench model rc=$?" >> $O/model.txt; pack
  grep -v "^  [a-z]*: \(prefill\|decode\) " $O/model.txt | tail -8
fi
