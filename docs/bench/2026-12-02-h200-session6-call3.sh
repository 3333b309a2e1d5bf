#!/bin/bash
# Session 6, device call 3: tests of heavy-row routing (t2d/t2u send rows with more than
# max(64, 4x mean) active units to the dense fallback); the 28-layer model on one seed with and
# without it (TWELL_HEAVY_ROWS=0).
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
B=gpubin/twell
(cd gpu && timeout 150 ../gpubin/gpu.test -test.v -test.run 'TestHeavy|TestMLPMatches|TestOverflowStress|TestSmallBatch|TestSharedWorkspace|TestSettled|TestForwardChooses' > $O/gpu-tests.txt 2>&1; echo "gpu tests rc=$?" >> $O/gpu-tests.txt)
(cd gpu/llm && timeout 150 ../../gpubin/llm.test -test.run 'TestLogits|TestDecode|TestBatched|TestGraph' > $O/llm-tests.txt 2>&1; echo "llm tests rc=$?" >> $O/llm-tests.txt)
pack
grep -E "^(--- FAIL|ok|FAIL|PASS)|rc=|    mlp_test|TestHeavy" $O/gpu-tests.txt $O/llm-tests.txt | tail -20
for H in 1 0; do
  TWELL_HEAVY_ROWS=$H timeout 220 $B bench model -device cuda -preset sparselm-1.5b -seed 9596107621982983358 -reps 3 -decode-batch 1,8 -json $O/model-heavy$H.json > $O/model-heavy$H.txt 2>&1
  echo "rc=$?" >> $O/model-heavy$H.txt; pack; echo "== heavy rows $H"; grep -A2 "^   path" $O/model-heavy$H.txt
done
