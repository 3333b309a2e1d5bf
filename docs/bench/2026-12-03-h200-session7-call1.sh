#!/bin/bash
# Session 7, device call 1: the wgmma attention kernel (gpu/llm/attn_wgmma.cu). GPU tests of
# gpu/llm that run it (stop if they fail); the 28-layer preset with it (TWELL_LLM_ATTENTION=wgmma2),
# saved for PyTorch HF on the same weights; then, time permitting, the 4-layer preset's prefill with
# the mma.sync kernel and with wgmma2. Every bench prints a profiled prefill's ms by step. Outputs
# packed into $OUT/all.tgz after every stage.
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $O/gpu.txt
(cd gpu/llm && timeout 90 ../../gpubin/llm.test -test.v -test.run 'TestCompileWGMMA|TestWGMMAProbe|TestAttentionLong|TestProfile' > $O/llm-tests.txt 2>&1; echo "llm tests rc=$?" >> $O/llm-tests.txt)
pack
grep -E "^(--- FAIL|ok|FAIL|PASS)|rc=|vs CPU rel|vs plain" $O/llm-tests.txt | tail -20
grep -q "llm tests rc=0" $O/llm-tests.txt || { grep -B2 -A8 -- "--- FAIL" $O/llm-tests.txt | head -60; exit 1; }
S=9596107621982983358
TWELL_LLM_ATTENTION=wgmma2 timeout 150 gpubin/twell bench model -device cuda -preset sparselm-1.5b -seed $S -reps 3 -decode-batch 1,64 -save /tmp/slm -json $O/model.json > $O/model.txt 2>&1
echo "rc=$?" >> $O/model.txt; pack; echo "== 28 layers, wgmma2"; grep -E "attention kernel|by step|^  (dense|twell) |rc=" $O/model.txt
timeout 70 python3 scripts/hf-prefill-bench.py /tmp/slm -json $O/hf.json > $O/hf.txt 2>&1; echo "hf rc=$?" >> $O/hf.txt; pack; tail -3 $O/hf.txt
l4() {
  TWELL_LLM_ATTENTION=$1 timeout 60 gpubin/twell bench model -device cuda -preset sparselm-1.5b -layers 4 -seed $S -reps 3 -decode-batch 1 -decode-steps 4 -json $O/l4-$1.json > $O/l4-$1.txt 2>&1
  echo "rc=$?" >> $O/l4-$1.txt; pack; echo "== 4 layers, $1"; grep -E "attention kernel|by step|^  (dense|twell) |rc=" $O/l4-$1.txt
}
l4 mma
l4 wgmma2
