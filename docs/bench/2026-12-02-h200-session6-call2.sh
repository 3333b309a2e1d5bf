#!/bin/bash
# Session 6, device call 2: tests of the flagged-row kernels (gemv.cu LIST forms); the two sparse
# tails at m = 131072 and low densities (the model's prefill MLP calls); per-kernel times of a
# 2-layer model whose short prompts flag rows (ncu); the 28-layer model with each tail.
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
B=gpubin/twell
(cd gpu && timeout 150 ../gpubin/gpu.test -test.v -test.run 'TestMLPMatches|TestOverflowStress|TestSmallBatch|TestSharedWorkspace|TestSettled|TestForwardChooses|TestCompile' > $O/gpu-tests.txt 2>&1; echo "gpu tests rc=$?" >> $O/gpu-tests.txt)
(cd gpu/llm && timeout 150 ../../gpubin/llm.test -test.run 'TestLogits|TestDecode|TestBatched|TestGraph' > $O/llm-tests.txt 2>&1; echo "llm tests rc=$?" >> $O/llm-tests.txt)
pack
grep -E "^(--- FAIL|ok|FAIL|PASS)|rc=|    mlp_test" $O/gpu-tests.txt $O/llm-tests.txt | tail -20
for T in warp split; do
  TWELL_TAIL=$T timeout 120 $B bench ffn -device cuda -m 131072 -density 0.001,0.005,0.01 -dist skewed -reps 10 -json $O/ffn-$T.json > $O/ffn-$T.txt 2>&1
  echo "rc=$?" >> $O/ffn-$T.txt; pack; echo "== tail $T"; grep -v "^  " $O/ffn-$T.txt | tail -8
done
timeout 120 ncu --clock-control none --cache-control none --launch-skip 280 --launch-count 200 --metrics gpu__time_duration.sum,launch__grid_size --csv --log-file $O/ncu-flag.csv \
  $B bench model -device cuda -preset sparselm-1.5b -layers 2 -batch 64 -reps 1 -decode-batch 8 -decode-steps 4 > $O/ncu-flag-model.txt 2>&1
echo "ncu rc=$?" >> $O/ncu-flag-model.txt; pack
for T in warp auto; do
  TWELL_TAIL=$T timeout 200 $B bench model -device cuda -preset sparselm-1.5b -reps 3 -decode-batch 1,8 -json $O/model-$T.json > $O/model-$T.txt 2>&1
  echo "rc=$?" >> $O/model-$T.txt; pack; echo "== model tail $T"; grep -A2 "^   path" $O/model-$T.txt
done
