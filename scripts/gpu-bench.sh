#!/usr/bin/env bash
# Runs, on the GPU machine, the headline benchmarks of the GPU engine with
# what scripts/gpu-build.sh built, writing JSON and logs to OUTDIR:
#
#   scripts/gpu-bench.sh ffn OUTDIR     the sparse MLP block at m = 65536, d 2048, f 5632,
#                                       density 0.5%, uniform and skewed rates (TwELL vs cuBLASLt)
#   scripts/gpu-bench.sh model OUTDIR   the 28-layer SparseLM-1.5B shape (random weights, calibrated
#                                       gates): prefill 64 x 2048 tokens, decode at 512 cached tokens
#   scripts/gpu-bench.sh decode OUTDIR  the same model's decode steps at 512 and at 2016 cached
#                                       tokens (the 32 timed steps end at the model's 2048
#                                       positions), batches 1, 8 and 64 (a short prefill)
#   scripts/gpu-bench.sh train OUTDIR   training: the MLP block forward + backward at m = 16384,
#                                       density 0.5%, uniform and skewed (sparse vs dense), the
#                                       whole step of the 28-layer 1.5B shape at 8 x 2048 tokens
#                                       (dense, sparse, auto; one profiled step each), then the
#                                       PyTorch + transformers step on the same shape
#   scripts/gpu-bench.sh trace OUTDIR   kernel traces (CUPTI): the MLP block at m = 4096, 16384 and
#                                       65536 (skewed rates), and the model's prefill (8 x 2048) and
#                                       graph-replayed decode steps at 512 cached tokens, batches 1,
#                                       8 and 64; per-kernel summaries in the JSON, Chrome traces
#                                       (Perfetto) and plots of what each kernel adds to a step
#   scripts/gpu-bench.sh ab-mlp OUTDIR  the MLP block's switches, the settings timed in turns in
#                                       one process (bench ffn -variants): m = 2048, 4096, 8192,
#                                       16384 and 65536 (0.5%, skewed; 65536 uniform too) the
#                                       defaults (hot units calibrated and computed densely),
#                                       no hot units (TWELL_HOT_UNITS=0), and the warp tail
#                                       (TWELL_TAIL=warp); round 1 traces every setting's kernels
#                                       at 65536 skewed;
#                                       two rounds
#   scripts/gpu-bench.sh ab-builds OUTDIR  builds against each other: gpubin/twell and every
#                                       gpubin/twell-REV that scripts/gpu-build.sh built from
#                                       BUILDS (gpubin/builds.txt), one process each, in turns,
#                                       two rounds, `bench ffn` at AB_SHAPES (M:DIST[:DENSITY],
#                                       default 4096:uniform 4096:skewed 65536:uniform
#                                       65536:skewed, density 0.005); ends with each run's
#                                       dense, TwELL (D2T) and automatic-path medians, each
#                                       build's medians over the rounds, and OUTDIR/ab-builds.png
#                                       (bench plot: every run by the commit its build recorded);
#                                       a run past AB_TIMEOUT seconds (240) is stopped and its
#                                       build left out of the later runs
#   scripts/gpu-bench.sh ab-decode-builds OUTDIR  decode of the builds against each other: gpubin/twell
#                                       and every gpubin/twell-REV (gpubin/builds.txt), one process
#                                       each, in turns, AB_ROUNDS rounds (2): `bench model` of the
#                                       sparselm-1.5b preset after a prefill of 8 x 512 tokens, steps
#                                       of AB_BATCHES sequences (1,8) at 512 cached tokens; prints each
#                                       run's dense and TwELL rows and draws OUTDIR/ab-decode-builds.png
#                                       (bench plot: each path by the commit its build recorded); a run
#                                       past AB_TIMEOUT seconds (110) is stopped and its build left
#                                       out of the later runs
#   scripts/gpu-bench.sh test-builds OUTDIR  the package gpu's GPU tests of the tree (gpubin/gpu.test)
#                                       and of every build in gpubin/builds.txt (gpubin/gpu-REV.test),
#                                       in gpu/, those matching RUN (default: the D2T, MLP, hot-unit,
#                                       overflow, length-order, dense and workspace tests), each
#                                       binary stopped after TEST_TIMEOUT seconds (150); one line
#                                       a build: passed, failed, and whether it was stopped
#   scripts/gpu-bench.sh ab-decode OUTDIR  the decode switches, as variants of one run (bench model
#                                       -variants): steps of 1, 8, 16, 32 and 64 sequences at 512
#                                       cached tokens on the defaults, traced (CUPTI);
#                                       steps of one sequence with the norms not fused
#                                       (TWELL_LLM_FUSE_NORMS=0) and the defaults again, twice;
#                                       then steps of 1, 8 and 64 sequences after a prefill of
#                                       8 x 512 tokens, which calibrates the hot units, against
#                                       no hot units (TWELL_HOT_UNITS=0), twice
#   scripts/gpu-bench.sh ab-prefill OUTDIR  the prefill switches, as variants of one run (bench model
#                                       -variants), 32 x 2048 tokens, two rounds: the defaults,
#                                       cuBLASLt's heuristic's algorithms with the queries rotated
#                                       in rope_kv (TWELL_GEMM_TUNE=0 TWELL_LLM_ATTN_ROPE=0), and
#                                       no hot units (TWELL_HOT_UNITS=0); first `bench gemm -transb` of
#                                       the prefill's products (q/k/v, q alone, k and v, output, MLP) with the
#                                       heuristic's choice and the tuned one, every candidate timed
#   scripts/gpu-bench.sh stalls OUTDIR  where the MLP block's kernels at m = 65536 wait (ncu, full
#                                       set with warp-state sampling per SASS instruction, clocks
#                                       left alone): the first round of TestProfileKernels, i.e.
#                                       cuBLASLt's gate GEMM, the D2T and the sorted tail (t2u,
#                                       t2d_ws); the details page, the SASS page as CSV, and the
#                                       report when under 15 MB
#   scripts/gpu-bench.sh stalls-d2t OUTDIR  our D2T against the reference's at STALLS_M tokens
#                                       (4096), 0.5% uniform, the same ncu set: the first D2T
#                                       launch of TestProfileKernels (TWELL_PROFILE_M), then the
#                                       reference's D2T (its first launch in scripts/race_reference.py's
#                                       child process, on its own draw of the workload); needs the
#                                       reference built as race-reference.sh --build-only builds it
#                                       (RACE_BUILD_DIR, default build/race-reference) and its
#                                       files in REF (default third_party/sparser-faster-llms)
#   scripts/gpu-bench.sh stalls-decode OUTDIR  where a one-sequence decode step's kernels wait (ncu,
#                                       full set with warp-state sampling per SASS instruction):
#                                       qkv_rope1n, the decode attention, gemv_rows1 and gemv_mlp of
#                                       one layer of a graph-replayed step at 512 cached tokens
#                                       (sparselm-1.5b preset, after the first 8 steps); ncu runs
#                                       each kernel alone, so the early starts do not overlap them
#   scripts/gpu-bench.sh sass OUTDIR    the machine code of the wgmma D2T kernels: the sm_90a
#                                       cubins that the gpu tests' compile check builds with
#                                       NVRTC (TestCompileWGMMAPTX, TWELL_CUBIN_DUMP), each
#                                       disassembled (cuobjdump --dump-sass) into OUTDIR/NAME.sass
#                                       with its opcodes counted in OUTDIR/NAME.opcodes (count,
#                                       opcode, most first); compiles only, no kernel runs, so
#                                       it also runs off the GPU machine with TWELL_CUDA_LIB_DIR
#                                       and a cuobjdump on PATH (Debian trixie's
#                                       nvidia-cuda-toolkit package holds one)
#   scripts/gpu-bench.sh host-mem OUTDIR  host memory of `twell generate -device cuda` on the
#                                       sparselm-1.5b preset saved as a bf16 checkpoint (with the
#                                       sample tokenizer): peak RSS by /usr/bin/time -v, and the
#                                       generated text's timings
# Each run ends with `twell bench table OUTDIR`.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
what=${1:?usage: gpu-bench.sh ffn|model|decode|train|trace|ab-mlp|test-builds|ab-builds|ab-decode-builds|ab-decode|ab-prefill|stalls|stalls-d2t|stalls-decode|sass|host-mem OUTDIR}
out=${2:?usage: gpu-bench.sh ffn|model|decode|train|trace|ab-mlp|test-builds|ab-builds|ab-decode-builds|ab-decode|ab-prefill|stalls|stalls-d2t|stalls-decode|sass|host-mem OUTDIR}
mkdir -p "$out"
tw=$root/gpubin/twell
if [ ! -x "$tw" ] && [ -f "$root/gpubin/pack.txz" ]; then
  tar -xJf "$root/gpubin/pack.txz" -C "$root/gpubin"
fi
status=0
# ncu_pages REPORT NAME writes an ncu report's details page and its SASS
# source page (CSV) to OUTDIR/NAME-details.txt and NAME-sass.csv, copies the
# report when under 15 MB, and prints the details' headline lines.
ncu_pages() {
  ncu -i "$1.ncu-rep" --page details > "$out/$2-details.txt" 2>&1 || status=1
  ncu -i "$1.ncu-rep" --page source --csv --print-source sass > "$out/$2-sass.csv" 2>&1 || status=1
  if [ "$(stat -c %s "$1.ncu-rep" 2>/dev/null || echo 0)" -lt 15000000 ]; then cp "$1.ncu-rep" "$out/"; fi
  grep -E "^  [a-z_]|Duration|Warp Cycles Per Issued|Issue Slots Busy|Stall" "$out/$2-details.txt" | head -80
}
# read_builds sets builds to the tree's CLI (twell) and every twell-REV that
# scripts/gpu-build.sh built from BUILDS (gpubin/builds.txt).
read_builds() {
  builds=(twell)
  if [ -f "$root/gpubin/builds.txt" ]; then mapfile -t -O 1 builds < "$root/gpubin/builds.txt"; fi
}
# opcode_counts reads cuobjdump --dump-sass output and prints each opcode
# (the mnemonic before its first '.', predicates left out) with its count,
# most first.
opcode_counts() {
  awk '/\/\*[0-9a-f]+\*\// {
      sub(/.*\/\*[0-9a-f]+\*\/[ \t]*/, "")
      if ($1 ~ /^@/) $0 = substr($0, index($0, $2))
      op = $1; sub(/\..*/, "", op); sub(/;$/, "", op)
      if (op != "") n[op]++
    }
    END { for (op in n) print n[op], op }' | sort -k1,1nr -k2
}
# ab_summary OUTDIR prints ab-builds' summary of the runs in OUTDIR: one
# line per run with the medians of the dense path, the TwELL path (its D2T)
# and the automatic path; each build's medians over the rounds, a line per
# shape and build; and draws OUTDIR/ab-builds.png, every run grouped by the
# commit its build recorded (bench plot).
ab_summary() {
  # One line per run: the medians of the dense path, the TwELL path (its
  # D2T) and the automatic path.
  for f in "$1"/ffn-*.txt; do
    line=$(grep -m1 ': dense .* ms, TwELL' "$f" | sed -e 's/ *rel err.*//' -e 's/^ *//')
    [ -n "$line" ] || line=$(grep -m1 -o 'stopped after .*' "$f")
    printf '%-52s %s\n' "$(basename "$f" .txt)" "${line:-no result}"
  done
  # Each build's medians over the rounds, a line per shape and build, and
  # a figure of every run, grouped by the commit each build recorded.
  echo "medians over the rounds (TwELL ms, D2T ms):"
  for f in "$1"/ffn-*.txt; do
    line=$(grep -m1 -o 'TwELL [0-9.]* ms (.*D2T [0-9.]* ms' "$f") || continue
    name=$(basename "$f" .txt)
    shape=${name%%-twell*} shape=${shape%-*}
    echo "$shape ${name#"${name%%-twell*}"-} $(echo "$line" | sed -E 's/TwELL ([0-9.]*) ms.*D2T ([0-9.]*) ms/\1 \2/')"
  done | sort | awk '
    function med(s,   a, n, i, j, t) {
      n = split(s, a, " ")
      for (i = 2; i <= n; i++) { t = a[i] + 0; for (j = i - 1; j >= 1 && a[j] + 0 > t; j--) a[j + 1] = a[j]; a[j + 1] = t }
      return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
    }
    { k = $1 " " $2; tw[k] = tw[k] " " $3; d2t[k] = d2t[k] " " $4; if (!(k in seen)) { seen[k] = 1; order[++n] = k } }
    END { for (i = 1; i <= n; i++) { k = order[i]; split(k, f, " "); printf "  %-28s %-16s %.4f  %.4f\n", f[1], f[2], med(tw[k]), med(d2t[k]) } }'
  if ls "$1"/ffn-*.json > /dev/null 2>&1; then "$tw" bench plot -o "$1/ab-builds.png" "$1"/ffn-*.json; fi
}
# stopped RC: whether exit status RC is timeout's (the command ran past its limit).
stopped() { [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; }
# run_build B NAME LIMIT ARGS... runs gpubin/B with ARGS, its output in
# OUTDIR/NAME.txt, stopped after LIMIT seconds; a stopped build is marked in
# hung (declare -A hung first), for the A/B modes to leave out of later runs.
run_build() {
  local b=$1 name=$2 limit=$3
  shift 3
  timeout -k 10 "$limit" "$root/gpubin/$b" "$@" > "$out/$name.txt" 2>&1
  local rc=$?
  if stopped $rc; then
    hung[$b]=1
    echo "$what: $b stopped after $limit s ($name); left out from here" | tee -a "$out/$name.txt"
  fi
  [ $rc -eq 0 ] || status=1
}
case $what in
ffn)
  for dist in uniform skewed; do
    "$tw" bench ffn -device cuda -m 65536 -density 0.005 -dist "$dist" -seed 1 \
      -json "$out/ffn-$dist.json" 2>&1 | tee "$out/ffn-$dist.txt" || status=1
  done
  ;;
model)
  "$tw" bench model -device cuda -preset sparselm-1.5b -decode-batch 1,8,64 -decode-context 512 -seed 1 \
    -json "$out/model.json" 2>&1 | tee "$out/model.txt" || status=1
  ;;
decode)
  for ctx in 512 2016; do
    "$tw" bench model -device cuda -preset sparselm-1.5b -seed 9596107621982983358 -reps 3 -batch 8 -prompt-len 512 \
      -decode-batch 1,8,64 -decode-context "$ctx" -decode-steps 32 \
      -json "$out/decode-$ctx.json" -plot "$out/decode-$ctx.png" 2>&1 | tee "$out/decode-$ctx.txt" || status=1
  done
  ;;
train)
  for dist in uniform skewed; do
    "$tw" bench train -device cuda -profile -density 0.005 -dist "$dist" -seed 5 -reps 30 \
      -json "$out/train-mlp-$dist.json" 2>&1 | tee "$out/train-mlp-$dist.txt" || status=1
  done
  "$tw" bench train -device cuda -step -profile -layers 28 -batch 8 -seq 2048 -density 0.005 -steps 5 -seed 3 \
    -json "$out/train-step.json" -plot "$out/train-step.png" 2>&1 | tee "$out/train-step.txt" || status=1
  python3 "$root/scripts/hf-train-bench.py" -layers 28 -batch 8 -len 2048 -steps 5 \
    -json "$out/train-step-hf.json" 2>&1 | tee "$out/train-step-hf.txt" || status=1
  ;;
trace)
  for m in 4096 16384 65536; do
    "$tw" bench ffn -device cuda -m "$m" -density 0.005 -dist skewed -seed 1 -trace "$out/ffn-$m-trace.json" \
      -trace-plot "$out/ffn-$m-trace.png" -json "$out/ffn-$m.json" 2>&1 | tee "$out/ffn-$m.txt" || status=1
  done
  "$tw" bench model -device cuda -preset sparselm-1.5b -seed 9596107621982983358 -reps 3 -batch 8 -prompt-len 2048 \
    -decode-batch 1,8,64 -decode-context 512 -decode-steps 32 -trace "$out/model-trace.json" \
    -trace-plot "$out/model-trace.png" -json "$out/model.json" 2>&1 | tee "$out/model.txt" || status=1
  ;;
ab-mlp)
  for round in 1 2; do
    for shape in 65536:skewed 65536:uniform 16384:skewed 8192:skewed 4096:skewed 2048:skewed; do
      m=${shape%%:*} dist=${shape#*:}
      name=ffn-$m-$dist-$round
      # Round 1 traces each setting's kernels at m = 65536, skewed.
      trace=()
      [ "$round$shape" = 165536:skewed ] && trace=(-trace "$out/$name-trace.json" -trace-plot "$out/$name-trace.png")
      "$tw" bench ffn -device cuda -m "$m" -density 0.005 -dist "$dist" -seed 1 "${trace[@]}" \
        -variants ';HOT_UNITS=0;TAIL=warp' -json "$out/$name.json" 2>&1 | tee "$out/$name.txt" || status=1
    done
  done
  ;;
test-builds)
  read_builds
  for b in "${builds[@]}"; do
    bin=$root/gpubin/gpu.test
    [ "$b" = twell ] || bin=$root/gpubin/gpu-${b#twell-}.test
    log=$out/tests-$b.txt
    (cd "$root/gpu" && TWELL_REQUIRE_GPU=1 timeout -k 10 "${TEST_TIMEOUT:-150}" "$bin" -test.v -test.count=1 \
      -test.run "${RUN:-D2T|MLP|Hot|Overflow|LengthOrder|Dense|SharedWorkspace}") > "$log" 2>&1
    rc=$?
    note=""
    if stopped $rc; then
      note=", stopped after ${TEST_TIMEOUT:-150} s in $(grep '^=== RUN' "$log" | tail -1 | sed 's/=== RUN *//')"
    fi
    [ $rc -eq 0 ] || status=1
    echo "$b: $(grep -c -- '--- PASS' "$log") passed, $(grep -c -- '--- FAIL' "$log") failed (with subtests), exit $rc$note"
  done
  ;;
ab-builds)
  read_builds
  # A build whose run passes AB_TIMEOUT seconds (a kernel that never
  # returns) is stopped and left out of the later runs.
  declare -A hung=()
  for round in 1 2; do
    for shape in ${AB_SHAPES:-4096:uniform 4096:skewed 65536:uniform 65536:skewed}; do
      IFS=: read -r m dist dens <<< "$shape"
      dens=${dens:-0.005}
      for b in "${builds[@]}"; do
        [ -n "${hung[$b]:-}" ] && continue
        name=ffn-$m-$dist-$dens-$round-$b
        run_build "$b" "$name" "${AB_TIMEOUT:-240}" bench ffn -device cuda -m "$m" -density "$dens" \
          -dist "$dist" -seed 1 -json "$out/$name.json"
      done
    done
  done
  ab_summary "$out" || status=1
  ;;
ab-decode-builds)
  read_builds
  declare -A hung=()
  for round in $(seq "${AB_ROUNDS:-2}"); do
    for b in "${builds[@]}"; do
      [ -n "${hung[$b]:-}" ] && continue
      name=decode-$round-$b
      run_build "$b" "$name" "${AB_TIMEOUT:-110}" bench model -device cuda -preset sparselm-1.5b \
        -seed 9596107621982983358 -reps 3 -batch 8 -prompt-len 512 -decode-context 512 -decode-steps 32 \
        -decode-batch "${AB_BATCHES:-1,8}" -json "$out/$name.json"
      echo "== $name"
      grep -E '^ +(path|dense|twell) ' "$out/$name.txt"
    done
  done
  if ls "$out"/decode-*.json > /dev/null 2>&1; then "$tw" bench plot -o "$out/ab-decode-builds.png" "$out"/decode-*.json || status=1; fi
  ;;
ab-decode)
  # The preset is built and calibrated once, saved outside OUTDIR (3 GB)
  # and loaded by the later runs; the variants run on engines of their own
  # over the same weights (bench model -variants).
  ckpt=${TMPDIR:-/tmp}/twell-ab-sparselm
  "$tw" bench model -device cuda -preset sparselm-1.5b -save "$ckpt" -seed 9596107621982983358 -reps 2 -batch 8 \
    -prompt-len 64 -decode-batch 1,8,16,32,64 -decode-context 512 -decode-steps 32 \
    -trace "$out/decode-batches-trace.json" -trace-plot "$out/decode-batches-trace.png" \
    -json "$out/decode-batches.json" 2>&1 | tee "$out/decode-batches.txt" || status=1
  model=(-preset sparselm-1.5b)
  [ -f "$ckpt/config.json" ] && model=(-model "$ckpt")
  for round in 1 2; do
    "$tw" bench model -device cuda "${model[@]}" -seed 9596107621982983358 -reps 2 -batch 1 -prompt-len 64 \
      -decode-batch 1 -decode-context 512 -decode-steps 64 -variants 'LLM_FUSE_NORMS=0;' \
      -json "$out/decode-b1-fuse-$round.json" 2>&1 | tee "$out/decode-b1-fuse-$round.txt" || status=1
  done
  # A prefill of at least gpu.CalibrationTokens tokens calibrates the hot
  # units; decode then runs on the reordered layers.
  for round in 1 2; do
    "$tw" bench model -device cuda "${model[@]}" -seed 9596107621982983358 -reps 2 -batch 8 -prompt-len 512 \
      -decode-batch 1,8,64 -decode-context 512 -decode-steps 32 -variants 'HOT_UNITS=0' \
      -json "$out/decode-hot-$round.json" -plot "$out/decode-hot-$round.png" 2>&1 | tee "$out/decode-hot-$round.txt" || status=1
  done
  ;;
ab-prefill)
  "$tw" bench gemm -transb -backend lt,tuned -reps 20 -energy 0 \
    -sizes 131072x6144x2048,131072x2048x2048,131072x4096x2048,131072x5632x2048,131072x2048x5632 \
    -json "$out/gemm-tuned.json" 2>&1 | tee "$out/gemm-tuned.txt" || status=1
  for round in 1 2; do
    # Round 1 also traces one more prefill pass of every engine: each
    # kernel's time, and the GPU's idle time between kernels.
    trace=()
    [ "$round" = 1 ] && trace=(-trace "$out/prefill-trace.json" -trace-plot "$out/prefill-trace.png" -trace-steps 1)
    "$tw" bench model -device cuda -preset sparselm-1.5b -seed 9596107621982983358 -reps 3 -batch 32 -prompt-len 2048 \
      -decode-batch 1 -decode-context 512 -decode-steps 8 "${trace[@]}" \
      -variants 'GEMM_TUNE=0 LLM_ATTN_ROPE=0;HOT_UNITS=0;' \
      -json "$out/prefill-$round.json" 2>&1 | tee "$out/prefill-$round.txt" || status=1
  done
  ;;
stalls)
  # A round of TestProfileKernels launches 5 kernels the filter matches
  # (cuBLASLt's gate GEMM, nvjet, d2t_wgmma x 2, t2u, t2d_ws); ncu flushes
  # the caches before each, so round 1 will do.
  rep=${TMPDIR:-/tmp}/twell-mlp-stalls
  (cd "$root/gpu" && TWELL_PROFILE=1 ncu --clock-control none --set full --import-source yes \
    -k 'regex:nvjet|d2t_wgmma|t2u|t2d_ws' --launch-count 5 -f -o "$rep" \
    "$root/gpubin/gpu.test" -test.run TestProfileKernels -test.v) > "$out/stalls-run.txt" 2>&1 || status=1
  ncu_pages "$rep" stalls
  ;;
stalls-d2t)
  # ncu flushes the caches before each profiled launch, so the first will do.
  m=${STALLS_M:-4096}
  rep=${TMPDIR:-/tmp}/twell-d2t-stalls
  (cd "$root/gpu" && TWELL_PROFILE=1 TWELL_PROFILE_M=$m ncu --clock-control none --set full --import-source yes \
    -k 'regex:d2t_wgmma' --launch-count 1 -f -o "$rep" \
    "$root/gpubin/gpu.test" -test.run TestProfileKernels -test.v) > "$out/stalls-d2t-run.txt" 2>&1 || status=1
  ncu_pages "$rep" stalls-d2t
  rrep=${TMPDIR:-/tmp}/reference-d2t-stalls
  ncu --clock-control none --set full --import-source yes -k 'regex:mm_wgmma_nt' --launch-count 1 -f -o "$rrep" \
    "${PYTHON:-python3}" "$root/scripts/race_reference.py" _child ffn --paths reference_d2t \
    --result "$out/stalls-ref-d2t-child.json" --ref "${REF:-$root/third_party/sparser-faster-llms}" \
    --build-dir "${RACE_BUILD_DIR:-$root/build/race-reference}" --m "$m" --density 0.005 --dist uniform --reps 3 \
    > "$out/stalls-ref-d2t-run.txt" 2>&1 || status=1
  ncu_pages "$rrep" stalls-ref-d2t
  ;;
stalls-decode)
  # The TwELL engine's decode steps come first in bench model, 4 of the
  # filter's kernels a layer (112 a step). The first 1000 launches (250
  # layers: the first 8 steps, the eager ones before the MLP paths settle
  # and the recording among them, and 26 layers of the ninth) are skipped,
  # so the 4 profiled are one whole layer of a replayed step.
  rep=${TMPDIR:-/tmp}/twell-decode-stalls
  ncu --clock-control none --set full --import-source yes -k 'regex:qkv_rope1n|attn_dec|gemv_rows1|gemv_mlp' \
    --launch-skip 1000 --launch-count 4 -f -o "$rep" \
    "$tw" bench model -device cuda -preset sparselm-1.5b -seed 9596107621982983358 -reps 1 -batch 1 -prompt-len 64 \
    -decode-batch 1 -decode-context 512 -decode-steps 16 > "$out/stalls-decode-run.txt" 2>&1 || status=1
  ncu_pages "$rep" stalls-decode
  ;;
sass)
  dump=$out/cubin
  (cd "$root/gpu" && TWELL_CUBIN_DUMP=$dump "$root/gpubin/gpu.test" -test.run 'TestCompileWGMMAPTX' -test.count=1 \
    -test.v) > "$out/compile.txt" 2>&1 || status=1
  n=0
  for c in "$dump"/*.cubin; do
    [ -e "$c" ] || continue
    name=$(basename "$c" .cubin)
    cuobjdump --dump-sass "$c" > "$out/$name.sass" 2>&1 || status=1
    opcode_counts < "$out/$name.sass" > "$out/$name.opcodes"
    echo "$name: $(awk '{n += $1} END {print n + 0}' "$out/$name.opcodes") instructions; most: $(head -5 "$out/$name.opcodes" | awk '{printf "%s %s, ", $2, $1}')"
    n=$((n + 1))
  done
  [ $n -gt 0 ] || { echo "gpu-bench: no cubin in $dump (see $out/compile.txt)" >&2; status=1; }
  ;;
host-mem)
  # The checkpoint (3 GB) goes outside OUTDIR.
  ckpt=${TMPDIR:-/tmp}/twell-host-mem-sparselm
  "$tw" bench model -device cuda -preset sparselm-1.5b -save "$ckpt" -seed 9596107621982983358 -reps 1 -batch 1 \
    -prompt-len 16 -decode-batch 1 -decode-context 16 -decode-steps 4 > "$out/save.txt" 2>&1 || status=1
  cp "$root/models/default/tokenizer.json" "$ckpt/" || status=1
  /usr/bin/time -v "$tw" generate -model "$ckpt" -device cuda -prompt "The quick brown fox" -max-tokens 64 \
    -temperature 0 > "$out/generate.txt" 2> "$out/generate-time.txt" || status=1
  grep -E "Maximum resident|Elapsed|tokens" "$out/generate-time.txt"
  ;;
*)
  echo "gpu-bench: want ffn, model, decode, train, trace, ab-mlp, test-builds, ab-builds, ab-decode-builds, ab-decode, ab-prefill, stalls, stalls-d2t, stalls-decode, sass or host-mem, not $what" >&2
  exit 2
  ;;
esac
"$tw" bench table "$out" || status=1
exit $status
