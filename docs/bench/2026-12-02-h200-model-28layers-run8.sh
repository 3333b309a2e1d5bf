#!/bin/bash
# Reproduces 2026-12-02-h200-model-sparselm-1.5b-28layers-run8.* (sparselm-1.5b preset, 28 layers,
# 64 x 2048 prefill, decode at b = 1, 8, 64; seed 9596107621982983358) and PyTorch HF's prefill on
# the same weights: the GPU tests of gpu and gpu/llm, then the model bench, then
# scripts/hf-prefill-bench.py on the saved checkpoint. Build first with scripts/gpu-build.sh, then
# run this on the GPU machine from the repository root with OUT set to a folder for the results.
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $O/gpu.txt
(cd gpu && timeout 150 ../gpubin/gpu.test -test.v -test.run 'TestMLPMatches|TestOverflowStress|TestSmallBatch|TestSharedWorkspace|TestSettled|TestForwardChooses' > $O/gpu-tests.txt 2>&1; echo "gpu tests rc=$?" >> $O/gpu-tests.txt)
(cd gpu/llm && timeout 150 ../../gpubin/gpu_llm.test -test.run 'TestLogits|TestDecode|TestBatched|TestGraph|TestReuse|TestAttention' > $O/llm-tests.txt 2>&1; echo "llm tests rc=$?" >> $O/llm-tests.txt)
pack
cat $O/gpu.txt; grep -E "^(--- FAIL|ok|FAIL|PASS)|rc=|    mlp_test" $O/gpu-tests.txt $O/llm-tests.txt | tail -12
S=9596107621982983358
timeout 200 gpubin/twell bench model -device cuda -preset sparselm-1.5b -seed $S -reps 3 -decode-batch 1,8,64 -save /tmp/slm -json $O/model.json -plot $O/model.png > $O/model.txt 2>&1
echo "rc=$?" >> $O/model.txt; pack; grep -A2 "^   path" $O/model.txt
timeout 90 python3 scripts/hf-prefill-bench.py /tmp/slm -json $O/hf.json > $O/hf.txt 2>&1; echo "hf rc=$?" >> $O/hf.txt; pack; tail -3 $O/hf.txt
