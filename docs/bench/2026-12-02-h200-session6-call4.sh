#!/bin/bash
# Session 6, device call 4: heavy rows at max(256, 8x mean), t2d_ws's rotated token order, decode
# logits into a reused page-locked buffer (Engine.ReuseLogits), rope_kv with 8- and 16-byte accesses:
# tests; the 28-layer model on call 3's seed with and without heavy-row routing; per-kernel
# times of a 2-layer model's short-prompt prefill and decode (ncu).
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
B=gpubin/twell
(cd gpu && timeout 150 ../gpubin/gpu.test -test.v -test.run 'TestHeavy|TestMLPMatches|TestOverflowStress|TestSmallBatch|TestSharedWorkspace|TestSettled|TestForwardChooses' > $O/gpu-tests.txt 2>&1; echo "gpu tests rc=$?" >> $O/gpu-tests.txt)
(cd gpu/llm && timeout 150 ../../gpubin/llm.test -test.run 'TestLogits|TestDecode|TestBatched|TestGraph|TestReuse' > $O/llm-tests.txt 2>&1; echo "llm tests rc=$?" >> $O/llm-tests.txt)
pack
grep -E "^(--- FAIL|ok|FAIL|PASS)|rc=|    mlp_test|TestHeavy" $O/gpu-tests.txt $O/llm-tests.txt | tail -20
for H in 1 0; do
  TWELL_HEAVY_ROWS=$H timeout 200 $B bench model -device cuda -preset sparselm-1.5b -seed 9596107621982983358 -reps 3 -decode-batch 1,8,64 -json $O/model-heavy$H.json > $O/model-heavy$H.txt 2>&1
  echo "rc=$?" >> $O/model-heavy$H.txt; pack; echo "== heavy rows $H"; grep -A2 "^   path" $O/model-heavy$H.txt
done
timeout 100 ncu --clock-control none --cache-control none --launch-skip 280 --launch-count 120 --metrics gpu__time_duration.sum,launch__grid_size --csv --log-file $O/ncu-flag.csv \
  $B bench model -device cuda -preset sparselm-1.5b -layers 2 -batch 64 -reps 1 -decode-batch 8 -decode-steps 4 > $O/ncu-flag-model.txt 2>&1
echo "ncu rc=$?" >> $O/ncu-flag-model.txt; pack
