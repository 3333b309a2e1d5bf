#!/bin/bash
# Reproduces the per-kernel times of docs/gpu-llm.md ("Where a layer's time goes", 2026-12-02):
# ncu times of a 16 x 2048-token prefill and of decode steps at b = 1 and 64 on a 2-layer
# sparselm-1.5b, both MLP paths, and PyTorch's SDPA and GEMM yardsticks on the same shapes
# (raw/2026-12-02-h200-torch-attn-gemm.txt). Build first with scripts/gpu-build.sh, then run this
# on the GPU machine from the repository root with OUT set to a folder for the results.
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1 TWELL_KERNEL_CACHE=/tmp/kcache
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
B=gpubin/twell
timeout 100 python3 scripts/torch-attn-ref.py > $O/torch.txt 2>&1; pack
timeout 200 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size --csv --log-file $O/ncu-model.csv \
  $B bench model -device cuda -preset sparselm-1.5b -layers 2 -batch 16 -reps 1 -decode-batch 1,64 -decode-steps 4 > $O/model-ncu.txt 2>&1
echo "ncu rc=$?" >> $O/model-ncu.txt; pack
timeout 120 $B bench model -device cuda -preset sparselm-1.5b -layers 2 -batch 16 -reps 3 -decode-batch 1,64 -decode-steps 16 > $O/model.txt 2>&1
echo "model rc=$?" >> $O/model.txt; pack
cat $O/torch.txt; tail -5 $O/model.txt; wc -l $O/ncu-model.csv
