#!/bin/bash
# Session 5, device calls 4-7: gpu and gpu/llm tests, per-kernel times of decode steps on a 2-layer
# model (ncu), then the full sparselm-1.5b model bench and, with HF=1, PyTorch HF's prefill on the
# same weights. Calls 4-6 ran it with HF=1 (NCU_DECODE=1 in call 4, 1,4 in calls 5 and 6); call 7
# with HF=0 and without TestSettled and TestOverflow.
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
  $B bench model -device cuda -preset sparselm-1.5b -layers 2 -batch 2 -prompt-len 256 -reps 1 -decode-batch ${NCU_DECODE:-1} -decode-steps 8 > $O/ncu-dec-model.txt 2>&1
tail -4 $O/ncu-dec-model.txt | head -3
pack
if grep -q "llm tests rc=0" $O/llm-tests.txt; then
  timeout 240 $B bench model -device cuda -preset sparselm-1.5b -json $O/model.json -save /tmp/slm -reps 3 > $O/model.txt 2>&1
  echo "bench model rc=$?" >> $O/model.txt; pack
  if [ "${HF:-1}" = 1 ]; then
    timeout 90 python3 scripts/hf-prefill-bench.py /tmp/slm -json $O/hf.json >> $O/model.txt 2>&1
    echo "hf rc=$?" >> $O/model.txt; pack
  fi
  grep -v "^  [a-z]*: \(prefill\|decode\) " $O/model.txt | tail -10
fi
