#!/usr/bin/env bash
# tests/gpu/run.sh - the GPU check of the CUDA trainer (issue 11), one script for a machine
# with one or more NVIDIA GPUs. It builds, checks and measures, in under 8 minutes on one
# H200, and prints one table (also written to $RUN/table.txt):
#   build         meson + ninja with -Dcuda=enabled into build-gpu/ (sm_80/sm_90 SASS + PTX),
#                 or with --bundle the programs built by tests/gpu/bundle.sh elsewhere
#   fatbin        the build suite: sm_90 SASS and PTX embedded, no spills in hot kernels
#                 (with --bundle: its result where the bundle was built)
#   kernels       every CUDA op against its CPU reference on fresh random inputs in five
#                 shapes (fp32 1e-5 relative, bf16 GEMMs 5e-4, bf16 outputs 1e-2), and
#                 bit-identical twice (tests/gpu/kernel_check; the dry run: its harness on
#                 the CPU table, kernel_check_cpu)
#   device        the device layer's CUDA smoke test (tests/unit/test_device: memory, copies,
#                 streams, events, pinned and registered memory) and the stager's checks on
#                 the GPU (test_train_stage with TRAIN_STAGE_TEST_DEVICE=cuda)
#   nccl          multi-rank collectives (tree bits stable, ring, a killed rank is an error)
#                 where `nvidia-smi -L` lists two or more GPUs, else the same on one rank
#                 (nccl_check --single: a W=1 communicator, no kill)
#   resume        the demo model on the GPU: uninterrupted vs SIGKILLed + --resume auto:
#                 the same params_digest
#   memtier       the same with the memory tier (CKPT_MEM_PATH, --mem-snapshot-mode async:
#                 copies from the GPU into the pinned shared-memory slots): resumed from
#                 memory, the same digest
#   gpu->cpu      the GPU run's last snapshot restored by --device cpu: the same digest
#   cpu->gpu      a CPU run's snapshot restored by --device cuda: the same digest
#   ranks         with two or more GPUs (or the emulator): two ranks under elastic (NCCL tree
#                 reduce, ZeRO-1) give one rank's bits with --grad-accum 2, and a rank
#                 SIGKILLed mid-run: the group restarts, resumes, ends with the same digest
#   tokens/s      GPT-2 124M (12 x 768, 12 heads, vocab 50257) bf16, micro-batch 16 x 1024,
#                 next to llm.c's train_gpt2cu (../shared/peers/llm.c, `-e d12`, same shards)
#   stall         the 124M run's snapshot stall (ms) next to a bare pinned D2H copy of the
#                 same bytes (tests/gpu/copy_bench), the persist throughput (MiB/s) and
#                 where and how long the record's digests were hashed
#   restore       that snapshot resumed: MiB restored through the pinned bounce buffers and
#                 the copy stream (decompression overlapped with the H2D copies), ms, MiB/s
# Usage: tests/gpu/run.sh [--quick] [--cpu-dry-run | --emu] [--bundle FILE] [--results DIR]
#   --quick        skip llm.c and the 124M runs
#   --bundle FILE  a tests/gpu/bundle.sh output: its programs, libraries (LD_LIBRARY_PATH,
#                  with the machine's own cudart/cuBLAS/NCCL found by name), token shards
#                  and llm.c's train_gpt2cu, instead of building here: for a GPU machine
#                  without our build dependencies (the device tool's; see docs/CUDA.md)
#   --results DIR  also write table.txt (row by row, so a run cut short still leaves one)
#                  and logs.tgz (every log; no snapshots) there: the device tool's $OUT
#   --cpu-dry-run  on a machine without a GPU: the same steps with --device cpu, a small model
#                  instead of the 124M one, llm.c's train_gpt2cu built but not run, the GPU
#                  programs' skips (77) as "skip" rows: checks the script itself (its parsing,
#                  its commands, the llm.c build) before device time is spent on it
#   --emu          on a machine without a GPU: the same steps with --device cuda on the CUDA
#                  emulator (tests/cuda_emu; build-emu/, configured with -Dgpu_emu=true):
#                  the CUDA host code, kernels/cuda and dcomm_nccl (one rank) run for real,
#                  on a smaller model (2 x 64, 2 x 32 tokens a step, 80 steps, killed at 50);
#                  no fatbin, llm.c or speed rows
#                  (an emulator's speed means nothing). CI runs this (scripts/test)
# Every program runs under a timeout (90 s the small runs, 150 s kernel_check and
# nccl_check, 200 s the 124M run, 150 s llm.c, 120 s the restore): a hang is a FAIL row, not
# a lost session; the whole script ends within about 8 minutes even so.
# Environment: GPU_RUN_DIR (work folder; default /tmp/ckpt-gpu-run), DATA (token shards;
# default data/brown, made by scripts/demo's set-up), JOBS (build parallelism; default nproc),
# B (the build folder; default build-gpu/, configured here with -Dcuda=enabled when missing),
# LLMC (llm.c's source; default ../shared/peers/llm.c).
# Exit status: 0 every check passed, 1 a check failed, 77 no GPU here (without --cpu-dry-run).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
RUN="${GPU_RUN_DIR:-/tmp/ckpt-gpu-run}"
DATA="${DATA:-$ROOT/data/brown}"
JOBS="${JOBS:-$(nproc)}"
B="${B:-$ROOT/build-gpu}"
LLMC="${LLMC:-$ROOT/../shared/peers/llm.c}"
QUICK=0
DRY=0
EMU=0
BUNDLE=
RESULTS=
while [ $# -gt 0 ]; do
    case "$1" in
    --quick) QUICK=1 ;;
    --cpu-dry-run) DRY=1 ;;
    --emu) EMU=1; QUICK=1 ;;
    --bundle) BUNDLE="${2:?--bundle FILE}"; shift ;;
    --results) RESULTS="${2:?--results DIR}"; shift ;;
    *) echo "tests/gpu/run.sh: unknown argument $1 (see the header)" >&2; exit 2 ;;
    esac
    shift
done
DEV=cuda
[ $DRY = 1 ] && DEV=cpu
if [ $EMU = 1 ]; then
    [ $DRY = 0 ] && [ -z "$BUNDLE" ] || { echo "tests/gpu/run.sh: --emu goes with neither --cpu-dry-run nor --bundle" >&2; exit 2; }
    B="${B_EMU:-$ROOT/build-emu}"
    RUN="${GPU_RUN_DIR:-/tmp/ckpt-gpu-emu}"
    export CUDA_EMU_DEVICES="${CUDA_EMU_DEVICES:-3}" # nccl_check W=3 (odd), two-rank training
fi
export PATH="/usr/local/cuda/bin:$PATH" # nvcc for meson and llm.c's Makefile
T0=$SECONDS

rows=()
failed=0
# the table so far, in $RUN/table.txt and --results' (rewritten at each row)
write_table() {
    {
        echo "== tests/gpu/run.sh: $(date -u +%FT%TZ), $((SECONDS - T0)) s${1:-}"
        echo "gpus: ${GPUS:-?}${BUNDLE:+; bundle: $(head -1 "$RUN/bundle/BUNDLE" 2>/dev/null)}"
        printf '%-10s %-5s %s\n' check result figures
        for r in "${rows[@]}"; do echo "$r"; done
    } >"$RUN/table.txt"
    [ -z "$RESULTS" ] || cp "$RUN/table.txt" "$RESULTS/table.txt"
}
row() { # row NAME RESULT FIGURES
    rows+=("$(printf '%-10s %-5s %s' "$1" "$2" "$3")")
    [ "$2" = "FAIL" ] && failed=1
    printf '[gpu %4ds] %-10s %-5s %s\n' "$((SECONDS - T0))" "$1" "$2" "$3"
    write_table " (running)"
}
table() {
    write_table
    cat "$RUN/table.txt"
    [ -z "$RESULTS" ] || (cd "$RUN" && find . -maxdepth 2 \( -name '*.log' -o -name '*.txt' -o -name BUNDLE \) -print0 |
        tar --null -czf "$RESULTS/logs.tgz" -T - 2>/dev/null)
}
digest() { sed -n 's/.*params_digest=\([0-9a-f]*\).*/\1/p' "$1" | tail -1; }

mkdir -p "$RUN"
[ -z "$RESULTS" ] || mkdir -p "$RESULTS"
if [ $DRY = 1 ]; then
    echo "GPU 0: none (--cpu-dry-run: every step with --device cpu)" >"$RUN/gpus.txt"
elif [ $EMU = 1 ]; then
    for g in $(seq 0 $((CUDA_EMU_DEVICES - 1))); do
        echo "GPU $g: cuda-emu (the CPU emulator of tests/cuda_emu; --device cuda on it)"
    done >"$RUN/gpus.txt"
elif ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >"$RUN/gpus.txt" 2>&1; then
    echo "tests/gpu/run.sh: no GPU here (nvidia-smi -L failed): skipped"
    exit 77
fi
NGPU=$(grep -c '^GPU ' "$RUN/gpus.txt" || true)
GPUS="$NGPU: $(head -1 "$RUN/gpus.txt")"
[ "$NGPU" -ge 1 ] || { echo "tests/gpu/run.sh: nvidia-smi lists no GPU: skipped"; exit 77; }

# ---- build, or the bundle's programs
t=$SECONDS
LLMC_BIN=
if [ -n "$BUNDLE" ]; then
    rm -rf "$RUN/bundle" && mkdir -p "$RUN/bundle"
    if ! tar -C "$RUN/bundle" -xzf "$BUNDLE" 2>"$RUN/bundle.log"; then
        row build FAIL "cannot unpack $BUNDLE: $(head -1 "$RUN/bundle.log")"
        table; exit 1
    fi
    B="$RUN/bundle/build"
    [ -d "$DATA" ] || DATA="$RUN/bundle/data"
    LLMC_BIN="$RUN/bundle/llmc/train_gpt2cu"
    # cudart, cuBLAS(Lt) and NCCL are this machine's: the CUDA toolkit's, or the pip wheels'
    # (nvidia-cublas, nvidia-nccl-cu13) - the folders of the first of each found
    # (the toolkit's folders first; one bounded find for the rest)
    libdirs="$RUN/bundle/lib"
    rest=()
    for so in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
        d=$(ls -d /usr/local/cuda/lib64/"$so" /usr/local/cuda/lib/"$so" /usr/local/cuda-*/lib64/"$so" \
            /usr/lib/x86_64-linux-gnu/"$so" 2>/dev/null | head -1)
        if [ -n "$d" ]; then libdirs="$libdirs:$(dirname "$d")"; else rest+=(-o -name "$so"); fi
    done
    if [ ${#rest[@]} -gt 0 ]; then
        for d in $(timeout 60 find /opt /usr/local /usr/lib /root -not -path '*/stubs/*' \( -false "${rest[@]}" \) \
                   2>/dev/null | xargs -r -n1 dirname | sort -u); do
            libdirs="$libdirs:$d"
        done
    fi
    export LD_LIBRARY_PATH="$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" >"$RUN/ldd.log"
    for p in "$B/train" "$B/tests/gpu/kernel_check" "$B/tests/gpu/nccl_check" "$LLMC_BIN"; do
        ldd "$p" >>"$RUN/ldd.log" 2>&1
    done
    missing=$(grep 'not found' "$RUN/ldd.log" | awk '{print $1}' | sort -u | tr '\n' ' ')
    if [ -n "$missing" ]; then
        row build FAIL "bundle: libraries not found here: $missing(see $RUN/ldd.log)"
        table; exit 1
    fi
    row build ok "bundle: $(head -2 "$RUN/bundle/BUNDLE" | tr '\n' ' ')"
    if grep -q '^fatbin: fatbin of' "$RUN/bundle/BUNDLE"; then
        row fatbin ok "$(sed -n 's/^fatbin: //p' "$RUN/bundle/BUNDLE") (where the bundle was built)"
    else
        row fatbin FAIL "the bundle has no fatbin result"
    fi
else
    setup_args=(-Dcuda=enabled -Dbuildtype=release)
    [ $EMU = 1 ] && setup_args=(-Dgpu_emu=true -Dfuzz=disabled -Dbuildtype=release)
    if [ -f "$B/build.ninja" ] || meson setup "$B" "${setup_args[@]}" >"$RUN/setup.log" 2>&1; then
        # the emulator's build: only the programs this script runs (half the compile)
        targets=()
        [ $EMU = 1 ] && targets=(train elastic/elastic tests/gpu/kernel_check tests/gpu/nccl_check
            tests/unit/test_device tests/unit/test_train_stage tests/cuda_emu/emu_selftest)
        if ninja -C "$B" -j "$JOBS" "${targets[@]}" >"$RUN/build.log" 2>&1; then
            row build ok "$((SECONDS - t)) s"
        else
            row build FAIL "see $RUN/build.log: $(grep -m1 -i error "$RUN/build.log")"
            table; exit 1
        fi
    else
        row build FAIL "meson setup: see $RUN/setup.log (no GPU build here? tests/gpu/bundle.sh)"
        table; exit 1
    fi

    # ---- fatbin and spills (the same test CI runs)
    if [ $EMU = 1 ]; then
        row fatbin skip "the emulator runs no GPU code"
    elif meson test -C "$B" --suite build --verbose >"$RUN/fatbin.log" 2>&1; then
        row fatbin ok "$(grep -m1 -o 'fatbin of [^:]*: [^:]*' "$RUN/fatbin.log"); $(grep -m1 -o 'zero spill.*' "$RUN/fatbin.log")"
    else
        row fatbin FAIL "see $RUN/fatbin.log"
    fi
fi
if ! ls "$DATA"/train_*.bin >/dev/null 2>&1; then
    row data FAIL "no token shards in $DATA (scripts/demo's set-up makes data/brown; --bundle carries them)"
    table; exit 1
fi

# ---- kernels vs CPU reference
KC="$B/tests/gpu/kernel_check"
[ $DRY = 1 ] && KC="$B/tests/gpu/kernel_check_cpu" # no GPU: the harness on the CPU table
# freed host buffers stay in the heap (no fresh mmap and page faults for each 64 MiB one)
MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \
    timeout 150 "$KC" >"$RUN/kernels.log" 2>&1
krc=$?
if [ $krc = 0 ]; then
    # the worst passing check relative to its tolerance (bit-exact checks at 0 left out)
    worst=$(awk '/PASS/ { for (i = 1; i < NF; i++) { if ($i == "max_rel_err") e = $(i + 1); if ($i == "tol") t = $(i + 1) }
                 if (t + 0 > 0 && e / t >= w) { w = e / t; l = $0 } } END { gsub(/  +/, " ", l); print l }' "$RUN/kernels.log")
    row kernels ok "$(grep -c PASS "$RUN/kernels.log") checks pass$([ $DRY = 1 ] && echo ' (CPU table: the harness only)'); closest to its tolerance: $worst"
else
    row kernels FAIL "$(grep -v PASS "$RUN/kernels.log" | head -3 | tr '\n' ';')"
fi

# ---- the device layer and the stager on the GPU (their CPU runs are CI's unit tests)
if timeout 120 "$B/tests/unit/test_device" >"$RUN/device.log" 2>&1 &&
   TRAIN_STAGE_TEST_DEVICE=$DEV timeout 120 "$B/tests/unit/test_train_stage" >>"$RUN/device.log" 2>&1; then
    row device ok "$(grep -m1 '^device: ' "$RUN/device.log"); $(grep -o 'test_[a-z_]*: all [0-9]* checks passed' "$RUN/device.log" | tr '\n' ';')"
else
    row device FAIL "$(grep -m2 -E 'FAIL|failed' "$RUN/device.log" | tr '\n' ';') (see $RUN/device.log)"
fi

# ---- the emulator's own test: what it computes, and the faults it exists to catch, caught
if [ $EMU = 1 ]; then
    if timeout 120 "$B/tests/cuda_emu/emu_selftest" >"$RUN/emu.log" 2>&1; then
        row emulator ok "$(grep -c 'checks, 0 failed' "$RUN/emu.log") cases of emu_selftest pass (faults: $(grep -c '^cuda-emu: fault' "$RUN/emu.log") reported)"
    else
        row emulator FAIL "$(grep -m2 FAIL "$RUN/emu.log" | tr '\n' ';') (see $RUN/emu.log)"
    fi
fi

# ---- NCCL: W ranks on two or more GPUs, else one rank (--single)
if [ $DRY = 1 ]; then
    row nccl skip "no GPU"
else
    nargs=()
    [ "$NGPU" -ge 2 ] || [ $EMU = 1 ] || nargs=(--single)
    if timeout 150 "$B/tests/gpu/nccl_check" "${nargs[@]}" >"$RUN/nccl.log" 2>&1; then
        row nccl ok "$(grep -m1 'NCCL W=' "$RUN/nccl.log"); $(grep -c 'killed rank' "$RUN/nccl.log") kill line(s)"
    else
        row nccl FAIL "exit $?: $(tail -2 "$RUN/nccl.log" | tr '\n' ';')"
    fi
fi

# ---- kill and resume on the GPU: the demo model
TR="$B/train"
SMALL=(--data "$DATA/train_*.bin" --n-layer 4 --n-embd 128 --n-head 4 --seq-len 128
       --micro-batch 8 --grad-accum 2 --steps 120 --log-every 10 --seed 7)
KILL_AT=70
# the emulator runs kernels a thread at a time: a smaller model, fewer steps
[ $EMU = 1 ] && KILL_AT=50 && SMALL=(--data "$DATA/train_*.bin" --n-layer 2 --n-embd 64 --n-head 2
       --seq-len 32 --micro-batch 2 --grad-accum 1 --steps 80 --log-every 10 --seed 7)
rm -rf "$RUN/ref" "$RUN/kill" "$RUN/cpu"
timeout 90 "$TR" "${SMALL[@]}" --device "$DEV" --ckpt-dir "$RUN/ref" --ckpt-every 40 >"$RUN/ref.log" 2>&1
ref=$(digest "$RUN/ref.log")
kill_at_70() { # kill_at_70 LOG COMMAND...: run it, SIGKILL it once LOG shows step $KILL_AT; the last step
    local log="$1"
    shift
    ( "$@" >"$log" 2>&1 ) &
    local kpid=$!
    for _ in $(seq 1 600); do
        grep -q "step $KILL_AT/" "$log" 2>/dev/null && break
        kill -0 $kpid 2>/dev/null || break
        sleep 0.1
    done
    kill -KILL $kpid 2>/dev/null
    wait $kpid 2>/dev/null
    grep -o 'step [0-9]*/' "$log" | tail -1 | tr -dc 0-9
}
killed_at=$(kill_at_70 "$RUN/kill1.log" "$TR" "${SMALL[@]}" --device "$DEV" --ckpt-dir "$RUN/kill" \
    --ckpt-every 20 --log-every 1)
timeout 90 "$TR" "${SMALL[@]}" --device "$DEV" --ckpt-dir "$RUN/kill" --ckpt-every 20 --resume auto \
    >"$RUN/kill2.log" 2>&1
res=$(digest "$RUN/kill2.log")
from=$(grep -o 'resumed from .* at step [0-9]*' "$RUN/kill2.log" | head -1 | sed 's/.* at //')
if [ -n "$ref" ] && [ "$ref" = "$res" ]; then
    row resume ok "killed at step ${killed_at:-?}, resumed at ${from:-?}; digest ${ref:0:16} equal"
else
    row resume FAIL "uninterrupted ${ref:-none} vs resumed ${res:-none} (see $RUN/kill2.log)"
fi

# ---- the memory tier, asynchronous (the default on CUDA): copies from the GPU straight into
# the pinned shared-memory slots; killed at step $KILL_AT, resumed from memory, same digest
MEMP="/dev/shm/ckptmem-gpurun-$$"
rm -rf "$RUN/mem"
mkilled=$(kill_at_70 "$RUN/mem1.log" env CKPT_MEM_PATH="$MEMP" "$TR" "${SMALL[@]}" --device "$DEV" \
    --ckpt-dir "$RUN/mem" --ckpt-every 40 --mem-snapshot-mode async --log-every 1)
CKPT_MEM_PATH="$MEMP" timeout 90 "$TR" "${SMALL[@]}" --device "$DEV" --ckpt-dir "$RUN/mem" --ckpt-every 40 \
    --mem-snapshot-mode async --resume auto >"$RUN/mem2.log" 2>&1
mres=$(digest "$RUN/mem2.log")
mfrom=$(grep -o 'resumed from memory ([a-z]*) at step [0-9]*' "$RUN/mem2.log" | head -1 | sed 's/.* at //')
mstall=$(grep -o 'memory snapshots: [0-9]* taken, stall [0-9.]* ms mean, [0-9.]* ms max' "$RUN/mem2.log" | tail -1)
rm -f "$MEMP".*
if [ -n "$ref" ] && [ "$ref" = "$mres" ] && [ -n "$mfrom" ]; then
    row memtier ok "async: killed at step ${mkilled:-?}, resumed from memory at $mfrom; digest equal; ${mstall:-no summary}"
else
    row memtier FAIL "resumed from memory at ${mfrom:-none}; uninterrupted ${ref:-none} vs ${mres:-none} (see $RUN/mem2.log)"
fi

# ---- a GPU snapshot restored on the CPU backend (same weights), and the other way
last=$(ls -d "$RUN/ref"/step-* 2>/dev/null | sort | tail -1)
if [ -n "$last" ]; then
    timeout 90 "$TR" "${SMALL[@]}" --device cpu --resume "$last" >"$RUN/g2c.log" 2>&1
    g2c=$(digest "$RUN/g2c.log")
    if [ -n "$g2c" ] && [ "$g2c" = "$ref" ]; then row gpu-cpu ok "$(basename "$last") on cpu: ${g2c:0:16} equal"
    else row gpu-cpu FAIL "gpu ${ref:-none} vs cpu ${g2c:-none}"; fi
else
    row gpu-cpu FAIL "no snapshot in $RUN/ref"
fi
CPUS=(--data "$DATA/train_*.bin" --n-layer 2 --n-embd 64 --n-head 2 --seq-len 64
      --micro-batch 4 --steps 20 --seed 7)
timeout 90 "$TR" "${CPUS[@]}" --device cpu --ckpt-dir "$RUN/cpu" --ckpt-every 20 >"$RUN/cpu.log" 2>&1
cpud=$(digest "$RUN/cpu.log")
timeout 90 "$TR" "${CPUS[@]}" --device "$DEV" --resume "$RUN/cpu/step-000000020" >"$RUN/c2g.log" 2>&1
c2g=$(digest "$RUN/c2g.log")
if [ -n "$c2g" ] && [ "$c2g" = "$cpud" ]; then row cpu-gpu ok "cpu snapshot on cuda: ${c2g:0:16} equal"
else row cpu-gpu FAIL "cpu ${cpud:-none} vs cuda ${c2g:-none}"; fi

# ---- two ranks: NCCL's tree reduce gives one rank's bits (grad-accum 2); a rank killed
# under elastic restarts the group, which resumes and ends with the same digest
if [ $EMU = 1 ] || [ "${NGPU:-0}" -ge 2 ]; then
    W2=(--data "$DATA/train_*.bin" --n-layer 2 --n-embd 64 --n-head 2 --seq-len 64
        --micro-batch 4 --steps 30 --log-every 1 --seed 7 --zero 1 --device cuda)
    [ $EMU = 1 ] && W2=(--data "$DATA/train_*.bin" --n-layer 2 --n-embd 64 --n-head 2 --seq-len 32
        --micro-batch 2 --steps 30 --log-every 1 --seed 7 --zero 1 --device cuda)
    EL="$B/elastic/elastic"
    rm -rf "$RUN/w2"
    touch "$RUN/ranks.start"
    timeout 90 "$TR" "${W2[@]}" --grad-accum 2 >"$RUN/w1ga2.log" 2>&1
    w1=$(digest "$RUN/w1ga2.log")
    timeout 120 "$EL" --nproc-per-node 2 -- "$TR" "${W2[@]}" >"$RUN/w2.log" 2>&1
    w2=$(digest "$RUN/w2.log")
    ( timeout 180 "$EL" --nproc-per-node 2 --max-restarts 1 -- "$TR" "${W2[@]}" --ckpt-dir "$RUN/w2" \
        --ckpt-every 10 --resume auto >"$RUN/w2kill.log" 2>&1 ) &
    epid=$!
    kpid=
    for _ in $(seq 1 900); do
        # rank 1 of round 0, once rank 0 is at step 15 (and round 0 still runs)
        if grep -q '\[rank 0\] .*step 15/' "$RUN/w2kill.log" 2>/dev/null; then
            grep -q 'round 1: started' "$RUN/w2kill.log" ||
                kpid=$(sed -n 's/.*round 0: started ranks 0\.\.1 of 2 (pids [0-9]* \([0-9]*\)).*/\1/p' "$RUN/w2kill.log" | head -1)
            break
        fi
        kill -0 $epid 2>/dev/null || break
        sleep 0.1
    done
    [ -n "$kpid" ] && kill -KILL "$kpid" 2>/dev/null
    wait $epid
    wk=$(digest "$RUN/w2kill.log")
    rounds=$(grep -c 'round [0-9]*: started' "$RUN/w2kill.log")
    wfrom=$(grep -o 'resumed from [^ ]* at step [0-9]*\|resumed from memory ([a-z]*) at step [0-9]*' "$RUN/w2kill.log" | head -1)
    # the emulator's NCCL files: the last rank alive removes them, the killed rank's included
    shm_left=
    [ $EMU = 1 ] && shm_left=$(find /dev/shm -maxdepth 1 -name 'cuda-emu-nccl-*' -newer "$RUN/ranks.start" 2>/dev/null | head -3 | tr '\n' ' ')
    if [ -n "$w1" ] && [ "$w1" = "$w2" ] && [ "$w2" = "$wk" ] && [ -n "$kpid" ] && [ "$rounds" = 2 ] && [ -z "$shm_left" ]; then
        row ranks ok "W=2 tree = W=1 grad-accum 2: ${w1:0:16}; rank 1 killed at step 15, round 1 ${wfrom:-resumed}: digest equal"
    else
        row ranks FAIL "W=1 ga2 ${w1:-none}, W=2 ${w2:-none}, killed ${wk:-none} (pid ${kpid:-not found}, $rounds rounds; see $RUN/w2kill.log)${shm_left:+; left in /dev/shm: $shm_left}"
    fi
else
    row ranks skip "one GPU"
fi

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
    rm -rf "$RUN/big"
    CKPT_LOG_LEVEL=debug timeout 200 "$TR" "${BIG[@]}" --ckpt-dir "$RUN/big" --ckpt-every 6 \
        --keep-last 1 >"$RUN/big.log" 2>&1
    ours=$(med_toks "$RUN/big.log")
    # llm.c: the bundle's train_gpt2cu, or built here from $LLMC
    rm -rf "$RUN/llmc" && mkdir -p "$RUN/llmc"
    if [ -n "$LLMC_BIN" ]; then
        cp "$LLMC_BIN" "$RUN/llmc/" && echo "prebuilt: $LLMC_BIN" >"$RUN/llmc-build.log"
    elif [ -f "$LLMC/Makefile" ]; then
        cp -r "$LLMC/." "$RUN/llmc" && (cd "$RUN/llmc" && timeout 300 make train_gpt2cu NO_MULTI_GPU=1 NO_USE_MPI=1 \
            GPU_COMPUTE_CAPABILITY=90 >"$RUN/llmc-build.log" 2>&1)
    else
        echo "no llm.c source in $LLMC" >"$RUN/llmc-build.log"
    fi
    if [ -x "$RUN/llmc/train_gpt2cu" ]; then
        [ $DRY = 1 ] || (cd "$RUN/llmc" && timeout 150 ./train_gpt2cu -i "$DATA/train_*.bin" -j "$DATA/val_*.bin" \
            -e d12 -b 16 -t 1024 -x 12 -v 100000 -s 100000 -m 2 >"$RUN/llmc.log" 2>&1)
        [ $DRY = 1 ] || theirs=$(grep -o '[0-9.]* tok/s' "$RUN/llmc.log" | awk 'NR > 3 {print int($1)}' | sort -n |
                 awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]; else print 0}')
        [ $DRY = 1 ] && theirs="(built, not run: no GPU)"
    else
        theirs=0
        [ $DRY = 1 ] && theirs="(build FAILED: $RUN/llmc-build.log)"
    fi
    [ $DRY = 1 ] || [ "${theirs:-0}" -gt 0 ] ||
        row llm.c FAIL "no tok/s from train_gpt2cu: $(tail -1 "$RUN/llmc-build.log"); $(grep -m1 -iE 'error|fail' "$RUN/llmc.log" 2>/dev/null)"
    if [ "${ours:-0}" -gt 0 ]; then
        ratio=$(awk -v a="$ours" -v b="${theirs:-0}" 'BEGIN {if (b + 0 > 0) printf "%.2f", a / b; else print "n/a"}')
        what="124M bf16 16x1024"
        [ $DRY = 1 ] && what="dry run: 2 x 128 bf16 4x256 on the CPU"
        mem=$(grep -o 'bf16 working parameters [0-9.]* MiB, activations [0-9.]* MiB' "$RUN/big.log" | head -1)
        row tokens/s ok "ours $ours, llm.c ${theirs:-0} (ratio $ratio), $what; ${mem:-no model memory line}"
    else
        row tokens/s FAIL "no step line in $RUN/big.log: $(grep -m1 -iE 'error|fail' "$RUN/big.log")"
    fi
    st=$(grep -o 'stall [0-9.]* ms for [0-9.]* MiB' "$RUN/big.log" | tail -1)
    smib=$(echo "$st" | awk '{print int($5 + 0.5)}')
    if [ -n "$st" ] && [ "${smib:-0}" -gt 0 ]; then
        bare=$("$B/tests/gpu/copy_bench" --device "$DEV" "$smib" 5 2>&1 | tail -1)
        pers=$(grep -o 'persist [0-9]* ms[^,]*, [0-9.]* MiB/s' "$RUN/big.log" | tail -1)
        # the second part of the stall: the next update's wait for the copies (and digests)
        wt=$(grep -o 'waited [0-9.]* ms for its copies' "$RUN/big.log" | tail -1)
        # the record's digests, hashed on the digest thread while the next step computes
        dg=$(grep -o 'digests hashed on the [a-z]* thread ([0-9.]* ms of hashing)' "$RUN/big.log" | tail -1)
        row stall ok "$st, ${wt:-no wait logged}; bare copy: $(echo "$bare" | grep -o 'd2h_ms=[0-9.]* d2h_gbps=[0-9.]*'); $pers; ${dg:-no digests line}"
    else
        row stall FAIL "no stall line in $RUN/big.log"
    fi
    # the restore of that snapshot (--steps 12: loads, checks, trains nothing): slices read and
    # decompressed into pinned bounce buffers while the previous slice is copied to the device
    # (the CPU dry run forces that path with CKPT_RESTORE_STAGED=1)
    CKPT_RESTORE_STAGED=1 timeout 120 "$TR" "${BIG[@]}" --ckpt-dir "$RUN/big" --resume auto \
        >"$RUN/big-resume.log" 2>&1
    rs=$(grep -o 'restore into [^:]*: [0-9.]* MiB' "$RUN/big-resume.log" | tail -1)
    rms=$(grep -o 'loaded and checked in [0-9.]* ms' "$RUN/big-resume.log" | tail -1 | grep -o '[0-9.]* ms')
    rmib=$(echo "$rs" | awk '{print $(NF - 1)}')
    if [ -n "$rs" ] && [ -n "$rms" ]; then
        rate=$(awk -v m="$rmib" -v t="${rms% ms}" 'BEGIN {if (t > 0) printf "%.0f", m / (t / 1000); else print "n/a"}')
        row restore ok "$rs in $rms (${rate} MiB/s, read + decompress + H2D + gather + digests)"
    else
        row restore FAIL "no staged restore in $RUN/big-resume.log: $(grep -m1 -iE 'error|fail|skipping' "$RUN/big-resume.log")"
    fi
else
    row tokens/s skip "$([ $EMU = 1 ] && echo 'the emulator: no speed figures' || echo --quick)"
fi

table
exit $failed
