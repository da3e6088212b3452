#!/usr/bin/env bash
# tests/gpu/bundle.sh - prepare, on this machine (no GPU needed; nvcc under /usr/local/cuda),
# what tests/gpu/run.sh needs on a GPU machine that has CUDA but none of our Debian libraries
# and no network (the device tool's H200 image: no liburing, jansson, libs3, OpenBLAS, ...;
# the working tree travels, ../shared and the ignored data/ do not). It
#   - builds build-gpu/ (-Dcuda=enabled, release) and runs its build suite (the fatbin and
#     spill check, the same as CI's), whose log goes into the bundle;
#   - builds llm.c's train_gpt2cu from ../shared/peers/llm.c (sm_90, no cuDNN, no MPI/NCCL);
#   - copies the programs run.sh runs, keeping build-gpu/'s layout, and every shared library
#     they load from Debian (not glibc's, not the CUDA toolkit's cuBLAS and NCCL, which the
#     GPU machine has: run.sh finds them there), the token shards and llm.c's program;
#   - packs it all into one tar.gz (about 40 MiB; the device tool carries at most 64 MiB).
# Usage: tests/gpu/bundle.sh [OUTPUT]   (default .work/gpu-bundle.tgz, ignored by git)
# Then, with the device tool: run with carry [".work/gpu-bundle.tgz"] the command
#   tests/gpu/run.sh --bundle .work/gpu-bundle.tgz --results "$OUT"
# Environment: B (default build-gpu/), DATA (default data/brown), LLMC (default
# ../shared/peers/llm.c). Exit status: 0 the bundle is written, 1 a step failed.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
OUTF="${1:-$ROOT/.work/gpu-bundle.tgz}"
B="${B:-$ROOT/build-gpu}"
DATA="${DATA:-$ROOT/data/brown}"
LLMC="${LLMC:-$ROOT/../shared/peers/llm.c}"
export PATH="/usr/local/cuda/bin:$PATH"
die() { echo "tests/gpu/bundle.sh: $*" >&2; exit 1; }

command -v nvcc >/dev/null || die "no nvcc (the CUDA toolkit under /usr/local/cuda): cannot build the CUDA targets"
ls "$DATA"/train_*.bin >/dev/null 2>&1 || die "no token shards in $DATA (scripts/demo's set-up makes data/brown)"
[ -f "$LLMC/Makefile" ] || die "no llm.c in $LLMC"

STAGE="$ROOT/.work/gpu-bundle"
rm -rf "$STAGE"
mkdir -p "$STAGE/build/tests/gpu" "$STAGE/lib" "$STAGE/data" "$STAGE/llmc"

echo "==> building $B (-Dcuda=enabled)"
[ -f "$B/build.ninja" ] || meson setup "$B" "$ROOT" -Dcuda=enabled -Dbuildtype=release >/dev/null
ninja -C "$B" >/dev/null || { ninja -C "$B"; die "build of $B failed"; }
echo "==> build suite (sm_90 SASS + PTX, spills)"
meson test -C "$B" --suite build --verbose >"$STAGE/fatbin.log" 2>&1 || die "the build suite failed: $STAGE/fatbin.log"

echo "==> llm.c train_gpt2cu (sm_90)"
rm -rf "$ROOT/.work/llmc-build" && cp -r "$LLMC" "$ROOT/.work/llmc-build"
(cd "$ROOT/.work/llmc-build" && make train_gpt2cu NO_MULTI_GPU=1 NO_USE_MPI=1 GPU_COMPUTE_CAPABILITY=90 \
    >"$STAGE/llmc-build.log" 2>&1) || die "llm.c build failed: $STAGE/llmc-build.log"
cp "$ROOT/.work/llmc-build/train_gpt2cu" "$STAGE/llmc/"

PROGS=(train elastic/elastic ckpt-inspect tests/gpu/kernel_check tests/gpu/kernel_check_cpu
       tests/gpu/nccl_check tests/gpu/copy_bench tests/unit/test_device tests/unit/test_train_stage)
for p in "${PROGS[@]}"; do
    [ -x "$B/$p" ] || die "$B/$p was not built"
    mkdir -p "$STAGE/build/$(dirname "$p")"
    cp "$B/$p" "$STAGE/build/$p"
done
# the shared libraries from Debian: all that ldd resolves, but glibc's own, the C++ and gcc
# runtimes (any Linux has them) and the CUDA libraries (the GPU machine's own: cudart,
# cuBLAS/cuBLASLt, NCCL; ours would be 300 MiB)
for f in "${PROGS[@]/#/$B/}" "$STAGE/llmc/train_gpt2cu"; do
    ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// {print $3}'
done | sort -u | grep -vE '/(libc|libm|libdl|libpthread|librt|libresolv|ld-linux[^/]*|libstdc\+\+|libgcc_s)\.so' \
    | grep -vE 'lib(cudart|cublas|cublasLt|nccl|cuda|nvidia-ml)\.so' | while read -r lib; do
    cp -L "$lib" "$STAGE/lib/"
done
cp "$DATA"/train_*.bin "$DATA"/val_*.bin "$STAGE/data/"
{
    echo "commit $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD || echo ' (with uncommitted changes)')"
    echo "made $(date -u +%FT%TZ) on $(uname -n), nvcc $(nvcc --version | grep -o 'release [0-9.]*')"
    echo "fatbin: $(grep -m1 -o 'fatbin of [^:]*: [^:]*' "$STAGE/fatbin.log"); $(grep -m1 -o 'zero spill.*' "$STAGE/fatbin.log")"
} >"$STAGE/BUNDLE"
mkdir -p "$(dirname "$OUTF")"
tar -C "$STAGE" -czf "$OUTF" .
echo "==> $OUTF: $(du -h "$OUTF" | cut -f1) ($(ls "$STAGE/lib" | wc -l) libraries; $(head -1 "$STAGE/BUNDLE"))"
