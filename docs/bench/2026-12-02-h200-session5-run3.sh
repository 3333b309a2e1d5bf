#!/bin/bash
# Session 5, device call 3: tests; attention kernel time (ncu); decode path diagnosis (graph records,
# sparse layers, MLP kernels at b=64); then the full model bench.
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
B=gpubin/twell
(cd gpu && timeout 200 ../gpubin/gpu.test -test.v -test.run 'TestSmallBatch|TestMLPMatches|TestForwardChooses' > $O/gpu-tests.txt 2>&1; echo "gpu tests rc=$?" >> $O/gpu-tests.txt)
(cd gpu/llm && timeout 200 ../../gpubin/llm.test -test.v -test.run 'TestLogits|TestDecode|TestBatched|TestGraph|TestAttentionLong' > $O/llm-tests.txt 2>&1; echo "llm tests rc=$?" >> $O/llm-tests.txt)
pack
grep -E "^(--- |ok|FAIL|PASS)|rc=|rel err" $O/gpu-tests.txt $O/llm-tests.txt | grep -v "^.*--- PASS.*/" | tail -30
timeout 100 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum,launch__grid_size --csv --log-file $O/ncu-attn.csv \
  --kernel-name regex:"attn" --launch-count 12 \
  $B bench model -device cuda -preset sparselm-1.5b -layers 2 -batch 16 -reps 1 -decode-batch 1 -decode-steps 1 > $O/ncu-attn-model.txt 2>&1
grep attn_fa $O/ncu-attn.csv | grep duration | head -4 | cut -c1-40,200-
pack
timeout 100 $B bench model -device cuda -preset sparselm-1.5b -layers 4 -batch 16 -reps 3 -decode-batch 1,4,8,64 -decode-steps 16 > $O/model4.txt 2>&1
tail -5 $O/model4.txt | head -4
pack
timeout 100 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum,launch__grid_size --csv --log-file $O/ncu-mlp.csv \
  --kernel-name regex:"d2t|t2d|t2u|row_fallback|gather|scatter|act_exact|gemv_act|gemv_down|relu|nvjet" \
  $B bench model -device cuda -preset sparselm-1.5b -layers 2 -batch 2 -prompt-len 512 -reps 1 -decode-batch 64 -decode-steps 4 > $O/ncu-mlp-model.txt 2>&1
tail -4 $O/ncu-mlp-model.txt
pack
if grep -q "llm tests rc=0" $O/llm-tests.txt; then
  timeout 240 $B bench model -device cuda -preset sparselm-1.5b -json $O/model.json -save /tmp/slm -reps 3 > $O/model.txt 2>&1
  echo "bench model rc=$?" >> $O/model.txt; pack
  timeout 90 python3 scripts/hf-prefill-bench.py /tmp/slm -json $O/hf.json >> $O/model.txt 2>&1
  echo "hf rc=$?" >> $O/model.txt; pack
  grep -v "^  [a-z]*: \(prefill\|decode\) " $O/model.txt | tail -10
fi
