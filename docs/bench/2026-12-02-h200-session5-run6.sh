#!/bin/bash
# Session 5, device call 6: gemv_act in blocks of 16 units: tests; decode b=1 kernel times (ncu, 2 layers); the full model bench + HF.
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
B=gpubin/twell
(cd gpu && timeout 200 ../gpubin/gpu.test -test.v -test.run 'TestSmallBatch|TestMLPMatches|TestForwardChooses|TestSettled|TestOverflow' > $O/gpu-tests.txt 2>&1; echo "gpu tests rc=$?" >> $O/gpu-tests.txt)
(cd gpu/llm && timeout 200 ../../gpubin/llm.test -test.v -test.run 'TestLogits|TestDecode|TestBatched|TestGraph|TestAttentionLong' > $O/llm-tests.txt 2>&1; echo "llm tests rc=$?" >> $O/llm-tests.txt)
pack
grep -E "^(--- |ok|FAIL|PASS)|rc=|rel err" $O/gpu-tests.txt $O/llm-tests.txt | grep -v "^.*--- PASS.*/" | tail -30
timeout 100 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum,launch__grid_size --csv --log-file $O/ncu-dec.csv \
  $B bench model -device cuda -preset sparselm-1.5b -layers 2 -batch 2 -prompt-len 256 -reps 1 -decode-batch 1,4 -decode-steps 8 > $O/ncu-dec-model.txt 2>&1
tail -4 $O/ncu-dec-model.txt | head -3
pack
if grep -q "llm tests rc=0" $O/llm-tests.txt; then
  timeout 240 $B bench model -device cuda -preset sparselm-1.5b -json $O/model.json -save /tmp/slm -reps 3 > $O/model.txt 2>&1
  echo "bench model rc=$?" >> $O/model.txt; pack
  timeout 90 python3 scripts/hf-prefill-bench.py /tmp/slm -json $O/hf.json >> $O/model.txt 2>&1
  echo "hf rc=$?" >> $O/model.txt; pack
  grep -v "^  [a-z]*: \(prefill\|decode\) " $O/model.txt | tail -10
fi
