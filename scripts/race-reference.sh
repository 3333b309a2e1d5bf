#!/usr/bin/env bash
# Races twell against the reference TwELL kernels (Sakana AI's public
# sparser-faster-llms repository, MIT) on the GPU machine, in one run:
#
#   inference, per shape: `gpubin/twell bench ffn -device cuda` (its dense and
#   TwELL paths) writes its inputs with -dump-inputs; then, on exactly those
#   inputs, scripts/race_reference.py times the PyTorch dense gated MLP (bf16),
#   the reference's fused TwELL gated MLP and its D2T alone, and checks the
#   MLPs against float64 and fp32 references (the D2T by its active counts);
#   training (shapes train:M:DENSITY): the reference's hybrid op
#   (torch.ops.sparse_ops.ff_forward_gated, forward + backward with the L1
#   term) against PyTorch dense autograd, and twell's side through
#   twell_bench_train below.
#
# Each reference measurement runs in its own process: a crash (the hybrid
# kernel was seen to segfault at 2% density) is recorded and the race goes on.
# Results: OUTDIR/race.md (the table), OUTDIR/race.json (every figure),
# OUTDIR/reference.json (the Python side), OUTDIR/twell-*.json and logs.
#
# usage: scripts/race-reference.sh [--dry-run] [--build-only] REF_CHECKOUT OUTDIR [SHAPE...]
#
#   REF_CHECKOUT  the reference's files (custom_models/ at least), e.g. extracted
#                 into third_party/sparser-faster-llms; its commit is read from
#                 git or from a file COMMIT there
#   SHAPE         M:DENSITY[:DIST] for the MLP block, train:M:DENSITY[:DIST] for
#                 training; DENSITY a fraction (0.005) or a percentage (0.5%),
#                 DIST uniform (default) or skewed; M a multiple of 256.
#                 Default: 4096:0.5% 16384:0.5% 65536:0.5% 65536:0.5%:skewed
#                 65536:2% 65536:5% 131072:0.5%:skewed train:16384:0.5% train:16384:2%
#   --dry-run     check the arguments and print the commands, run nothing
#   --build-only  build the reference's extensions and stop
#
# Environment: PYTHON (python3), TWELL_BIN (gpubin/twell), RACE_BUILD_DIR
# (build/race-reference: the built extensions, reused while the sources, flags
# and torch are unchanged), RACE_SEED (1), RACE_REPS (30), RACE_TMP (a folder
# for the dumped inputs, removed after each shape; default a new one under
# TMPDIR), RACE_CUDA_ARCH (9.0a), RACE_IGNORE_CUDA_VERSION=1 (build even when
# nvcc's CUDA major version differs from torch's).
#
# Exit status: 0 when every step ran (a crash of the reference is a result),
# 1 when a step failed (a build, a twell run, the Python side), 2 for bad usage.
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
command="scripts/race-reference.sh $*" # for the report
py=${PYTHON:-python3}
helper=$root/scripts/race_reference.py
default_shapes=(4096:0.5% 16384:0.5% 65536:0.5% 65536:0.5%:skewed 65536:2% 65536:5% 131072:0.5%:skewed
  train:16384:0.5% train:16384:2%)

usage() {
  sed -n '/^# usage:/,/^# Exit status/p' "$0" | sed -e 's/^# \{0,1\}//' -e '$d' >&2
}
die() {
  echo "race-reference: $*" >&2
  exit 2
}

dry=0
build_only=0
while [ $# -gt 0 ]; do
  case $1 in
  -n | --dry-run) dry=1 ;;
  --build-only) build_only=1 ;;
  -h | --help)
    usage
    exit 0
    ;;
  --) shift; break ;;
  -*) die "unknown option $1 (see --help)" ;;
  *) break ;;
  esac
  shift
done
if [ $# -lt 2 ]; then
  usage
  die "want REF_CHECKOUT and OUTDIR"
fi
ref=$1
out=$2
shift 2

[ -d "$ref" ] || die "reference checkout $ref: no such folder (see docs/gpu-twell.md, \"Racing the reference\")"
for f in custom_models/twell_modules/twell.py custom_models/twell_modules/twell.cpp \
  custom_models/twell_modules/matmul_d2t.cu custom_models/twell_modules/matmul_gated_t2d.cu \
  custom_models/twell_modules/mlp_twell.cu custom_models/hybrid_modules/custom_op.cpp \
  custom_models/hybrid_modules/hybrid_sp.cu; do
  [ -f "$ref/$f" ] || die "$ref is not a checkout of the reference: $f is missing"
done
ref=$(cd "$ref" && pwd)

tw=${TWELL_BIN:-$root/gpubin/twell}
if [ "$build_only" = 0 ] && [ ! -x "$tw" ]; then
  die "$tw: not found or not executable (build it with scripts/gpu-build.sh on a machine with Go, and bring gpubin/twell along)"
fi
seed=${RACE_SEED:-1}
reps=${RACE_REPS:-30}
[[ $seed =~ ^[1-9][0-9]*$ ]] || die "RACE_SEED=$seed: want a positive integer"
[[ $reps =~ ^[1-9][0-9]*$ ]] || die "RACE_REPS=$reps: want a positive integer"
bdir=${RACE_BUILD_DIR:-$root/build/race-reference}

# fraction DENSITY: prints DENSITY (0.005 or 0.5%) as a fraction inside (0, 1),
# or fails.
fraction() {
  local s=$1 pc=0
  if [[ $s == *% ]]; then
    s=${s%\%}
    pc=1
  fi
  [[ $s =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]] || return 1
  awk -v s="$s" -v pc="$pc" 'BEGIN { v = s + 0; if (pc) v /= 100; if (v <= 0 || v >= 1) exit 1; printf "%.10g\n", v }'
}

# Shapes, parsed up front: kinds[i] ffn|train, ms[i], dens[i], dists[i].
kinds=() ms=() dens=() dists=()
[ $# -gt 0 ] || set -- "${default_shapes[@]}"
for s in "$@"; do
  bad="unknown shape '$s': want M:DENSITY[:DIST] or train:M:DENSITY[:DIST] (e.g. 65536:0.5%:skewed, train:16384:2%)"
  kind=ffn
  rest=$s
  if [[ $s == train:* ]]; then
    kind=train
    rest=${s#train:}
  fi
  IFS=: read -r m d dist extra <<<"$rest"
  [ -z "${extra:-}" ] || die "$bad"
  [[ ${m:-} =~ ^[1-9][0-9]*$ ]] || die "$bad"
  (( m % 256 == 0 )) || die "shape '$s': m $m is not a multiple of 256 (the reference's D2T kernel needs it)"
  [ -n "${d:-}" ] || die "$bad"
  frac=$(fraction "$d") || die "shape '$s': density '$d' is not a fraction in (0, 1) or a percentage"
  dist=${dist:-uniform}
  case $dist in uniform | skewed) ;; *) die "shape '$s': distribution '$dist' is not uniform or skewed" ;; esac
  kinds+=("$kind") ms+=("$m") dens+=("$frac") dists+=("$dist")
done

# run LOG CMD...: runs CMD with its output in LOG (and on the terminal), or
# prints it with --dry-run. Returns CMD's status.
run() {
  local log=$1
  shift
  if [ "$dry" = 1 ]; then
    printf '+'
    printf ' %q' "$@"
    printf ' >%q\n' "$log"
    return 0
  fi
  "$@" 2>&1 | tee "$log"
  return "${PIPESTATUS[0]}"
}

status=0
failed() {
  echo "race-reference: FAILED: $*" >&2
  status=1
}

if [ "$dry" = 0 ]; then
  command -v "$py" >/dev/null || die "$py not found (set PYTHON)"
  "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' ||
    { echo "race-reference: torch with a CUDA device is needed ($py)" >&2; exit 1; }
  mkdir -p "$out/logs" || die "cannot create $out"
  out=$(cd "$out" && pwd)
fi

echo "race-reference: building the reference's extensions into $bdir" >&2
run "$out/build.log" "$py" "$helper" build --ref "$ref" --build-dir "$bdir" || failed "the build (see $out/build.log)"
[ "$build_only" = 1 ] && exit $status

tmp=${RACE_TMP:-}
if [ -z "$tmp" ] && [ "$dry" = 0 ]; then
  tmp=$(mktemp -d "${TMPDIR:-/tmp}/race-inputs.XXXXXX") || die "cannot create a temporary folder"
  trap 'rm -rf "$tmp"' EXIT
fi
tmp=${tmp:-/tmp/race-inputs}

# ffn_shape M DENSITY DIST: twell's bench ffn (dumping its inputs), then the
# reference and PyTorch on those inputs.
ffn_shape() {
  local m=$1 d=$2 dist=$3 tag="m$1-$3-$2"
  local dump=$tmp/$tag
  echo "race-reference: MLP block m=$m density=$d $dist" >&2
  if run "$out/twell-ffn-$tag.txt" "$tw" bench ffn -device cuda -m "$m" -density "$d" -dist "$dist" \
    -seed "$seed" -reps "$reps" -json "$out/twell-ffn-$tag.json" -dump-inputs "$dump"; then
    run "$out/logs/ref-ffn-$tag.txt" "$py" "$helper" ffn --ref "$ref" --build-dir "$bdir" --inputs "$dump" \
      --m "$m" --density "$d" --dist "$dist" --seed "$seed" --reps "$reps" \
      --out "$out/reference.json" --logs "$out/logs" || failed "the reference side of $tag"
  else
    failed "twell bench ffn $tag (see $out/twell-ffn-$tag.txt); the reference runs on inputs drawn by the same recipe"
    run "$out/logs/ref-ffn-$tag.txt" "$py" "$helper" ffn --ref "$ref" --build-dir "$bdir" --synth \
      --m "$m" --density "$d" --dist "$dist" --seed "$seed" --reps "$reps" \
      --out "$out/reference.json" --logs "$out/logs" || failed "the reference side of $tag"
  fi
  [ "$dry" = 1 ] || rm -rf "$dump"
}

# twell_bench_train M DENSITY DIST TAG: twell's side of the training race:
# `twell bench train` (the MLP block's forward + backward with the L1 term,
# dense, sparse and the automatic path) writes its JSON rows (m, density,
# dist, dense_ms, twell_ms for the sparse path, auto_ms) to
# OUTDIR/twell-train-TAG.json. A twell binary without `bench train` records
# "not available" there instead.
twell_bench_train() {
  local m=$1 d=$2 dist=$3 tag=$4
  local js=$out/twell-train-$tag.json
  if [ "$dry" = 0 ] && ! "$tw" bench train -h >/dev/null 2>&1; then
    echo "race-reference: twell bench train: not available in $tw" >&2
    printf '{"schema": "twell.race.unavailable/1", "what": "twell bench train", "m": %s, "density": %s, "dist": "%s", "status": "not available"}\n' \
      "$m" "$d" "$dist" >"$js"
    return 0
  fi
  run "$out/twell-train-$tag.txt" "$tw" bench train -device cuda -m "$m" -density "$d" -dist "$dist" \
    -seed "$seed" -reps "$reps" -json "$js" || failed "twell bench train $tag (see $out/twell-train-$tag.txt)"
}

# train_shape M DENSITY DIST: the reference's hybrid op and PyTorch dense
# autograd, then twell's side.
train_shape() {
  local m=$1 d=$2 dist=$3 tag="m$1-$3-$2"
  echo "race-reference: training MLP m=$m density=$d $dist" >&2
  run "$out/logs/ref-train-$tag.txt" "$py" "$helper" train --ref "$ref" --build-dir "$bdir" \
    --m "$m" --density "$d" --dist "$dist" --seed "$seed" --reps "$reps" \
    --out "$out/reference.json" --logs "$out/logs" || failed "the reference side of train $tag"
  twell_bench_train "$m" "$d" "$dist" "$tag"
}

t0=$SECONDS
for i in "${!kinds[@]}"; do
  t1=$SECONDS
  if [ "${kinds[$i]}" = ffn ]; then
    ffn_shape "${ms[$i]}" "${dens[$i]}" "${dists[$i]}"
  else
    train_shape "${ms[$i]}" "${dens[$i]}" "${dists[$i]}"
  fi
  [ "$dry" = 1 ] || echo "race-reference: ($((SECONDS - t1)) s, $((SECONDS - t0)) s in all)" >&2
done

run "$out/report.txt" "$py" "$helper" report --command "$command" "$out" || failed "the report"
exit $status
