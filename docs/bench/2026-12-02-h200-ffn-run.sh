#!/bin/bash
# One device call: D2T/T2D variants (the winners become TWELL_GPU_DEFINES),
# GPU tests, SASS check, MLP benchmarks. Logs under $OUT.
cd "$(dirname "$0")/.."
O=${OUT:-/tmp/out}; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_CUBIN_DUMP=/tmp/cubin TWELL_KERNEL_CACHE=/tmp/kcache
L=$O/log.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $L 2>&1
T=gpubin-gpu4/gpu.test
if [ -n "$VARIANTS" ]; then
  (cd gpu && TWELL_D2T_VARIANTS=1 timeout 120 ../$T -test.v -test.run TestD2TVariants -test.timeout 115s) > $O/variants.txt 2>&1
  echo "variants rc=$?" >> $O/variants.txt
  d=$(awk '$2=="D2T" && ($3=="default"||$3=="wait0"||$3=="pwarp"||$3=="pwarp-wait0") {print $4, $3}' $O/variants.txt | sort -n | head -1 | cut -d' ' -f2)
  t=$(awk '$3=="default" && $2=="t2d" {print $4, "default"} $3=="2" && $2=="t2d" {print $5, "minb2"}' $O/variants.txt | sort -n | head -1 | cut -d' ' -f2)
  DEF=""; case $d in *wait0) DEF="-DTW_WAIT=0";; esac; case $d in pwarp*) export TWELL_D2T_KERNEL=wgmma-pw;; esac
  if grep -q -- "--- FAIL: TestD2TVariants" $O/variants.txt; then unset TWELL_D2T_KERNEL; DEF=""; fi
  [ "$t" = minb2 ] && DEF="$DEF -DTW_T2D_MINB=2"
  export TWELL_GPU_DEFINES="$DEF"; echo "=== chosen variants: D2T $d (kernel ${TWELL_D2T_KERNEL:-auto}), T2D $t, defines '$DEF'" | tee -a $L
fi
if [ -n "$RUN1" ]; then
  SK=(); [ -n "$VARIANTS" ] && ! grep -q "D2T pwarp " $O/variants.txt && SK=(-test.skip 'TestD2TMatchesFloat64/wgmma-pw')
  (cd gpu && timeout 170 ../$T -test.v -test.run "$RUN1" "${SK[@]}" -test.timeout 165s) >> $L 2>&1
  echo "tests rc=$?" >> $L
fi
for f in /tmp/cubin/d2t*; do echo "$f: $(cuobjdump -sass $f 2>/dev/null | grep -c HGMMA) HGMMA, $(cuobjdump -sass $f 2>/dev/null | grep -c 'HMMA') HMMA"; done >> $L
grep -E -- '--- (PASS|FAIL)|rc=|HGMMA|panic' $L | grep -v "^        ---" | head -40
grep -E 'D2T |t2d|tail|registers|rc=|C75|spill' $O/variants.txt 2>/dev/null | head -40
B=gpubin-gpu4/twell
for c in ${BENCH:-u65536 s65536 u4096}; do
  case $c in
    u65536) a="-m 65536 -density 0.005,0.02,0.05 -json $O/ffn-uniform-65536.json -plot $O/ffn-uniform-65536.png";;
    s65536) a="-m 65536 -density 0.005,0.02 -dist skewed -json $O/ffn-skewed-65536.json";;
    u4096) a="-m 4096 -density 0.005,0.02,0.05 -json $O/ffn-uniform-4096.json -plot $O/ffn-uniform-4096.png";;
    *) continue;;
  esac
  timeout ${T3:-100} $B bench ffn -device cuda $a >> $O/bench.txt 2>&1; echo "bench $c rc=$?" >> $O/bench.txt
done
grep -E "dense .* ms|rc=" $O/bench.txt
