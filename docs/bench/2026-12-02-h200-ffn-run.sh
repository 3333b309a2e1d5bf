#!/bin/bash
# Device call: D2T/tail variants, GPU tests, SASS check, MLP benchmarks.
cd "$(dirname "$0")/.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_CUBIN_DUMP=/tmp/cubin TWELL_KERNEL_CACHE=/tmp/kcache
L=$O/log.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $L 2>&1
T=gpubin/gpu.test
VAR=1; SKIP=()
(cd gpu && timeout 45 ../$T -test.v -test.run 'TestD2TMatchesFloat64/wgmma-pipe' -test.timeout 40s) > $O/pipe-check.txt 2>&1
prc=$?; echo "pipe check rc=$prc" | tee -a $L; tail -5 $O/pipe-check.txt
if [ $prc != 0 ]; then VAR=nopipe; SKIP=(-test.skip 'pipe'); fi
if [ -n "$VARIANTS" ]; then
  (cd gpu && TWELL_D2T_VARIANTS=$VAR timeout 120 ../$T -test.v -test.run TestD2TVariants -test.timeout 115s) > $O/variants.txt 2>&1
  echo "variants rc=$?" >> $O/variants.txt
  d=$(awk '$2=="D2T" && ($3=="default"||$3=="wait0"||$3=="pipe"||$3=="pipe-wait0") && $4+0>0 {print $4, $3}' $O/variants.txt | sort -n | head -1 | cut -d' ' -f2)
  tl=$(awk '$2=="tail" && $4=="sparse" {print $5, $3}' $O/variants.txt | sort -n | head -1 | cut -d' ' -f2 | tr -d :)
  [ -n "$tl" ] && export TWELL_TAIL=$tl
  DEF=""; case $d in *wait0) DEF="-DTW_WAIT=0";; esac; case $d in pipe*) export TWELL_D2T_KERNEL=wgmma-pipe;; esac
  if grep -q -- "--- FAIL: TestD2TVariants" $O/variants.txt; then unset TWELL_D2T_KERNEL; DEF=""; fi
  export TWELL_GPU_DEFINES="$DEF"; echo "=== chosen D2T $d (kernel ${TWELL_D2T_KERNEL:-auto}), defines '$DEF', tail ${TWELL_TAIL:-auto}" | tee -a $L
fi
if [ -n "$RUN1" ]; then
  (cd gpu && timeout 150 ../$T -test.v -test.run "$RUN1" "${SKIP[@]}" -test.timeout 145s) >> $L 2>&1
  echo "gpu tests rc=$?" >> $L
fi
if [ -n "$LLM" ]; then
  (cd gpu/llm && timeout 150 ../../gpubin/llm.test -test.v -test.timeout 145s) > $O/llm.txt 2>&1
  echo "llm tests rc=$?" >> $O/llm.txt
  grep -E -- '--- (PASS|FAIL)|rc=|panic' $O/llm.txt | head -30
fi
for f in /tmp/cubin/d2t*; do echo "$f: $(cuobjdump -sass $f 2>/dev/null | grep -c HGMMA) HGMMA, $(cuobjdump -sass $f 2>/dev/null | grep -c 'HMMA') HMMA"; done >> $L
grep -E -- '--- (PASS|FAIL)|rc=|HGMMA|panic|error' $L | grep -v "^        ---" | head -60
grep -E 'D2T |t2d|t2u|tail|registers|rc=|C75|spill|error' $O/variants.txt 2>/dev/null | head -40
B=gpubin/twell
for c in ${BENCH:-u65536 s65536 u4096}; do
  case $c in
    u65536) a="-m 65536 -density 0.005,0.02,0.05 -json $O/ffn-uniform-65536.json -plot $O/ffn-uniform-65536.png";;
    s65536) a="-m 65536 -density 0.005,0.02 -dist skewed -json $O/ffn-skewed-65536.json -plot $O/ffn-skewed-65536.png";;
    u4096) a="-m 4096 -density 0.005,0.02,0.05 -json $O/ffn-uniform-4096.json -plot $O/ffn-uniform-4096.png";;
    *) continue;;
  esac
  timeout ${T3:-100} $B bench ffn -device cuda $a >> $O/bench.txt 2>&1; echo "bench $c rc=$?" >> $O/bench.txt
done
grep -E "dense .* ms|rc=" $O/bench.txt
if [ -n "$MODEL" ]; then
  timeout ${TM:-300} $B bench model -device cuda -preset sparselm-1.5b -json $O/model.json -save /tmp/slm $MODEL > $O/model.txt 2>&1
  echo "bench model rc=$?" >> $O/model.txt
  timeout 150 python3 scripts/hf-prefill-bench.py /tmp/slm -json $O/hf.json >> $O/model.txt 2>&1
  echo "hf rc=$?" >> $O/model.txt
  cat $O/model.txt | grep -v "^  [a-z]*: \(prefill\|decode\)"
fi
cp -r /tmp/cubin $O/ 2>/dev/null; tar czf $OUT/all.tgz -C $O .
