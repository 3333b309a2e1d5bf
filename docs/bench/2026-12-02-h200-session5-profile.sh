#!/bin/bash
# Session 5, device call 1: per-kernel times (ncu) of prefill 16 x 2048 and decode b=1/64 on a
# 2-layer sparselm-1.5b, both MLP paths; PyTorch SDPA and GEMM yardsticks.
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
