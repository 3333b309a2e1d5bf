#!/bin/bash
# Reproduces the attention and whole-model figures of docs/gpu-llm.md dated 2026-12-03 (H200):
# 1. the gpu/llm tests that run the wgmma attention kernel (probe, long sequences against the plain
#    kernel and the CPU model, bit-identical repeats, the step profiler);
# 2. a 4-layer sparselm-1.5b prefill (64 x 2048 tokens) with the mma.sync attention
#    (TWELL_LLM_ATTENTION=mma) and with the default (auto: the 3-stage wgmma kernel on Hopper),
#    each printing a profiled prefill's milliseconds by step;
# 3. the 28-layer preset with the defaults, decode after 512 cached tokens, saved for
# 4. PyTorch HF's prefill on the same weights.
# Build first with scripts/gpu-build.sh, then run this on the GPU machine from the repository root
# with OUT set to a folder for the results (packed into $OUT/all.tgz after every stage).
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $O/gpu.txt
(cd gpu/llm && timeout 150 ../../gpubin/gpu_llm.test -test.v -test.run 'TestWGMMAProbe|TestAttentionLong|TestAttentionRepeatable|TestProfile' > $O/llm-tests.txt 2>&1; echo "llm tests rc=$?" >> $O/llm-tests.txt)
pack
grep -E "^(--- FAIL|ok|FAIL|PASS)|rc=|vs CPU rel|vs plain" $O/llm-tests.txt | tail -20
S=9596107621982983358
for a in mma auto; do
  TWELL_LLM_ATTENTION=$a timeout 60 gpubin/twell bench model -device cuda -preset sparselm-1.5b -layers 4 -seed $S -reps 3 -decode-batch 1 -decode-steps 4 -json $O/l4-$a.json > $O/l4-$a.txt 2>&1
  echo "rc=$?" >> $O/l4-$a.txt; pack; echo "== 4 layers, attention $a"; grep -E "attention kernel|by step|^  (dense|twell) |rc=" $O/l4-$a.txt
done
echo "== 28 layers"
timeout 200 gpubin/twell bench model -device cuda -preset sparselm-1.5b -seed $S -reps 3 -decode-batch 1,8,64 -decode-context 512 -save /tmp/slm -json $O/model.json -plot $O/model.png > $O/model.txt 2>&1
echo "rc=$?" >> $O/model.txt; pack; grep -E "attention kernel|by step|^  (dense|twell) |rc=" $O/model.txt
timeout 90 python3 scripts/hf-prefill-bench.py /tmp/slm -json $O/hf.json > $O/hf.txt 2>&1; echo "hf rc=$?" >> $O/hf.txt; pack; tail -3 $O/hf.txt
