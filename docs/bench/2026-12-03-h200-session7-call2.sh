#!/bin/bash
# Session 7's second device run (written in session 7, which got no GPU): does the device's compiler
# serialize the D2T wgmmas as ptxas 12.4 does (C7515), does TW_PEEL=1 (peeled first k step,
# write-only first wgmma) make D2T faster, and does TailSorted (tokens ordered by list length before
# t2d_ws) make the split tail faster? Build here: CGO_ENABLED=0 go test -c -o gpubin/gpu.test
# ./gpu && CGO_ENABLED=0 go build -o gpubin/twell ./cmd/twell; run with carry ["gpubin"].
# 1. the D2T/MLP GPU tests with TW_PEEL=1 (correctness of the variant in every MLP path, the sorted
#    tail's bit-identity with the split tail, the length order itself);
# 2. TestD2TVariants: cuBLASLt's gate GEMM, default, pipe, peel, pipe-peel and more, with the
#    device compiler's log for each (C7515 or not), and every variant's output against the default's;
# 3. the HGMMA / WARPGROUP.DEPBAR counts of the CUBINs the device compiled (serialized: about one
#    DEPBAR per HGMMA);
# 4. twell bench ffn at m = 65536, 0.5% uniform: default, TW_PEEL=1, TWELL_TAIL=sorted, both.
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache TWELL_CUBIN_DUMP=/tmp/cubin
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
(cd gpu && TWELL_GPU_DEFINES=-DTW_PEEL=1 timeout 120 ../gpubin/gpu.test -test.v -test.run 'TestD2T[^V]|TestMLPMatches|TestOverflowStress|TestLengthOrder' > $O/gpu-tests-peel.txt 2>&1; echo "gpu tests (TW_PEEL=1) rc=$?" >> $O/gpu-tests-peel.txt)
pack; grep -E "^(--- FAIL|ok|FAIL)|rc=" $O/gpu-tests-peel.txt | tail -8
(cd gpu && TWELL_D2T_VARIANTS=1 timeout 200 ../gpubin/gpu.test -test.v -test.run 'TestD2TVariants' > $O/d2t-variants.txt 2>&1; echo "variants rc=$?" >> $O/d2t-variants.txt)
pack; grep -E "gate GEMM|D2T |C75|rc=" $O/d2t-variants.txt | cut -c1-160
for f in /tmp/cubin/d2t_wgmma*; do
  echo "$(basename $f): $(cuobjdump -sass $f 2>/dev/null | grep -c HGMMA) HGMMA, $(cuobjdump -sass $f 2>/dev/null | grep -c 'WARPGROUP.DEPBAR') WARPGROUP.DEPBAR"
done > $O/cubin-depbar.txt 2>&1
pack; cat $O/cubin-depbar.txt | head -12
for v in "0 split" "1 split" "0 sorted" "1 sorted"; do
  set -- $v
  TWELL_GPU_DEFINES=-DTW_PEEL=$1 TWELL_TAIL=$2 timeout 45 gpubin/twell bench ffn -device cuda -m 65536 -density 0.005 -json $O/ffn-peel$1-$2.json > $O/ffn-peel$1-$2.txt 2>&1
  echo "rc=$?" >> $O/ffn-peel$1-$2.txt; pack; echo "== TW_PEEL=$1 TWELL_TAIL=$2"; grep -E "cuda|rc=" $O/ffn-peel$1-$2.txt | tail -3
done
