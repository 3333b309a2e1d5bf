#!/bin/bash
# Session 5, device call 2: gpu + gpu/llm tests (flash attention, small-batch MLP, gemv projections),
# per-kernel times (ncu) of a 2-layer model, decode A/B of the gemv projections, then the full model bench.
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
B=gpubin/twell
(cd gpu && timeout 200 ../gpubin/gpu.test -test.v -test.run 'TestCompile|TestSmallBatch|TestMLPMatches|TestOverflow|TestForwardChooses|TestShared|TestD2TMatches' > $O/gpu-tests.txt 2>&1; echo "gpu tests rc=$?" >> $O/gpu-tests.txt)
pack
(cd gpu/llm && timeout 200 ../../gpubin/llm.test -test.v -test.run 'TestCompile|TestLogits|TestDecode|TestBatched|TestForwardErrors|TestGraph|TestAttentionLong' > $O/llm-tests.txt 2>&1; echo "llm tests rc=$?" >> $O/llm-tests.txt)
pack
grep -E "^(--- |ok|FAIL|PASS)|rc=" $O/gpu-tests.txt $O/llm-tests.txt | grep -v "^.*--- PASS.*/" | tail -40
timeout 120 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum,launch__grid_size --csv --log-file $O/ncu2.csv \
  --kernel-name regex:"attn|gemv|add_rms|rope|nvjet" --launch-count 600 \
  $B bench model -device cuda -preset sparselm-1.5b -layers 2 -batch 16 -reps 1 -decode-batch 1,4 -decode-steps 2 > $O/ncu2-model.txt 2>&1
pack
for g in 1 0; do
  TWELL_GEMV=$g timeout 100 $B bench model -device cuda -preset sparselm-1.5b -layers 4 -batch 16 -reps 3 -decode-batch 1,4,8,64 -decode-steps 16 > $O/model4-gemv$g.txt 2>&1
  echo "rc=$?" >> $O/model4-gemv$g.txt; tail -4 $O/model4-gemv$g.txt | head -3
done
pack
if grep -q "llm tests rc=0" $O/llm-tests.txt; then
  timeout 240 $B bench model -device cuda -preset sparselm-1.5b -json $O/model.json -save /tmp/slm -reps 3 > $O/model.txt 2>&1
  echo "bench model rc=$?" >> $O/model.txt; pack
  timeout 90 python3 scripts/hf-prefill-bench.py /tmp/slm -json $O/hf.json >> $O/model.txt 2>&1
  echo "hf rc=$?" >> $O/model.txt; pack
  grep -v "^  [a-z]*: \(prefill\|decode\) " $O/model.txt | tail -12
fi
