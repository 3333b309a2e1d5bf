#!/bin/bash
# Reproduces run 4 of 2026-12-02-h200-ffn.md (MLP block on an H200, paths timed in turns with L2
# flushed): the GPU tests of package gpu, the HGMMA count of the compiled D2T kernels, and
# `twell bench ffn -device cuda` at m = 65536 (uniform and skewed) and m = 4096 (uniform).
# Build first with scripts/gpu-build.sh, then run this on the GPU machine from the repository root
# with OUT set to a folder for the results (packed into $OUT/all.tgz after every stage, so a
# timeout keeps what finished).
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache TWELL_CUBIN_DUMP=/tmp/cubin
L=$O/log.txt
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv > $L 2>&1
(cd gpu && timeout 90 ../gpubin/gpu.test -test.v -test.run 'TestD2T[^V]|TestMLP|TestOverflow|TestForward|TestNewMLP|TestShared|TestSettled|TestChoose' -test.timeout 85s) >> $L 2>&1; echo "gpu tests rc=$?" >> $L
grep -E -- '--- FAIL|rc=|panic' $L | head -20; echo "passed: $(grep -c -- '--- PASS' $L)"
for f in /tmp/cubin/d2t*; do echo "$f: $(cuobjdump -sass $f 2>/dev/null | grep -c HGMMA) HGMMA"; done >> $L
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
