#!/usr/bin/env bash
# bench/tier_bench.sh - the same snapshot restored from every tier in one run: own memory, a
# peer's replica, the local disk (cold and warm) and S3; then the training step time with a
# memory snapshot every step next to a disk snapshot every step and to none. Prints one table.
#
# Usage: bench/tier_bench.sh [--mib-per-rank N] [--reps R] [--train-steps N] [--no-train]
#                            [--no-s3] [--keep] [--build DIR]
#   --mib-per-rank N  fp32 state per rank (params, adam_m, adam_v shards; two ranks);
#                     default 300
#   --reps R          repetitions of each restore (best reported, worst shown); default 3
#   --train-steps N   steps of each training run; default 120
#   --no-train        skip the step-time rows
#   --no-s3           skip the S3 row (no RGW started)
#   --keep            leave the work folder
#   --build DIR       the build folder; default build/
# What runs:
#   make        s3_bench make: a committed W=2 disk snapshot (zstd -1 + shuffle, what train
#               writes) of a synthetic optimizer state
#   memory      tier_bench mem: each rank's memory snapshot written into its own segment with
#               ckpt_mem_write (the trainer's stage: copy fused with chunk checksums), beside
#               a plain memcpy of the same bytes; then each slot copied into a replica segment
#               as the agent's receiver stores what a peer sends
#   restore     tier_bench restore --world 2 of the same snapshot from: own memory
#               (CKPT_MEM_PATH = the own segments), the peer replica (CKPT_MEM_PATH = only
#               the replicas: what a node that lost its peer restores from), the local disk
#               after dropping the page cache (root; else marked warm), the local disk warm,
#               S3 (an RGW on loopback, tests/integration/s3env.py; uploaded with s3_bench
#               upload), and a peer agent's memory (tier_bench peer: the snapshot in an agent's
#               own segments, every rank's slot read through its memory server on loopback,
#               as a restore reads a slot held only on another node). Every chunk is checked
#               against its checksum in every row.
#   train       build/train on the demo model under elastic (the memory tier needs the agent's
#               CKPT_MEM_PATH), one after another, alternating: memory snapshot every step
#               (disk never), disk snapshot every step (memory off), no snapshot; median step
#               time of steps 6.. of each
# Exit status: 0 done (figures below target are flagged, not failed), 1 failure, 2 usage.
set -euo pipefail
source "$(dirname "$0")/../scripts/lib.sh"

MIB=300
REPS=3
TRAIN_STEPS=120
TRAIN=1
S3=1
KEEP=0
while [ $# -gt 0 ]; do
    case "$1" in
    --mib-per-rank) MIB=$2; shift 2 ;;
    --reps) REPS=$2; shift 2 ;;
    --train-steps) TRAIN_STEPS=$2; shift 2 ;;
    --no-train) TRAIN=0; shift ;;
    --no-s3) S3=0; shift ;;
    --keep) KEEP=1; shift ;;
    --build) BUILD=$(realpath "$2"); shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) printf "error: unknown argument '%s' (see --help)\n" "$1" >&2; exit 2 ;;
    esac
done
usage() { printf 'error: %s\n' "$*" >&2; exit 2; }
[[ "$MIB" =~ ^[0-9]+$ ]] && [ "$MIB" -ge 1 ] && [ "$MIB" -le 65536 ] || usage "--mib-per-rank must be in [1, 65536]"
[[ "$REPS" =~ ^[0-9]+$ ]] && [ "$REPS" -ge 1 ] && [ "$REPS" -le 20 ] || usage "--reps must be in [1, 20]"
[[ "$TRAIN_STEPS" =~ ^[0-9]+$ ]] && [ "$TRAIN_STEPS" -ge 10 ] || usage "--train-steps must be >= 10"

[ -f "$BUILD/build.ninja" ] || meson setup "$BUILD" "$ROOT" >/dev/null || die "meson setup failed"
ninja -C "$BUILD" bench/s3_bench bench/tier_bench train elastic/elastic >/dev/null \
    || { ninja -C "$BUILD" bench/s3_bench bench/tier_bench train elastic/elastic; die "build failed"; }
S3B="$BUILD/bench/s3_bench"
TB="$BUILD/bench/tier_bench"
if [ "$TRAIN" -eq 1 ] && [ ! -f "$ROOT/data/brown/train_000000.bin" ]; then
    die "no training data in data/brown (scripts/demo prepares it; --no-train skips the training rows)"
fi
SHM=/dev/shm
NEED_MIB=$((MIB * 2 * 2 * 3 + 256)) # own, replica and peer agent segments, two slots each
FREE_MIB=$(df -P -k "$SHM" | awk 'NR == 2 { printf "%d", $4 / 1024 }')
[ "$FREE_MIB" -ge "$NEED_MIB" ] || die "$SHM has $FREE_MIB MiB free, the run needs about $NEED_MIB MiB (try a smaller --mib-per-rank)"

TMPBASE=${TMPDIR:-/tmp}
WORK=$(mktemp -d "$TMPBASE/tier-bench.XXXXXX")
MEM=$(mktemp -d "$SHM/tier-bench.XXXXXX")
cleanup() {
    local rc=$?
    rgw_stop
    rm -rf "$MEM"
    if [ "$KEEP" -eq 0 ]; then rm -rf "$WORK"; else echo "work folder kept: $WORK" >&2; fi
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
export CKPT_LOG_LEVEL=${CKPT_LOG_LEVEL:-warn}
KV="$WORK/bench.kv"
: >"$KV"
busy_ticks() { awk '$1 == "cpu" { print $2 + $3 + $4 + $7 + $8; exit }' /proc/stat; }
BUSY0=$(busy_ticks)
T0=$EPOCHREALTIME

say "making a W=2 disk snapshot of $((MIB * 2)) MiB fp32 state" >&2
"$S3B" make --dir "$WORK/snap" --size-mib $((MIB * 2)) >>"$KV" || die "s3_bench make failed"
SNAP="$WORK/snap/step-000000001"
say "memory snapshots of both ranks and their replicas" >&2
"$TB" mem --from "$SNAP" --prefix "$MEM/own" --replica-prefix "$MEM/peer" --reps "$REPS" >>"$KV" \
    || die "tier_bench mem failed"
ID=$(awk '$1 == "mem_id" { print $2 }' "$KV")

if [ "$S3" -eq 1 ]; then
    say "starting RGW and uploading the snapshot" >&2
    rgw_start "$WORK" 16
    "$S3B" upload --dir "$WORK/snap" --url "s3://$S3ENV_BUCKET/tier" >"$WORK/upload.out" \
        || die "s3_bench upload failed"
fi

COLD=warm
restore() { # NAME SRC [ENV...]
    local name=$1 src=$2 out
    shift 2
    out=$(env "$@" "$TB" restore --from "$src" --world 2) || die "restore from $name failed"
    echo "$out" | awk -v n="$name" '$1 == "restore_s" { print "run." n, $2 } $1 == "restore_raw_bytes" { print "bytes." n, $2 }' >>"$KV"
}
for rep in $(seq "$REPS"); do
    say "restore repetition $rep of $REPS" >&2
    restore own "$ID" CKPT_MEM_PATH="$MEM/own"
    restore peer "$ID" CKPT_MEM_PATH="$MEM/peer"
    # the remote read: every rank's slot through an agent's memory server (its own segments
    # and this run's own_restore_s are written anew in $MEM/agent: only peer_restore_s counts)
    mkdir -p "$MEM/agent"
    out=$("$TB" peer --from "$SNAP" --dir "$MEM/agent" --world 2) || die "restore through a peer agent failed"
    echo "$out" | awk '$1 == "peer_restore_s" { print "run.peer_agent", $2 } $1 == "peer_restore_raw_bytes" { print "bytes.peer_agent", $2 }' >>"$KV"
    if [ "$(id -u)" -eq 0 ]; then
        sync
        echo 3 >/proc/sys/vm/drop_caches
        COLD=cold
    fi
    restore disk_cold "$SNAP"
    restore disk_warm "$SNAP"
    [ "$S3" -eq 0 ] || restore s3 "s3://$S3ENV_BUCKET/tier/step-000000001"
done
echo "disk_first $COLD" >>"$KV"

if [ "$TRAIN" -eq 1 ]; then
    pin_blas
    TARGS=(--data "$ROOT/data/brown/train_*.bin" --val-data "$ROOT/data/brown/val_*.bin"
           --n-layer 4 --n-embd 128 --n-head 4 --seq-len 128 --micro-batch 8 --global-batch 16
           --steps "$TRAIN_STEPS" --lr 3e-3 --warmup 20 --seed 1337 --log-every 1 --keep-last 2)
    train_run() { # NAME ARGS...: one run under elastic (one rank), its step lines
        local name=$1
        shift
        rm -rf "$WORK/ck-$name"
        CKPT_LOG_LEVEL=info "$BUILD/elastic/elastic" --nproc-per-node 1 --mem-dir "$MEM" -- "$BUILD/train" \
            "${TARGS[@]}" --ckpt-dir "$WORK/ck-$name" "$@" >"$WORK/train-$name.out" 2>"$WORK/train-$name.log" \
            || { tail -n 20 "$WORK/train-$name.log" >&2; die "training run $name failed"; }
        grep -E '\[train\] step [0-9]+/[0-9]+ loss ' "$WORK/train-$name.log" \
            | sed -nE 's/.* step ([0-9]+)\/[0-9]+ loss .* ([0-9.]+) ms.*/\1 \2/p' \
            | awk '$1 > 5 { print $2 }' >>"$WORK/steps-$name.txt"
        grep -o 'params_digest=[0-9a-f]*' "$WORK/train-$name.out" | tail -n 1 >"$WORK/digest-$name.txt" || true
    }
    for rep in 1 2; do
        say "training repetition $rep of 2: memory every step, disk every step, none" >&2
        train_run mem --mem-snapshot-every 1 --ckpt-every 100000
        train_run disk --mem-snapshot-every 0 --ckpt-every 1
        train_run none --mem-snapshot-every 0 --ckpt-every 100000
    done
    med() { sort -n "$1" | awk '{ v[NR] = $1 } END { if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }
    for n in mem disk none; do echo "train_${n}_ms $(med "$WORK/steps-$n.txt")" >>"$KV"; done
    same=yes
    for n in mem disk; do cmp -s "$WORK/digest-$n.txt" "$WORK/digest-none.txt" || same=NO; done
    [ -s "$WORK/digest-none.txt" ] || same=NO
    echo "train_same_digest $same" >>"$KV"
    echo "train_mem_snapshots $(grep -c 'memory snapshot' "$WORK/train-mem.log" || true)" >>"$KV"
fi
echo "machine_busy_s $(echo "($(busy_ticks) - $BUSY0) / $(getconf CLK_TCK)" | bc -l)" >>"$KV"
echo "elapsed_s $(echo "$EPOCHREALTIME - $T0" | bc -l)" >>"$KV"
echo "cores $(nproc)" >>"$KV"
echo "reps $REPS" >>"$KV"

awk '
$1 ~ /^run\./ { n = substr($1, 5); if (!(n in best) || $2 < best[n]) best[n] = $2 + 0; if (!(n in worst) || $2 > worst[n]) worst[n] = $2 + 0; next }
$1 ~ /^bytes\./ { bytes[substr($1, 7)] = $2 + 0; next }
{ k = $1; $1 = ""; sub(/^ /, ""); v[k] = $0 }
function row(label, n) {
    if (!(n in best)) { printf "%-46s %s\n", label, "n/a"; return }
    printf "%-46s %8.1f %9.1f %9.1f %9.0f %8.2f\n", label, bytes[n] / 1048576, best[n] * 1e3, worst[n] * 1e3,
        bytes[n] / 1048576 / best[n], (best["disk_cold"] > 0 ? best["disk_cold"] / best[n] : 0)
}
END {
    printf "tier bench: one W=2 snapshot, %.1f MiB fp32 state (%.1f MiB per rank), restored by 2 ranks (threads) of one process\n",
        v["mem_bytes"] / 1048576, v["mem_bytes"] / 2097152
    busy = v["machine_busy_s"] / (v["cores"] * v["elapsed_s"])
    printf "machine: %d cores, %.0f%% busy over the run (this bench included); best of %s, worst alongside\n\n", v["cores"], busy * 100, v["reps"]
    printf "%-46s %8s %9s %9s %9s %8s\n", "restore from", "MiB", "ms", "worst ms", "MiB/s", "vs disk"
    line = sprintf("%95s", ""); gsub(/ /, "-", line); print line
    row("own memory (segments on this node)", "own")
    row("peer replica (received from the peer node)", "peer")
    row("peer agent memory (remote reads, loopback)", "peer_agent")
    row("local disk, page cache dropped (" v["disk_first"] ")", "disk_cold")
    row("local disk, warm", "disk_warm")
    row("S3 (RGW on loopback)", "s3")
    print line
    w = v["mem_write_rank0_s"] + v["mem_write_rank1_s"]; c = v["memcpy_rank0_s"] + v["memcpy_rank1_s"]
    printf "memory snapshot (ckpt_mem_write, copy + chunk checksums), both ranks: %.1f ms, memcpy of the same bytes %.1f ms (%.2f x)\n",
        w * 1e3, c * 1e3, (c > 0 ? w / c : 0)
    printf "replica stored by the receiver (create + copy + commit), both ranks: %.1f ms\n", v["mem_replica_copy_s"] * 1e3
    if ("train_none_ms" in v) {
        m = v["train_none_ms"] > 0 ? v["train_mem_ms"] / v["train_none_ms"] : 0
        d = v["train_none_ms"] > 0 ? v["train_disk_ms"] / v["train_none_ms"] : 0
        printf "\ntraining (demo model under elastic, 1 rank, median step time of steps 6..; two runs each, alternating):\n"
        printf "  no snapshot %s ms; memory snapshot every step %s ms (%.3f); disk snapshot every step %s ms (%.3f)\n",
            v["train_none_ms"], v["train_mem_ms"], m, v["train_disk_ms"], d
        printf "  same params_digest in all runs: %s\n", v["train_same_digest"]
        printf "target: memory snapshot every step within 5%% of none: %.3f  %s\n", m, (m <= 1.05 ? "met" : "NOT MET")
    }
}' "$KV"
