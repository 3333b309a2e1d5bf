#!/bin/bash
# Session 6, device call 5 (final): tests; the 28-layer model with this session's code and, on
# the same seed and card, with session 5's final binary (gpubin/twell-s5, built from 1ed41be);
# PyTorch HF prefill on the same weights. (The session-5 binary runs only with S5=1; call 5 ran without.)
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $O/gpu.txt
(cd gpu && timeout 150 ../gpubin/gpu.test -test.v -test.run 'TestMLPMatches|TestOverflowStress|TestSmallBatch|TestSharedWorkspace|TestSettled|TestForwardChooses' > $O/gpu-tests.txt 2>&1; echo "gpu tests rc=$?" >> $O/gpu-tests.txt)
(cd gpu/llm && timeout 150 ../../gpubin/llm.test -test.run 'TestLogits|TestDecode|TestBatched|TestGraph|TestReuse|TestAttention' > $O/llm-tests.txt 2>&1; echo "llm tests rc=$?" >> $O/llm-tests.txt)
pack
cat $O/gpu.txt; grep -E "^(--- FAIL|ok|FAIL|PASS)|rc=|    mlp_test" $O/gpu-tests.txt $O/llm-tests.txt | tail -12
S=9596107621982983358
timeout 200 gpubin/twell bench model -device cuda -preset sparselm-1.5b -seed $S -reps 3 -decode-batch 1,8,64 -save /tmp/slm -json $O/model.json > $O/model.txt 2>&1
echo "rc=$?" >> $O/model.txt; pack; echo "== session 6"; grep -A2 "^   path" $O/model.txt
timeout 90 python3 scripts/hf-prefill-bench.py /tmp/slm -json $O/hf.json > $O/hf.txt 2>&1; echo "hf rc=$?" >> $O/hf.txt; pack; tail -3 $O/hf.txt
[ -n "$S5" ] && timeout 200 gpubin/twell-s5 bench model -device cuda -preset sparselm-1.5b -seed $S -reps 3 -decode-batch 1,8,64 -json $O/model-s5.json > $O/model-s5.txt 2>&1
echo "rc=$?" >> $O/model-s5.txt; pack; echo "== session 5 binary"; grep -A2 "^   path" $O/model-s5.txt
