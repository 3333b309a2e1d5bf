#!/usr/bin/env bash
# Builds, on a machine with Go, everything the GPU machine (which has no Go)
# runs: the twell CLI and the `go test -c` binary of every package whose
# tests use the cuda packages, all with CGO_ENABLED=0, into gpubin/ (ignored
# by git). gpubin/tests.txt lists each test binary with its package folder.
# The CLIs record their source commit (-buildvcs=true, whatever GOFLAGS
# says), which bench rows carry as "commit". The binaries are stripped, and
# packed into gpubin/pack.txz (xz), which is what to copy when the transfer
# is limited in size: scripts/gpu-run.sh and scripts/gpu-bench.sh unpack it
# when the binaries are missing. Then run
# scripts/gpu-run.sh on the GPU machine (see README.md, "GPU").
#
# PACK, a space-separated list of package folders (e.g. PACK="gpu gpu/llm"),
# builds only the CLI and those packages' tests: every test binary packs to
# about 11 MB, the CLI with the gpu and gpu/llm tests to about 7 MB, for a
# transfer that also carries the source tree under a size limit. A
# revision of BUILDS from before the tag twell_noembed embeds the default
# model: about 11 MB more.
#
# BUILDS, a space-separated list of git revisions (e.g. BUILDS="9dda84c
# e8ea649"), also builds the CLI of each into gpubin/twell-REV and the test
# binary of its package gpu into gpubin/gpu-REV.test (from a temporary
# clone; run it in gpu/ as gpu.test is), for `scripts/gpu-bench.sh
# ab-builds`, which times the CLIs against gpubin/twell in turns;
# gpubin/builds.txt lists them. Builds of nearby revisions add little to
# the pack (xz finds the shared bytes).
set -euo pipefail
cd "$(dirname "$0")/.."
out=gpubin
rm -rf "$out"
mkdir -p "$out"
export CGO_ENABLED=0 GOOS=linux GOARCH=amd64
# The tag twell_noembed leaves the default model (14 MB) out of the binaries:
# they find models/default in the source tree they run in (package models).
flags=(-ldflags='-s -w' -tags twell_noembed)
go build -buildvcs=true -trimpath "${flags[@]}" -o "$out/twell" ./cmd/twell
mod=$(go list -m)
: > "$out/tests.txt"
go list -f '{{.ImportPath}} {{.Dir}} {{join .TestImports " "}} {{join .XTestImports " "}}' ./... |
  while read -r pkg dir imports; do
    case " $imports " in
      *" $mod/cuda "* | *" $mod/cuda/"*) ;;
      *) continue ;;
    esac
    if [ -n "${PACK:-}" ]; then
      case " $PACK " in
        *" ${pkg#"$mod"/} "*) ;;
        *) continue ;;
      esac
    fi
    name=$(echo "${pkg#"$mod"/}" | tr / _)
    if go test -c -trimpath "${flags[@]}" -o "$out/$name.test" "$pkg"; then
      echo "$name.test ${dir#"$PWD"/}" >> "$out/tests.txt"
      echo "built $out/$name.test ($pkg)"
    else
      echo "FAILED to build the tests of $pkg" | tee -a "$out/build-failures.txt" >&2
    fi
  done
echo "built $out/twell; test binaries listed in $out/tests.txt"
: > "$out/builds.txt"
for rev in ${BUILDS:-}; do
  short=$(git rev-parse --short "$rev^{commit}")
  # A shared clone, not a worktree: go build records the commit only where
  # .git is a folder.
  wt=$(mktemp -d)
  git clone -q --shared --no-checkout . "$wt"
  git -C "$wt" checkout -q --detach "$short"
  if (cd "$wt" && go build -buildvcs=true -trimpath "${flags[@]}" -o "$OLDPWD/$out/twell-$short" ./cmd/twell &&
    go test -c -trimpath "${flags[@]}" -o "$OLDPWD/$out/gpu-$short.test" ./gpu); then
    echo "twell-$short" >> "$out/builds.txt"
    echo "built $out/twell-$short and $out/gpu-$short.test (revision $rev)"
  else
    echo "FAILED to build revision $rev" | tee -a "$out/build-failures.txt" >&2
  fi
  rm -rf "$wt"
done
# xz -9 keeps 64 MiB of history, so the builds of nearby revisions share
# their bytes in the pack (the default level's 8 MiB do not span a binary).
(cd "$out" && tar -cf - --exclude=pack.txz ./* | xz -9e -T0 > pack.txz)
echo "packed $out/pack.txz ($(du -h "$out/pack.txz" | cut -f1))"
if [ -s "$out/build-failures.txt" ]; then
  exit 1
fi
