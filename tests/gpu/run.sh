#!/usr/bin/env bash
# tests/gpu/run.sh - the GPU check of the CUDA trainer (issue 11), one script for a machine
# with one or more NVIDIA GPUs. It builds, checks and measures, in under 8 minutes on one
# H200, and prints one table (also written to $OUT/table.txt):
#   build         meson + ninja with -Dcuda=enabled into build-gpu/ (sm_80/sm_90 SASS + PTX)
#   fatbin        the build suite: sm_90 SASS and PTX embedded, no spills in hot kernels
#   kernels       every CUDA op against its CPU reference on fresh random inputs in five
#                 shapes (fp32 1e-5 relative, bf16 GEMMs 5e-4, bf16 outputs 1e-2), and
#                 bit-identical twice (tests/gpu/kernel_check; the dry run: its harness on
#                 the CPU table, kernel_check_cpu)
#   nccl          multi-rank collectives (tree bits stable, ring, a killed rank is an error):
#                 only where `nvidia-smi -L` lists two or more GPUs, else "skip"
#   resume        the demo model on the GPU: uninterrupted vs SIGKILLed + --resume auto:
#                 the same params_digest
#   memtier       the same with the memory tier (CKPT_MEM_PATH, --mem-snapshot-mode async:
#                 copies from the GPU into the pinned shared-memory slots): resumed from
#                 memory, the same digest
#   gpu->cpu      the GPU run's last snapshot restored by --device cpu: the same digest
#   cpu->gpu      a CPU run's snapshot restored by --device cuda: the same digest
#   tokens/s      GPT-2 124M (12 x 768, 12 heads, vocab 50257) bf16, micro-batch 16 x 1024,
#                 next to llm.c's train_gpt2cu (../shared/peers/llm.c, `-e d12`, same shards)
#   stall         the 124M run's snapshot stall (ms) next to a bare pinned D2H copy of the
#                 same bytes (tests/gpu/copy_bench), the persist throughput (MiB/s) and
#                 where and how long the record's digests were hashed
#   restore       that snapshot resumed: MiB restored through the pinned bounce buffers and
#                 the copy stream (decompression overlapped with the H2D copies), ms, MiB/s
# Usage: tests/gpu/run.sh [--quick] [--cpu-dry-run]
#   --quick        skip llm.c and the 124M runs
#   --cpu-dry-run  on a machine without a GPU: the same steps with --device cpu, a small model
#                  instead of the 124M one, llm.c's train_gpt2cu built but not run, the GPU
#                  programs' skips (77) as "skip" rows: checks the script itself (its parsing,
#                  its commands, the llm.c build) before device time is spent on it
# Environment: OUT (work folder; default /tmp/ckpt-gpu-run), DATA (token shards; default
# data/brown, made by scripts/demo's set-up), JOBS (build parallelism; default nproc), B (the
# build folder; default build-gpu/, configured here with -Dcuda=enabled when missing).
# Exit status: 0 every check passed, 1 a check failed, 77 no GPU here (without --cpu-dry-run).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${OUT:-/tmp/ckpt-gpu-run}"
DATA="${DATA:-$ROOT/data/brown}"
JOBS="${JOBS:-$(nproc)}"
B="${B:-$ROOT/build-gpu}"
QUICK=0
DRY=0
for a in "$@"; do
    case "$a" in
    --quick) QUICK=1 ;;
    --cpu-dry-run) DRY=1 ;;
    *) echo "tests/gpu/run.sh: unknown argument $a (see the header)" >&2; exit 2 ;;
    esac
done
DEV=cuda
[ $DRY = 1 ] && DEV=cpu
export PATH="/usr/local/cuda/bin:$PATH" # nvcc for meson and llm.c's Makefile
T0=$SECONDS

rows=()
failed=0
row() { # row NAME RESULT FIGURES
    rows+=("$(printf '%-10s %-5s %s' "$1" "$2" "$3")")
    [ "$2" = "FAIL" ] && failed=1
    printf '[gpu %4ds] %-10s %-5s %s\n' "$((SECONDS - T0))" "$1" "$2" "$3"
}
table() {
    {
        echo "== tests/gpu/run.sh: $(date -u +%FT%TZ), $((SECONDS - T0)) s"
        echo "gpus: ${GPUS:-?}"
        printf '%-10s %-5s %s\n' check result figures
        for r in "${rows[@]}"; do echo "$r"; done
    } | tee "$OUT/table.txt"
}
digest() { sed -n 's/.*params_digest=\([0-9a-f]*\).*/\1/p' "$1" | tail -1; }

mkdir -p "$OUT"
if [ $DRY = 1 ]; then
    echo "GPU 0: none (--cpu-dry-run: every step with --device cpu)" >"$OUT/gpus.txt"
elif ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >"$OUT/gpus.txt" 2>&1; then
    echo "tests/gpu/run.sh: no GPU here (nvidia-smi -L failed): skipped"
    exit 77
fi
NGPU=$(grep -c '^GPU ' "$OUT/gpus.txt" || true)
GPUS="$NGPU: $(head -1 "$OUT/gpus.txt")"
[ "$NGPU" -ge 1 ] || { echo "tests/gpu/run.sh: nvidia-smi lists no GPU: skipped"; exit 77; }

# ---- build
t=$SECONDS
if [ -f "$B/build.ninja" ] || meson setup "$B" -Dcuda=enabled -Dbuildtype=release >"$OUT/setup.log" 2>&1; then
    if ninja -C "$B" -j "$JOBS" >"$OUT/build.log" 2>&1; then
        row build ok "$((SECONDS - t)) s"
    else
        row build FAIL "see $OUT/build.log: $(grep -m1 -i error "$OUT/build.log")"
        table; exit 1
    fi
else
    row build FAIL "meson setup: see $OUT/setup.log"
    table; exit 1
fi

# ---- fatbin and spills (the same test CI runs)
if meson test -C "$B" --suite build --verbose >"$OUT/fatbin.log" 2>&1; then
    row fatbin ok "$(grep -m1 -o 'fatbin of [^:]*: [^:]*' "$OUT/fatbin.log"); $(grep -m1 -o 'zero spill.*' "$OUT/fatbin.log")"
else
    row fatbin FAIL "see $OUT/fatbin.log"
fi

# ---- kernels vs CPU reference
KC="$B/tests/gpu/kernel_check"
[ $DRY = 1 ] && KC="$B/tests/gpu/kernel_check_cpu" # no GPU: the harness on the CPU table
"$KC" >"$OUT/kernels.log" 2>&1
krc=$?
if [ $krc = 0 ]; then
    # the worst passing check relative to its tolerance (bit-exact checks at 0 left out)
    worst=$(awk '/PASS/ { for (i = 1; i < NF; i++) { if ($i == "max_rel_err") e = $(i + 1); if ($i == "tol") t = $(i + 1) }
                 if (t + 0 > 0 && e / t >= w) { w = e / t; l = $0 } } END { gsub(/  +/, " ", l); print l }' "$OUT/kernels.log")
    row kernels ok "$(grep -c PASS "$OUT/kernels.log") checks pass$([ $DRY = 1 ] && echo ' (CPU table: the harness only)'); closest to its tolerance: $worst"
else
    row kernels FAIL "$(grep -v PASS "$OUT/kernels.log" | head -3 | tr '\n' ';')"
fi

# ---- NCCL, two or more GPUs
if [ "$NGPU" -ge 2 ]; then
    if "$B/tests/gpu/nccl_check" >"$OUT/nccl.log" 2>&1; then
        row nccl ok "$(tail -1 "$OUT/nccl.log")"
    else
        row nccl FAIL "$(tail -2 "$OUT/nccl.log" | tr '\n' ';')"
    fi
else
    row nccl skip "one GPU (nvidia-smi -L lists $NGPU)"
fi

# ---- kill and resume on the GPU: the demo model
TR="$B/train"
SMALL=(--data "$DATA/train_*.bin" --n-layer 4 --n-embd 128 --n-head 4 --seq-len 128
       --micro-batch 8 --grad-accum 2 --steps 120 --log-every 10 --seed 7)
rm -rf "$OUT/ref" "$OUT/kill" "$OUT/cpu"
"$TR" "${SMALL[@]}" --device "$DEV" --ckpt-dir "$OUT/ref" --ckpt-every 40 >"$OUT/ref.log" 2>&1
ref=$(digest "$OUT/ref.log")
kill_at_70() { # kill_at_70 LOG COMMAND...: run it, SIGKILL it once LOG shows step 70; the last step
    local log="$1"
    shift
    ( "$@" >"$log" 2>&1 ) &
    local kpid=$!
    for _ in $(seq 1 600); do
        grep -q 'step 70/' "$log" 2>/dev/null && break
        kill -0 $kpid 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL $kpid 2>/dev/null
    wait $kpid 2>/dev/null
    grep -o 'step [0-9]*/' "$log" | tail -1 | tr -dc 0-9
}
killed_at=$(kill_at_70 "$OUT/kill1.log" "$TR" "${SMALL[@]}" --device "$DEV" --ckpt-dir "$OUT/kill" \
    --ckpt-every 20 --log-every 1)
"$TR" "${SMALL[@]}" --device "$DEV" --ckpt-dir "$OUT/kill" --ckpt-every 20 --resume auto \
    >"$OUT/kill2.log" 2>&1
res=$(digest "$OUT/kill2.log")
from=$(grep -o 'resumed from .* at step [0-9]*' "$OUT/kill2.log" | head -1 | sed 's/.* at //')
if [ -n "$ref" ] && [ "$ref" = "$res" ]; then
    row resume ok "killed at step ${killed_at:-?}, resumed at ${from:-?}; digest ${ref:0:16} equal"
else
    row resume FAIL "uninterrupted ${ref:-none} vs resumed ${res:-none} (see $OUT/kill2.log)"
fi

# ---- the memory tier, asynchronous (the default on CUDA): copies from the GPU straight into
# the pinned shared-memory slots; killed at step 70, resumed from memory, same digest
MEMP="/dev/shm/ckptmem-gpurun-$$"
rm -rf "$OUT/mem"
mkilled=$(kill_at_70 "$OUT/mem1.log" env CKPT_MEM_PATH="$MEMP" "$TR" "${SMALL[@]}" --device "$DEV" \
    --ckpt-dir "$OUT/mem" --ckpt-every 40 --mem-snapshot-mode async --log-every 1)
CKPT_MEM_PATH="$MEMP" "$TR" "${SMALL[@]}" --device "$DEV" --ckpt-dir "$OUT/mem" --ckpt-every 40 \
    --mem-snapshot-mode async --resume auto >"$OUT/mem2.log" 2>&1
mres=$(digest "$OUT/mem2.log")
mfrom=$(grep -o 'resumed from memory ([a-z]*) at step [0-9]*' "$OUT/mem2.log" | head -1 | sed 's/.* at //')
mstall=$(grep -o 'memory snapshots: [0-9]* taken, stall [0-9.]* ms mean, [0-9.]* ms max' "$OUT/mem2.log" | tail -1)
rm -f "$MEMP".*
if [ -n "$ref" ] && [ "$ref" = "$mres" ] && [ -n "$mfrom" ]; then
    row memtier ok "async: killed at step ${mkilled:-?}, resumed from memory at $mfrom; digest equal; ${mstall:-no summary}"
else
    row memtier FAIL "resumed from memory at ${mfrom:-none}; uninterrupted ${ref:-none} vs ${mres:-none} (see $OUT/mem2.log)"
fi

# ---- a GPU snapshot restored on the CPU backend (same weights), and the other way
last=$(ls -d "$OUT/ref"/step-* 2>/dev/null | sort | tail -1)
if [ -n "$last" ]; then
    "$TR" "${SMALL[@]}" --device cpu --resume "$last" >"$OUT/g2c.log" 2>&1
    g2c=$(digest "$OUT/g2c.log")
    if [ -n "$g2c" ] && [ "$g2c" = "$ref" ]; then row gpu-cpu ok "$(basename "$last") on cpu: ${g2c:0:16} equal"
    else row gpu-cpu FAIL "gpu ${ref:-none} vs cpu ${g2c:-none}"; fi
else
    row gpu-cpu FAIL "no snapshot in $OUT/ref"
fi
CPUS=(--data "$DATA/train_*.bin" --n-layer 2 --n-embd 64 --n-head 2 --seq-len 64
      --micro-batch 4 --steps 20 --seed 7)
"$TR" "${CPUS[@]}" --device cpu --ckpt-dir "$OUT/cpu" --ckpt-every 20 >"$OUT/cpu.log" 2>&1
cpud=$(digest "$OUT/cpu.log")
"$TR" "${CPUS[@]}" --device "$DEV" --resume "$OUT/cpu/step-000000020" >"$OUT/c2g.log" 2>&1
c2g=$(digest "$OUT/c2g.log")
if [ -n "$c2g" ] && [ "$c2g" = "$cpud" ]; then row cpu-gpu ok "cpu snapshot on cuda: ${c2g:0:16} equal"
else row cpu-gpu FAIL "cpu ${cpud:-none} vs cuda ${c2g:-none}"; fi

# ---- GPT-2 124M bf16: tokens/s next to llm.c, the snapshot stall next to a bare D2H copy
med_toks() { # median tok/s of the step lines after the first 3
    grep -o '[0-9]* tok/s' "$1" | awk 'NR > 3 {print $1}' | sort -n | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]; else print 0}'
}
if [ $QUICK = 0 ]; then
    BIG=(--data "$DATA/train_*.bin" --vocab 50257 --n-layer 12 --n-embd 768 --n-head 12
         --seq-len 1024 --micro-batch 16 --grad-accum 1 --steps 12 --log-every 1 --device cuda
         --dtype bf16)
    [ $DRY = 1 ] && BIG=(--data "$DATA/train_*.bin" --vocab 50257 --n-layer 2 --n-embd 128
         --n-head 4 --seq-len 256 --micro-batch 4 --grad-accum 1 --steps 12 --log-every 1
         --device cpu --dtype bf16)
    rm -rf "$OUT/big"
    CKPT_LOG_LEVEL=debug timeout 240 "$TR" "${BIG[@]}" --ckpt-dir "$OUT/big" --ckpt-every 6 \
        --keep-last 1 >"$OUT/big.log" 2>&1
    ours=$(med_toks "$OUT/big.log")
    rm -rf "$OUT/llmc" && cp -r "$ROOT/../shared/peers/llm.c" "$OUT/llmc"
    if (cd "$OUT/llmc" && make train_gpt2cu NO_MULTI_GPU=1 NO_USE_MPI=1 GPU_COMPUTE_CAPABILITY=90 \
            >"$OUT/llmc-build.log" 2>&1); then
        [ $DRY = 1 ] || (cd "$OUT/llmc" && timeout 180 ./train_gpt2cu -i "$DATA/train_*.bin" -j "$DATA/val_*.bin" \
            -e d12 -b 16 -t 1024 -x 12 -v 100000 -s 100000 -m 2 >"$OUT/llmc.log" 2>&1)
        [ $DRY = 1 ] || theirs=$(grep -o '[0-9.]* tok/s' "$OUT/llmc.log" | awk 'NR > 3 {print int($1)}' | sort -n |
                 awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]; else print 0}')
        [ $DRY = 1 ] && theirs="(built, not run: no GPU)"
    else
        theirs=0
        [ $DRY = 1 ] && theirs="(build FAILED: $OUT/llmc-build.log)"
    fi
    if [ "${ours:-0}" -gt 0 ]; then
        ratio=$(awk -v a="$ours" -v b="${theirs:-0}" 'BEGIN {if (b + 0 > 0) printf "%.2f", a / b; else print "n/a"}')
        what="124M bf16 16x1024"
        [ $DRY = 1 ] && what="dry run: 2 x 128 bf16 4x256 on the CPU"
        mem=$(grep -o 'bf16 working parameters [0-9.]* MiB, activations [0-9.]* MiB' "$OUT/big.log" | head -1)
        row tokens/s ok "ours $ours, llm.c ${theirs:-0} (ratio $ratio), $what; ${mem:-no model memory line}"
    else
        row tokens/s FAIL "no step line in $OUT/big.log: $(grep -m1 -iE 'error|fail' "$OUT/big.log")"
    fi
    st=$(grep -o 'stall [0-9.]* ms for [0-9.]* MiB' "$OUT/big.log" | tail -1)
    smib=$(echo "$st" | awk '{print int($5 + 0.5)}')
    if [ -n "$st" ] && [ "${smib:-0}" -gt 0 ]; then
        bare=$("$B/tests/gpu/copy_bench" --device "$DEV" "$smib" 5 2>&1 | tail -1)
        pers=$(grep -o 'persist [0-9]* ms[^,]*, [0-9.]* MiB/s' "$OUT/big.log" | tail -1)
        # the second part of the stall: the next update's wait for the copies (and digests)
        wt=$(grep -o 'waited [0-9.]* ms for its copies' "$OUT/big.log" | tail -1)
        # the record's digests, hashed on the digest thread while the next step computes
        dg=$(grep -o 'digests hashed on the [a-z]* thread ([0-9.]* ms of hashing)' "$OUT/big.log" | tail -1)
        row stall ok "$st, ${wt:-no wait logged}; bare copy: $(echo "$bare" | grep -o 'd2h_ms=[0-9.]* d2h_gbps=[0-9.]*'); $pers; ${dg:-no digests line}"
    else
        row stall FAIL "no stall line in $OUT/big.log"
    fi
    # the restore of that snapshot (--steps 12: loads, checks, trains nothing): slices read and
    # decompressed into pinned bounce buffers while the previous slice is copied to the device
    # (the CPU dry run forces that path with CKPT_RESTORE_STAGED=1)
    CKPT_RESTORE_STAGED=1 timeout 120 "$TR" "${BIG[@]}" --ckpt-dir "$OUT/big" --resume auto \
        >"$OUT/big-resume.log" 2>&1
    rs=$(grep -o 'restore into [^:]*: [0-9.]* MiB' "$OUT/big-resume.log" | tail -1)
    rms=$(grep -o 'loaded and checked in [0-9.]* ms' "$OUT/big-resume.log" | tail -1 | grep -o '[0-9.]* ms')
    rmib=$(echo "$rs" | awk '{print $(NF - 1)}')
    if [ -n "$rs" ] && [ -n "$rms" ]; then
        rate=$(awk -v m="$rmib" -v t="${rms% ms}" 'BEGIN {if (t > 0) printf "%.0f", m / (t / 1000); else print "n/a"}')
        row restore ok "$rs in $rms (${rate} MiB/s, read + decompress + H2D + gather + digests)"
    else
        row restore FAIL "no staged restore in $OUT/big-resume.log: $(grep -m1 -iE 'error|fail|skipping' "$OUT/big-resume.log")"
    fi
else
    row tokens/s skip "--quick"
fi

table
exit $failed
