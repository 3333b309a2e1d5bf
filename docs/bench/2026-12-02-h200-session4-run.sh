#!/bin/bash
# Session 4, device call 4 (final): GPU tests, MLP benches, full model + HF, variants.
# Outputs are packed after every stage, so a timeout keeps what finished.
cd "$(dirname "$0")/.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache TWELL_CUBIN_DUMP=/tmp/cubin
L=$O/log.txt
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $L 2>&1
(cd gpu && timeout 90 ../gpubin/gpu.test -test.v -test.run 'TestD2T[^V]|TestMLP|TestOverflow|TestForward|TestNewMLP|TestShared|TestSettled|TestChoose' -test.timeout 85s) >> $L 2>&1; echo "gpu tests rc=$?" >> $L
grep -E -- '--- FAIL|rc=|panic' $L | head -20; echo "passed: $(grep -c -- '--- PASS' $L)"
for f in /tmp/cubin/d2t*; do echo "$f: $(cuobjdump -sass $f 2>/dev/null | grep -c HGMMA) HGMMA"; done >> $L
(cd gpu/llm && timeout 90 ../../gpubin/llm.test -test.v -test.timeout 85s) > $O/llm.txt 2>&1; echo "llm tests rc=$?" >> $O/llm.txt
grep -E -- '^--- (PASS|FAIL)|rc=|panic' $O/llm.txt | head -20
if grep -q -- "--- FAIL: TestGraph" $O/llm.txt; then export TWELL_GRAPHS=0; echo "graph test failed: model bench without graphs"; fi
pack
B=gpubin/twell
for c in u65536 s65536 u4096; do
  case $c in
    u65536) a="-m 65536 -density 0.005,0.02,0.05 -json $O/ffn-uniform-65536.json -plot $O/ffn-uniform-65536.png"; t=90;;
    s65536) a="-m 65536 -density 0.005,0.02 -dist skewed -json $O/ffn-skewed-65536.json -plot $O/ffn-skewed-65536.png"; t=75;;
    u4096) a="-m 4096 -density 0.005,0.02,0.05 -json $O/ffn-uniform-4096.json -plot $O/ffn-uniform-4096.png"; t=45;;
  esac
  timeout $t $B bench ffn -device cuda $a >> $O/bench.txt 2>&1; echo "bench $c rc=$?" >> $O/bench.txt
  pack
done
grep -E "density .*: dense|rc=" $O/bench.txt
timeout 240 $B bench model -device cuda -preset sparselm-1.5b -json $O/model.json -save /tmp/slm -reps 3 > $O/model.txt 2>&1
echo "bench model rc=$?" >> $O/model.txt; pack
timeout 90 python3 scripts/hf-prefill-bench.py /tmp/slm -json $O/hf.json >> $O/model.txt 2>&1
echo "hf rc=$?" >> $O/model.txt; pack
grep -v "^  [a-z]*: \(prefill\|decode\)" $O/model.txt | tail -12
