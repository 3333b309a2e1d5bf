#!/bin/bash
# Reproduces the MLP-block figure of docs/gpu-twell.md dated 2026-12-03 (H200): the sparse MLP with
# its defaults (peeled D2T, sorted split tail) at m = 65536, 0.5% uniform, d = 2048, f = 5632.
# 1. the D2T and MLP GPU tests (every path against float64, overflow stress, the length order);
# 2. the HGMMA and WARPGROUP.DEPBAR counts of the D2T CUBINs the GPU machine's NVRTC compiled
#    (a serialized mainloop shows about one DEPBAR per HGMMA);
# 3. `twell bench ffn -device cuda -m 65536 -density 0.005`.
# Build first with scripts/gpu-build.sh, then run this on the GPU machine from the repository root
# with OUT set to a folder for the results (packed into $OUT/all.tgz after every stage).
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache TWELL_CUBIN_DUMP=/tmp/cubin
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
(cd gpu && timeout 120 ../gpubin/gpu.test -test.v -test.run 'TestD2T[^V]|TestMLPMatches|TestOverflowStress|TestLengthOrder' > $O/gpu-tests.txt 2>&1; echo "gpu tests rc=$?" >> $O/gpu-tests.txt)
pack; grep -E "^(--- FAIL|ok|FAIL)|rc=" $O/gpu-tests.txt | tail -8
for f in /tmp/cubin/d2t_wgmma*; do
  echo "$(basename $f): $(cuobjdump -sass $f 2>/dev/null | grep -c HGMMA) HGMMA, $(cuobjdump -sass $f 2>/dev/null | grep -c 'WARPGROUP.DEPBAR') WARPGROUP.DEPBAR"
done > $O/cubin-depbar.txt 2>&1
pack; head -12 $O/cubin-depbar.txt
timeout 60 gpubin/twell bench ffn -device cuda -m 65536 -density 0.005 -json $O/ffn-65536.json > $O/ffn-65536.txt 2>&1
echo "rc=$?" >> $O/ffn-65536.txt; pack; grep -E "cuda|rc=" $O/ffn-65536.txt | tail -3
