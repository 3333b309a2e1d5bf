#!/bin/bash
# Reproduces the GPU training figures of docs/gpu-train.md dated 2026-12-03 (H200):
# 1. the trainer's GPU tests (sparse MLP block against dense, one step against the CPU float64
#    trainer on both MLP paths, 20 steps against the CPU);
# 2. `twell bench train` at m 16384 (uniform and skewed densities) and its stage profile;
# 3. the whole training step of the SparseLM-1.5B shape (dense, sparse, auto) and PyTorch's;
# 4. the small preset on the corpus shards for 2000 steps at L1 5e-3 (SHARDS and TOKENIZER set to
#    the `twell data` output of docs/data.md; skipped when unset).
# Build first with scripts/gpu-build.sh, then run this on the GPU machine from the repository root
# with OUT set to a folder for the results (packed into $OUT/all.tgz after every stage). The race
# against the reference is scripts/race-reference.sh REF OUT 'train:16384:0.5%' 'train:16384:2%'.
cd "$(dirname "$0")/../.."
O=/tmp/o; mkdir -p $O
export TWELL_REQUIRE_GPU=1
pack() { tar czf $OUT/all.tgz -C $O . 2>/dev/null; }
(cd gpu/trainer && timeout 180 ../../gpubin/gpu_trainer.test -test.v -test.run 'MLPBlock|StepMatchesCPU|LossCurve' > $O/trainer-tests.txt 2>&1; echo "rc=$?" >> $O/trainer-tests.txt)
pack; grep -E "^(--- FAIL|ok|FAIL|PASS)|rc=" $O/trainer-tests.txt | tail -4
timeout 120 gpubin/twell bench train -m 16384 -density 0.005,0.01,0.02,0.05 -reps 20 -seed 2 -json $O/train-mlp-uniform.json -plot $O/train-mlp-uniform.png > $O/train-mlp-uniform.txt 2>&1
timeout 60 gpubin/twell bench train -m 16384 -density 0.005,0.02 -dist skewed -reps 20 -seed 2 -json $O/train-mlp-skewed.json > $O/train-mlp-skewed.txt 2>&1
timeout 60 gpubin/twell bench train -m 16384 -density 0.005 -reps 10 -seed 3 -profile -json $O/train-mlp-profile.json > $O/train-mlp-profile.txt 2>&1
pack; tail -n 12 $O/train-mlp-uniform.txt
timeout 300 gpubin/twell bench train -step -layers 28 -batch 8 -seq 2048 -density 0.005 -steps 5 -seed 3 -json $O/train-step.json > $O/train-step.txt 2>&1
timeout 120 python3 scripts/hf-train-bench.py -layers 28 -batch 8 -len 2048 -steps 5 -json $O/train-step-hf.json > $O/train-step-hf.txt 2>&1
pack; tail -n 5 $O/train-step.txt $O/train-step-hf.txt
if [ -n "${SHARDS:-}" ] && [ -n "${TOKENIZER:-}" ]; then
  timeout 200 gpubin/twell train -device cuda -preset small -steps 2000 -l1 5e-3 -data "$SHARDS" -tokenizer "$TOKENIZER" -out /tmp/run-small > $O/train-small.txt 2>&1
  cp /tmp/run-small/metrics.jsonl /tmp/run-small/*.png $O/ 2>/dev/null
  pack; tail -n 3 $O/train-small.txt
fi
