#!/usr/bin/env bash
# bench/s3_bench.sh - the S3 tier against awscli on the same files and the same server, in one
# run; prints one table with the ratios, then the training step time with and without uploads.
#
# Usage: bench/s3_bench.sh [--gib G] [--reps R] [--codec zstd|none] [--part-mib N]
#                          [--train-steps N] [--no-train] [--keep] [--exe PATH] [--build DIR]
#   --gib G          snapshot size, GiB of fp32 state (three buffers, two ranks); default 2
#                    or $S3_BENCH_GIB
#   --reps R         repetitions of each transfer, ours and awscli alternating (the best is
#                    reported, the worst shown); default 2
#   --codec C        zstd (default: zstd -1 + shuffle, what train writes) or none (raw chunks)
#   --part-mib N     ours: --s3-part-mib, data files over N MiB become several objects;
#                    default 256
#   --train-steps N  steps of each of the two training runs; default 150
#   --train-every N  their --ckpt-every; default 1 (a snapshot, and with --s3 an upload, every
#                    step: the worst case)
#   --no-train       skip the training step-time comparison
#   --keep           leave the work folder (snapshot, downloads, logs)
#   --exe PATH       the s3_bench program; default BUILD/bench/s3_bench (built if needed)
#   --build DIR      the build folder (train, s3_bench); default build/
#   --report KV      only print the table of a kept run's WORK/bench.kv
# What runs, on one RGW (tests/integration/s3env.py: a single-node Ceph radosgw on loopback,
# started here and stopped at the end):
#   ours up      two ckpt_uploader instances (ranks 0 and 1, a memory group between them)
#                upload the W=2 snapshot (s3_bench upload): submit to both done, manifest last
#   awscli up    /usr/bin/aws s3 cp --recursive of the same snapshot folder (default awscli
#                settings: 10 requests in flight, 8 MiB multipart chunks)
#   ours down    ckpt_snapshot_open_s3 + each new rank reads its half (W=2: two threads, each
#                with its own store handle) or all (W=1) of every buffer into memory, every
#                chunk checked by the reader (s3_bench restore)
#   awscli down  aws s3 cp --recursive of awscli's copy into a folder on the local disk
#   Both uploads read the files from the page cache (warmed before each run).
#   train        build/train on the demo model, --ckpt-every 1, twice side by side: with --s3
#                (uploads running) and without; the median step time of each, and the CPU
#                time of each process per step (the difference is the uploader's). Side by
#                side, both runs share the RGW's CPU load: the ratio is the trainer's own cost
# Needs ceph-mon, ceph-osd, radosgw (Debian), /usr/bin/aws, python3, and free disk for the
# snapshot, awscli's download and the RGW block file (checked first). Takes about 4 minutes
# at the defaults on 2 cores. Exit status: 0 done (figures below target are flagged, not
# failed), 1 failure, 2 usage error.
set -euo pipefail
source "$(dirname "$0")/../scripts/lib.sh"

report() { # KV: the table
    awk '
function mibs(b, s) { return s > 0 ? b / s / 1048576 : 0 }
function row(label, name, base,   r, w) {
    if (!(name in best)) { printf "%-44s %s\n", label, "n/a"; return 0 }
    r = mibs(bytes[name], best[name]); w = mibs(bytes[name], worst[name])
    printf "%-44s %8.1f %7.2f %7.2f %8.1f %8.1f %8.2f %8.1f %8s\n", label, bytes[name] / 1048576, best[name], worst[name], r, w,
        (base > 0 ? r / base : 1), ccpu[name], sprintf("%.1f", scpu[name])
    return r
}
function verdict(x, t) { return x >= t ? "met" : "NOT MET" }
$1 ~ /^run\./ {
    n = substr($1, 5)
    if (!(n in best) || $2 < best[n]) { best[n] = $2 + 0; ccpu[n] = $3 + 0; scpu[n] = $4 + 0 }
    if (!(n in worst) || $2 > worst[n]) worst[n] = $2 + 0
    bytes[n] = $5 + 0
    next
}
{ k = $1; $1 = ""; sub(/^ /, ""); v[k] = $0 }
END {
    printf "S3 bench: one W=2 snapshot, %.1f MiB of fp32 state (params, adam_m, adam_v), codec %s: %.1f MiB in %s\n",
        v["raw_bytes"] / 1048576, v["codec"], v["files_bytes"] / 1048576, v["files"]
    printf "server: one RGW (Ceph radosgw, single-node, loopback) on this machine, %s cores shared with the clients\n", v["cores"]
    other = v["machine_busy_s"] - v["own_cpu_s"] - v["server_cpu_total_s"]
    if (other < 0) other = 0
    printf "other processes used %.1f CPU s of %.1f (%d cores x %.1f s)%s\n", other, v["cores"] * v["elapsed_s"], v["cores"],
        v["elapsed_s"], (other > 0.05 * v["cores"] * v["elapsed_s"] ? ": NOISY, figures may be low" : ": quiet")
    printf "ours: part size %s MiB, 8 requests in flight per store handle; awscli: default settings\n", v["upload_part_mib"]
    printf "best of %s (worst alongside); MiB = 2^20 bytes of the stored files; cpu: client (user + sys), server (RGW daemons)\n", v["reps"]
    printf "awscli: the whole command (its start-up included: an empty listing takes %.2f s); ours: the call (submit to done; open to last byte read)\n\n", v["aws_startup_s"]
    printf "%-44s %8s %7s %7s %8s %8s %8s %8s %8s\n", "operation", "MiB", "s", "worst s", "MiB/s", "worst", "vs aws", "cli cpu", "srv cpu"
    line = sprintf("%120s", ""); gsub(/ /, "-", line); print line
    au = row("awscli s3 cp --recursive, upload", "aws_up", 0)
    ou = row("ours: upload, 2 uploaders (W=2)", "ours_up", au)
    ad = row("awscli s3 cp --recursive, download to disk", "aws_down", 0)
    od = row("ours: restore W=2 (2 ranks, memory, checked)", "ours_down_w2", ad)
    o1 = row("ours: restore W=1 (1 rank, memory, checked)", "ours_down_w1", ad)
    print line
    printf "our requests (last run): upload %s (%s retries; each PUT also HEAD-checked inside objstore), rank 0 %.2f s, rank 1 %.2f s\n",
        v["upload_requests"], v["upload_retries"], v["upload_rank0_s"], v["upload_rank1_s"]
    printf "md5sum of rank 0 file (%.1f MiB): %.2f s, %.0f MiB/s (objstore hashes every PUT body once before sending it)\n",
        v["md5_bytes"] / 1048576, v["md5_s"], mibs(v["md5_bytes"], v["md5_s"])
    if (au > 0 && ad > 0) {
        printf "\ntarget upload  >= 1.5 x awscli: %.2f x  %s\n", ou / au, verdict(ou / au, 1.5)
        printf "target restore >= 1.5 x awscli: %.2f x  %s (W=2; W=1: %.2f x)\n", od / ad, verdict(od / ad, 1.5), o1 / ad
    }
    if ("train_s3_ms" in v) {
        r = v["train_local_ms"] > 0 ? v["train_s3_ms"] / v["train_local_ms"] : 0
        printf "\ntraining (demo model, 9.7 MiB snapshots, --ckpt-every %s, two runs side by side; %s snapshots on S3, %s failed, %s skipped):\n",
            v["train_every"], v["train_uploaded"], v["train_upload_failed"], v["train_upload_skipped"]
        printf "  step time (steps 6.. that ended while both ran: %s / %s) median %s ms with --s3, %s ms without; mean %s / %s ms\n",
            v["train_s3_n"], v["train_local_n"], v["train_s3_ms"], v["train_local_ms"], v["train_s3_mean_ms"], v["train_local_mean_ms"]
        printf "  CPU a step (the process, every thread) %.0f / %.0f ms: the uploader %+.0f ms a snapshot\n", v["train_s3_cpu_ms"],
            v["train_local_cpu_ms"], (v["train_s3_cpu_ms"] - v["train_local_cpu_ms"]) * v["train_every"]
        printf "target step time (median) with uploads within 5%%: ratio %.3f  %s; same params_digest: %s\n", r, (r <= 1.05 ? "met" : "NOT MET"), v["train_same_digest"]
    }
}' "$1" | sed 's/ *$//'
}


GIB=${S3_BENCH_GIB:-2}
REPS=2
CODEC=zstd
PART_MIB=256
TRAIN_STEPS=150
TRAIN_EVERY=1
TRAIN=1
KEEP=0
EXE=""
while [ $# -gt 0 ]; do
    case "$1" in
    --gib) GIB=$2; shift 2 ;;
    --reps) REPS=$2; shift 2 ;;
    --codec) CODEC=$2; shift 2 ;;
    --part-mib) PART_MIB=$2; shift 2 ;;
    --train-steps) TRAIN_STEPS=$2; shift 2 ;;
    --train-every) TRAIN_EVERY=$2; shift 2 ;;
    --no-train) TRAIN=0; shift ;;
    --keep) KEEP=1; shift ;;
    --exe) EXE=$2; shift 2 ;;
    --build) BUILD=$(realpath "$2"); shift 2 ;;
    --report) report "$2"; exit 0 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) printf "error: unknown argument '%s' (see --help)\n" "$1" >&2; exit 2 ;;
    esac
done
usage() { printf 'error: %s\n' "$*" >&2; exit 2; }
[[ "$GIB" =~ ^[0-9]+(\.[0-9]+)?$ ]] && awk -v g="$GIB" 'BEGIN { exit !(g >= 0.05 && g <= 64) }' \
    || usage "--gib must be a number in [0.05, 64]"
[[ "$REPS" =~ ^[0-9]+$ ]] && [ "$REPS" -ge 1 ] && [ "$REPS" -le 20 ] || usage "--reps must be in [1, 20]"
[[ "$CODEC" =~ ^(zstd|none)$ ]] || usage "--codec must be zstd or none"
[[ "$PART_MIB" =~ ^[0-9]+$ ]] && [ "$PART_MIB" -ge 1 ] && [ "$PART_MIB" -le 4096 ] \
    || usage "--part-mib must be in [1, 4096]"
[[ "$TRAIN_STEPS" =~ ^[0-9]+$ ]] && [ "$TRAIN_STEPS" -ge 10 ] || usage "--train-steps must be >= 10"
[[ "$TRAIN_EVERY" =~ ^[0-9]+$ ]] && [ "$TRAIN_EVERY" -ge 1 ] || usage "--train-every must be >= 1"
SIZE_MIB=$(awk -v g="$GIB" 'BEGIN { printf "%d", g * 1024 }')

AWS=/usr/bin/aws # not a pyenv shim named aws that may come first on PATH
for prog in ceph-mon ceph-osd radosgw python3 "$AWS"; do # rgw_start checks them too
    command -v "$prog" >/dev/null || die "$prog is not installed (scripts/lib.sh PKGS: ceph-mon ceph-osd radosgw ceph-common awscli)"
done
if [ -z "$EXE" ]; then
    EXE="$BUILD/bench/s3_bench"
    [ -f "$BUILD/build.ninja" ] || meson setup "$BUILD" "$ROOT" >/dev/null || die "meson setup failed"
    ninja -C "$BUILD" bench/s3_bench train >/dev/null || { ninja -C "$BUILD" bench/s3_bench train; die "build failed"; }
fi
[ -x "$EXE" ] || die "$EXE is not an executable"
EXE=$(realpath "$EXE")
[ "$TRAIN" -eq 0 ] || [ -x "$BUILD/train" ] || die "$BUILD/train is missing (--no-train skips it)"
if [ "$TRAIN" -eq 1 ] && [ ! -f "$ROOT/data/brown/train_000000.bin" ]; then
    die "no training data in data/brown (scripts/demo prepares it; --no-train skips the training rows)"
fi

# Disk: the snapshot (stored <= raw) and awscli's download here, the RGW block file (sparse;
# RGW frees deleted tails only after its GC delay, so every repetition's two copies stay in it)
# in the temp folder.
TMPBASE=${TMPDIR:-/tmp}
BLOCK_GIB=$(awk -v g="$GIB" -v r="$REPS" 'BEGIN { b = 2 * r * g * 1.25 + 4; if (b < 16) b = 16; printf "%d", b + 0.999 }')
NEED_GIB=$(awk -v g="$GIB" -v b="$BLOCK_GIB" -v r="$REPS" 'BEGIN { printf "%d", 2 * r * g * 1.25 + 4 + 2 * g + 1.999 }')
FREE_GIB=$(df -P -k "$TMPBASE" | awk 'NR == 2 { printf "%d", $4 / 1048576 }')
[ "$FREE_GIB" -ge "$NEED_GIB" ] || die "$TMPBASE has $FREE_GIB GiB free, the run needs about $NEED_GIB GiB (try a smaller --gib)"

WORK=$(mktemp -d "$TMPBASE/s3-bench.XXXXXX")
cleanup() {
    local rc=$?
    rgw_stop
    if [ "$KEEP" -eq 0 ]; then rm -rf "$WORK"; else echo "work folder kept: $WORK" >&2; fi
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

busy_ticks() { awk '$1 == "cpu" { print $2 + $3 + $4 + $7 + $8; exit }' /proc/stat; }
BUSY0=$(busy_ticks)
T0=$EPOCHREALTIME
KV="$WORK/bench.kv"
: >"$KV"

say "starting RGW (tests/integration/s3env.py rgw, OSD block file $BLOCK_GIB GiB sparse)" >&2
rgw_start "$WORK" "$BLOCK_GIB"
BUCKET=$S3ENV_BUCKET
# the daemons (children of the s3env process), for their CPU time
daemon_pids() { ps -o pid= --ppid "$S3ENV_PID" | tr -s ' \n' ' '; }
DAEMONS=$(daemon_pids)
server_ticks() { local t=0 p; for p in $DAEMONS; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0))); done; echo $t; }
TICK=$(getconf CLK_TCK)

export CKPT_LOG_LEVEL=${CKPT_LOG_LEVEL:-warn}
aws_() { env -u PYTHONPATH -u PYTHONHOME "$AWS" --endpoint-url "$S3ENV_ENDPOINT" "$@"; }

say "making a W=2 snapshot of $SIZE_MIB MiB fp32 state (codec $CODEC)" >&2
SNAP="$WORK/snap"
"$EXE" make --dir "$SNAP" --size-mib "$SIZE_MIB" --codec "$CODEC" >>"$KV" || die "s3_bench make failed"
STEPDIR="$SNAP/step-000000001"
STORED=$(cat "$STEPDIR"/* | wc -c)
echo "files_bytes $STORED" >>"$KV"
echo "files $(ls "$STEPDIR" | tr '\n' ' ')" >>"$KV"

# the MD5 pass every PUT makes before sending (objstore), for scale: md5sum of rank 0's file
cat "$STEPDIR"/* >/dev/null
TIMEFORMAT='%R %U %S'
read -r r u s < <({ time md5sum "$STEPDIR/rank-00000.bin" >/dev/null; } 2>&1)
echo "md5_s $r" >>"$KV"
echo "md5_bytes $(stat -c %s "$STEPDIR/rank-00000.bin")" >>"$KV"

# timed NAME BYTES KEY COMMAND...: wall, client CPU (children), server CPU (RGW daemons),
# bytes. KEY -: wall and CPU of the whole command; else those s3_bench measured itself
# (KEY_s, KEY_cpu_s: without its start-up and, for a restore, without the allocation and
# first touch of the destination memory, which a trainer has already)
timed() {
    local name=$1 bytes=$2 key=$3 r u s st0 st1 rc=0
    shift 3
    st0=$(server_ticks)
    { time "$@" >>"$WORK/$name.out" 2>>"$WORK/$name.err"; } 2>"$WORK/time.txt" || rc=$?
    st1=$(server_ticks)
    [ "$rc" -eq 0 ] || { tail -n 20 "$WORK/$name.err" >&2; return 1; }
    read -r r u s <"$WORK/time.txt"
    u=$(echo "$u + $s" | bc -l)
    if [ "$key" != - ]; then
        r=$(awk -v k="${key}_s" '$1 == k { v = $2 } END { print v }' "$WORK/$name.out")
        u=$(awk -v k="${key}_cpu_s" '$1 == k { v = $2 } END { print v }' "$WORK/$name.out")
    fi
    echo "run.$name $r $u $(echo "($st1 - $st0) / $TICK" | bc -l) $bytes" >>"$KV"
}
ours_up() { "$EXE" upload --dir "$SNAP" --url "s3://$BUCKET/ours-$1" --part-mib "$PART_MIB"; }
ours_down() { "$EXE" restore --url "s3://$BUCKET/ours-$1" --world "$2"; }
aws_up() { aws_ s3 cp --recursive --only-show-errors "$STEPDIR" "s3://$BUCKET/awscli-$1/step-000000001"; }
aws_down() { aws_ s3 cp --recursive --only-show-errors "s3://$BUCKET/awscli-$1/step-000000001" "$WORK/dl-$1"; }

# awscli's own start-up (python, botocore's models), for scale: one listing of an empty prefix
{ time aws_ s3 ls "s3://$BUCKET/none/" >/dev/null || true; } 2>"$WORK/time.txt"
echo "aws_startup_s $(awk '{ print $1 }' "$WORK/time.txt")" >>"$KV"

for rep in $(seq "$REPS"); do
    say "repetition $rep of $REPS: upload and restore, ours and awscli" >&2
    order="ours aws"
    [ $((rep % 2)) -eq 0 ] && order="aws ours"
    for who in $order; do
        cat "$STEPDIR"/* >/dev/null
        if [ "$who" = ours ]; then timed ours_up "$STORED" upload ours_up "$rep" || die "our upload failed"
        else timed aws_up "$STORED" - aws_up "$rep" || die "awscli upload failed"; fi
    done
    for who in $order; do
        if [ "$who" = ours ]; then
            timed ours_down_w2 "$STORED" restore_w2 ours_down "$rep" 2 || die "our restore at W=2 failed"
            timed ours_down_w1 "$STORED" restore_w1 ours_down "$rep" 1 || die "our restore at W=1 failed"
        else
            rm -rf "$WORK/dl-$rep"
            timed aws_down "$STORED" - aws_down "$rep" || die "awscli download failed"
            cmp -s "$WORK/dl-$rep/rank-00000.bin" "$STEPDIR/rank-00000.bin" || die "awscli's download differs"
            rm -rf "$WORK/dl-$rep"
        fi
    done
done
# the figures s3_bench printed (requests, per-rank times) of the last repetition
grep -hE '^(upload|restore)_' "$WORK/ours_up.out" "$WORK/ours_down_w2.out" "$WORK/ours_down_w1.out" \
    | awk '{ last[$1] = $2 } END { for (k in last) print k, last[k] }' >>"$KV"

# ------------------------------------------------------------------ training step time
if [ "$TRAIN" -eq 1 ]; then
    pin_blas
    say "training: the demo model $TRAIN_STEPS steps, --ckpt-every $TRAIN_EVERY, with --s3 and without, side by side" >&2
    TARGS=(--data "$ROOT/data/brown/train_*.bin" --val-data "$ROOT/data/brown/val_*.bin"
           --n-layer 4 --n-embd 128 --n-head 4 --seq-len 128 --micro-batch 8 --global-batch 16
           --steps "$TRAIN_STEPS" --lr 3e-3 --warmup 20 --seed 1337 --log-every 1 --ckpt-every "$TRAIN_EVERY"
           --keep-last 2)
    { time CKPT_LOG_LEVEL=info "$BUILD/train" "${TARGS[@]}" --ckpt-dir "$WORK/train-s3" \
        --s3 "s3://$BUCKET/train" >"$WORK/train-s3.out" 2>"$WORK/train-s3.log"; } 2>"$WORK/train-s3.time" &
    p1=$!
    { time CKPT_LOG_LEVEL=info "$BUILD/train" "${TARGS[@]}" --ckpt-dir "$WORK/train-local" \
        >"$WORK/train-local.out" 2>"$WORK/train-local.log"; } 2>"$WORK/train-local.time" &
    p2=$!
    ok=1
    wait "$p1" || ok=0
    wait "$p2" || ok=0
    [ "$ok" -eq 1 ] || { tail -n 20 "$WORK/train-s3.log" "$WORK/train-local.log" >&2; die "a training run failed"; }
    # step lines: "HH:MM:SS.mmm INFO  [train] step N/M loss ... X ms ..." -> "seconds-of-day N X"
    steps_of() { grep -E '\[train\] step [0-9]+/[0-9]+ loss ' "$1" \
        | sed -nE 's/^([0-9]+):([0-9]+):([0-9.]+) .* step ([0-9]+)\/[0-9]+ loss .* ([0-9.]+) ms.*/\1 \2 \3 \4 \5/p' \
        | awk '{ printf "%.3f %s %s\n", $1 * 3600 + $2 * 60 + $3, $4, $5 }'; }
    steps_of "$WORK/train-s3.log" >"$WORK/steps-s3.txt"
    steps_of "$WORK/train-local.log" >"$WORK/steps-local.txt"
    # only the steps after the first 5 (start-up, first snapshot) that ended while both runs
    # were still training: the one that ends first leaves the other alone on the cores
    CUT=$(tail -n 1 "$WORK/steps-s3.txt" "$WORK/steps-local.txt" | awk 'NF == 3 { if (c == "" || $1 < c) c = $1 } END { print c }')
    med() { awk -v c="$CUT" '$2 > 5 && $1 <= c { print $3 }' "$1" | sort -n \
        | awk '{ v[NR] = $1 } END { if (NR) print (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2) }'; }
    mean() { awk -v c="$CUT" '$2 > 5 && $1 <= c { s += $3; n++ } END { if (n) printf "%.1f", s / n }' "$1"; }
    count() { awk -v c="$CUT" '$2 > 5 && $1 <= c' "$1" | wc -l; }
    echo "train_s3_ms $(med "$WORK/steps-s3.txt")" >>"$KV"
    echo "train_local_ms $(med "$WORK/steps-local.txt")" >>"$KV"
    echo "train_s3_mean_ms $(mean "$WORK/steps-s3.txt")" >>"$KV"
    echo "train_local_mean_ms $(mean "$WORK/steps-local.txt")" >>"$KV"
    echo "train_s3_n $(count "$WORK/steps-s3.txt")" >>"$KV"
    echo "train_local_n $(count "$WORK/steps-local.txt")" >>"$KV"
    # CPU of each process (user + sys, every thread: the uploader's too), ms a step
    for w in s3 local; do
        awk -v n="$TRAIN_STEPS" '{ print "train_'"$w"'_cpu_ms", ($2 + $3) * 1000 / n }' "$WORK/train-$w.time" >>"$KV"
    done
    # "S3 uploads: 60 complete, 0 failed, 0 skipped; ..."
    sed -nE 's/.*S3 uploads: ([0-9]+) complete, ([0-9]+) failed, ([0-9]+) skipped.*/train_uploaded \1\ntrain_upload_failed \2\ntrain_upload_skipped \3/p' \
        "$WORK/train-s3.log" >>"$KV"
    d1=$(grep -o 'params_digest=[0-9a-f]*' "$WORK/train-s3.out" || true)
    d2=$(grep -o 'params_digest=[0-9a-f]*' "$WORK/train-local.out" || true)
    echo "train_every $TRAIN_EVERY" >>"$KV"
    echo "train_same_digest $([ -n "$d1" ] && [ "$d1" = "$d2" ] && echo yes || echo NO)" >>"$KV"
fi

echo "server_cpu_total_s $(echo "$(server_ticks) / $TICK" | bc -l)" >>"$KV"
times >"$WORK/times.txt"
CHILD_CPU=$(awk 'NR == 2 { n = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); n += a[1] * 60 + a[2] } print n }' "$WORK/times.txt")
echo "own_cpu_s $CHILD_CPU" >>"$KV"
echo "machine_busy_s $(echo "($(busy_ticks) - $BUSY0) / $TICK" | bc -l)" >>"$KV"
echo "elapsed_s $(echo "$EPOCHREALTIME - $T0" | bc -l)" >>"$KV"
echo "cores $(nproc)" >>"$KV"
echo "reps $REPS" >>"$KV"

report "$KV"
