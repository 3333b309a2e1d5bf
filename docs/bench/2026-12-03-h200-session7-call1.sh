#!/bin/bash
# Session 7's device run (written in session 7, which got no GPU; run it as the first call of the
# next session). Build here: CGO_ENABLED=0 go test -c -o gpubin/llm.test ./gpu/llm &&
# CGO_ENABLED=0 go build -o gpubin/twell ./cmd/twell; then run it with carry ["gpubin"]:
# 1. the GPU tests of gpu/llm that run the wgmma attention kernel (if they fail, the rest runs on
#    the mma.sync kernel only);
# 2. the 4-layer preset's prefill with the mma.sync kernel and each wgmma build (TWELL_LLM_ATTENTION =
#    mma, wgmma2, wgmma-ov, wgmma3), each printing a profiled prefill's ms by step;
# 3. the 4-layer preset again with the build whose attention was fastest and TWELL_TAIL=sorted;
# 4. the 28-layer preset with that build, saved for
# 5. PyTorch HF prefill on the same weights.
# Outputs packed into $OUT/all.tgz after every stage.
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $O/gpu.txt
(cd gpu/llm && timeout 150 ../../gpubin/llm.test -test.v -test.run 'TestWGMMAProbe|TestAttentionLong|TestAttentionRepeatable|TestProfile' > $O/llm-tests.txt 2>&1; echo "llm tests rc=$?" >> $O/llm-tests.txt)
pack
grep -E "^(--- FAIL|ok|FAIL|PASS)|rc=|vs CPU rel|vs plain" $O/llm-tests.txt | tail -20
builds="mma wgmma2 wgmma-ov wgmma3"
if ! grep -q "llm tests rc=0" $O/llm-tests.txt; then
  grep -B2 -A8 -- "--- FAIL" $O/llm-tests.txt | head -60
  builds="mma"  # still profile the 28-layer model and run HF, on the mma.sync attention
fi
S=9596107621982983358
l4() {
  TWELL_LLM_ATTENTION=$1 timeout 60 gpubin/twell bench model -device cuda -preset sparselm-1.5b -layers 4 -seed $S -reps 3 -decode-batch 1 -decode-steps 4 -json $O/l4-$1.json > $O/l4-$1.txt 2>&1
  echo "rc=$?" >> $O/l4-$1.txt; pack; echo "== 4 layers, $1"; grep -E "attention kernel|by step|^  (dense|twell) |rc=" $O/l4-$1.txt
}
for a in $builds; do l4 $a; done
best=$(python3 - "$O" <<'PY'
import json, sys
best, name = None, "mma"
for a in ["mma", "wgmma2", "wgmma-ov", "wgmma3"]:
    try:
        rs = json.load(open(f"{sys.argv[1]}/l4-{a}.json"))
        ms = [r["prefill_step_ms"]["attention"] for r in rs if r["path"] == "twell"][0]
    except Exception:
        continue
    if best is None or ms < best:
        best, name = ms, a
print(name)
PY
)
# The sorted split tail (TWELL_TAIL=sorted) at the model level, on the chosen attention: compare
# the "mlp" step with l4-$best's.
TWELL_LLM_ATTENTION=$best TWELL_TAIL=sorted timeout 60 gpubin/twell bench model -device cuda -preset sparselm-1.5b -layers 4 -seed $S -reps 3 -decode-batch 1 -decode-steps 4 -json $O/l4-$best-sorted.json > $O/l4-$best-sorted.txt 2>&1
echo "rc=$?" >> $O/l4-$best-sorted.txt; pack; echo "== 4 layers, $best, sorted tail"; grep -E "by step|^  (dense|twell) |rc=" $O/l4-$best-sorted.txt
echo "== 28 layers, $best"
TWELL_LLM_ATTENTION=$best timeout 150 gpubin/twell bench model -device cuda -preset sparselm-1.5b -seed $S -reps 3 -decode-batch 1,8,64 -save /tmp/slm -json $O/model.json -plot $O/model.png > $O/model.txt 2>&1
echo "rc=$?" >> $O/model.txt; pack; grep -E "attention kernel|by step|^  (dense|twell) |rc=" $O/model.txt
timeout 70 python3 scripts/hf-prefill-bench.py /tmp/slm -json $O/hf.json > $O/hf.txt 2>&1; echo "hf rc=$?" >> $O/hf.txt; pack; tail -3 $O/hf.txt
