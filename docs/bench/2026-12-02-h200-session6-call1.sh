#!/bin/bash
# Session 6, device call 1: GPU tests of gpu and gpu/llm (validates session 5's review refactor),
# the HF cross-check, then where prefill time goes at the real batch (64 x 2048): the model bench
# at 2 and 6 layers (slope = per layer, intercept = per pass) and ncu per-kernel times of 2 layers.
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
B=gpubin/twell
(cd gpu && timeout 200 ../gpubin/gpu.test -test.v > $O/gpu-tests.txt 2>&1; echo "gpu tests rc=$?" >> $O/gpu-tests.txt)
(cd gpu/llm && timeout 200 ../../gpubin/llm.test -test.v > $O/llm-tests.txt 2>&1; echo "llm tests rc=$?" >> $O/llm-tests.txt)
pack
grep -E "^(--- FAIL|ok|FAIL|PASS)|rc=" $O/gpu-tests.txt $O/llm-tests.txt | tail -20
timeout 150 bash scripts/gpu-hf-crosscheck.sh > $O/hf.txt 2>&1; pack
grep -E "rc=|max|greedy|PASS|FAIL" $O/hf.txt | tail -12
for L in 2 6; do
  timeout 100 $B bench model -device cuda -preset sparselm-1.5b -layers $L -batch 64 -reps 3 -decode-batch 1,8,64 -decode-steps 16 -json $O/model-L$L.json > $O/model-L$L.txt 2>&1
  echo "rc=$?" >> $O/model-L$L.txt; pack
  grep -A3 "^   path" $O/model-L$L.txt
done
timeout 150 ncu --clock-control none --cache-control none --launch-count 400 --metrics gpu__time_duration.sum,launch__grid_size --csv --log-file $O/ncu-prefill.csv \
  $B bench model -device cuda -preset sparselm-1.5b -layers 2 -batch 64 -reps 1 -decode-batch 64 -decode-steps 4 > $O/ncu-prefill-model.txt 2>&1
echo "ncu rc=$?" >> $O/ncu-prefill-model.txt; pack
tail -2 $O/ncu-prefill-model.txt; wc -l $O/ncu-prefill.csv
