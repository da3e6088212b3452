#!/usr/bin/env bash
# bench/ckpt_bench.sh - the checkpoint engine against the disk's limit (fio), the zstd CLI
# (compressing the state, and decompressing our snapshot's own frames: the restore baseline),
# a naive write(2) and memcpy, on the same bytes and the same disk; prints one table.
#
# Usage: bench/ckpt_bench.sh [--dir DIR] [--size-mib N] [--reps R] [--seed S] [--threads T]
#                            [--shuffle] [--overlap] [--keep] [--exe PATH]
#        bench/ckpt_bench.sh --from SNAPSHOT [--dir DIR] [--exe PATH]
#   --dir DIR       folder on the disk to measure; default a new temp folder under build/
#   --size-mib N    state size (three f32 buffers); default 2048 (about 2 minutes here)
#   --reps R        repetitions of each measured run (best reported, worst shown); default 2
#   --threads T     engine compression threads, snapshot reading threads and zstd -T;
#                   default the number of cores
#   --shuffle       also measure the engine with zstd + the shuffle filter
#   --overlap       engine option: the persist starts with the stage copy (durable sooner,
#                   longer stall)
#   --keep          leave the files written in DIR (state.bin, fio file, snapshots)
#   --exe PATH      the ckpt_bench program; default build/bench/ckpt_bench (built if needed)
#   --from SNAPSHOT compression ratio of zstd -1 with and without shuffle on the buffers of a
#                   real snapshot (a step-NNNNNNNNN folder, or a root: its newest snapshot)
# Needs fio and jq for the disk rows and zstd for the CLI rows (missing ones print n/a).
# Root drops the page cache before each load; otherwise the table says loads may be warm.
# The table's header says how much CPU other processes used during the run; a busy machine
# is flagged NOISY (its figures are low and spread: compare the best and worst columns).
# Exit status: 0 done (figures below target are flagged, not failed), 1 failure.
set -euo pipefail
source "$(dirname "$0")/../scripts/lib.sh"

DIR=""
SIZE_MIB=2048
SEED=1
REPS=2
THREADS=$(nproc)
SHUFFLE=""
OVERLAP=""
KEEP=0
EXE=""
FROM=""
while [ $# -gt 0 ]; do
    case "$1" in
    --dir) DIR=$2; shift 2 ;;
    --size-mib) SIZE_MIB=$2; shift 2 ;;
    --seed) SEED=$2; shift 2 ;;
    --reps) REPS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --shuffle) SHUFFLE=--shuffle; shift ;;
    --overlap) OVERLAP=--overlap; shift ;;
    --keep) KEEP=1; shift ;;
    --exe) EXE=$2; shift 2 ;;
    --from) FROM=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
    esac
done
[[ "$SIZE_MIB" =~ ^[0-9]+$ ]] && [ "$SIZE_MIB" -ge 1 ] || die "--size-mib must be an integer >= 1"
[[ "$REPS" =~ ^[0-9]+$ ]] && [ "$REPS" -ge 1 ] && [ "$REPS" -le 99 ] || die "--reps must be in [1, 99]"
[[ "$THREADS" =~ ^[0-9]+$ ]] && [ "$THREADS" -ge 1 ] || die "--threads must be an integer >= 1"

if [ -z "$EXE" ]; then
    EXE="$BUILD/bench/ckpt_bench"
    [ -f "$BUILD/build.ninja" ] || meson setup "$BUILD" "$ROOT" >/dev/null || die "meson setup failed"
    ninja -C "$BUILD" bench/ckpt_bench >/dev/null || { ninja -C "$BUILD" bench/ckpt_bench; die "build failed"; }
fi
[ -x "$EXE" ] || die "$EXE is not an executable"
EXE=$(realpath "$EXE")

if [ -z "$DIR" ]; then
    mkdir -p "$BUILD"
    DIR=$(mktemp -d "$BUILD/ckpt-bench.XXXXXX")
    OWN_DIR=1
else
    mkdir -p "$DIR"
    OWN_DIR=0
fi
DIR=$(cd "$DIR" && pwd)
cleanup() {
    if [ "$KEEP" -eq 0 ]; then
        if [ "$OWN_DIR" -eq 1 ]; then rm -rf "$DIR"
        else rm -f "$DIR/state.bin" "$DIR/state.zst" "$DIR/frames.zst" "$DIR/fio.dat" "$DIR"/fio-*.json "$DIR/bench.kv"; fi
    fi
}
trap cleanup EXIT

export CKPT_LOG_LEVEL=${CKPT_LOG_LEVEL:-warn}

if [ -n "$FROM" ]; then
    "$EXE" --from "$FROM" --dir "$DIR" || die "ckpt_bench --from failed"
    exit 0
fi

# CPU busy time of the whole machine (user, nice, system, irq, softirq), in clock ticks; the
# part our own commands did not use is the noise from other processes.
busy_ticks() { awk '$1 == "cpu" { print $2 + $3 + $4 + $7 + $8; exit }' /proc/stat; }
BUSY0=$(busy_ticks)
T0=$EPOCHREALTIME

KV="$DIR/bench.kv"
KEEPARG=--keep-state
[ "$KEEP" -eq 1 ] && KEEPARG=--keep
say "ckpt_bench: ${SIZE_MIB} MiB state in $DIR (memcpy, naive write, engine save and load)" >&2
"$EXE" --dir "$DIR" --size-mib "$SIZE_MIB" --seed "$SEED" --reps "$REPS" --threads "$THREADS" \
    $SHUFFLE $OVERLAP $KEEPARG --frames >"$KV" || die "ckpt_bench failed (figures so far: $(tr '\n' ' ' <"$KV"))"

drop_caches() { sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true; }

# Runs repeated REPS times are recorded as "run.NAME seconds cpu_seconds bytes", one line
# per repetition; the table takes the best and shows the worst.
TIMEFORMAT='%R %U %S'
timed() { # NAME BYTES COMMAND...: run COMMAND, append its wall and CPU time (children too)
    local name=$1 bytes=$2 r u s
    shift 2
    read -r r u s < <({ time "$@" >/dev/null; } 2>&1) || return 1
    echo "run.$name $r $(echo "$u + $s" | bc -l) $bytes" >>"$KV"
}
zstd_devnull() { zstd -q -1 -T"$THREADS" -c "$DIR/state.bin" >/dev/null; }
zstd_file() { zstd -q -f -1 -T"$THREADS" "$DIR/state.bin" -o "$DIR/state.zst" && sync "$DIR/state.zst"; }

# zstd CLI on the same bytes: to /dev/null from a warm cache (the CPU limit), and to a file on
# the same disk, fsynced (GNU sync FILE calls fsync on it).
if command -v zstd >/dev/null; then
    say "zstd -1 -T$THREADS on state.bin, $REPS times each" >&2
    RAW=$(stat -c %s "$DIR/state.bin")
    cat "$DIR/state.bin" >/dev/null
    for _ in $(seq "$REPS"); do timed zstd_null "$RAW" zstd_devnull; done
    for _ in $(seq "$REPS"); do rm -f "$DIR/state.zst"; timed zstd_file "$RAW" zstd_file; done
    echo "zstd_bytes $(stat -c %s "$DIR/state.zst")" >>"$KV"
    rm -f "$DIR/state.zst"
fi
[ "$KEEP" -eq 1 ] || rm -f "$DIR/state.bin"

# The restore baseline: zstd -d on the very frames of our zstd -1 snapshot, from a cold cache
# on the same disk, to /dev/null. ckpt_bench wrote them to frames.zst in file order (a data
# file is concatenated zstd frames, except chunks stored raw, which zstd cannot read: they are
# left out, counted in zstd.raw_chunks, and the rate is that of the bytes the frames decode
# to). zstd 1.5 decodes on one thread whatever -T says (-T is passed as for compression; its
# reads and writes overlap the decoding, asyncio); our restore decodes on --threads threads
# and also checks two xxh3 checksums per chunk, which zstd -d does not (our frames carry no
# content checksum).
if command -v zstd >/dev/null && [ -f "$DIR/frames.zst" ]; then
    say "zstd -d -T$THREADS on the snapshot's frames, cold, $REPS times" >&2
    FRAW=$(awk '$1 == "zstd.frames_raw_bytes" { print $2 }' "$KV")
    zstd_decode() { zstd -q -d -T"$THREADS" -c "$DIR/frames.zst" >/dev/null; }
    for _ in $(seq "$REPS"); do drop_caches; timed zstd_d "$FRAW" zstd_decode; done
fi
rm -f "$DIR/frames.zst"

# The disk's limit: sequential direct I/O through io_uring; each write run makes a new file.
if command -v fio >/dev/null && command -v jq >/dev/null; then
    for bs in 1M 4M; do
        say "fio write and read, bs=$bs, $REPS times each" >&2
        for rep in $(seq "$REPS"); do
            for rw in write read; do
                [ "$rw" = write ] && rm -f "$DIR/fio.dat"
                drop_caches
                json="$DIR/fio-$rw-$bs-$rep.json"
                if fio --name="ckpt-bench-$rw" --filename="$DIR/fio.dat" --rw="$rw" --bs="$bs" \
                    --size="${SIZE_MIB}M" --ioengine=io_uring --direct=1 --iodepth=8 --numjobs=1 \
                    --end_fsync=1 --output-format=json --output="$json" >/dev/null 2>&1; then
                    jq -r --arg k "run.fio_${rw}_$bs" --arg rw "$rw" '.jobs[0] |
                        "\($k) \(.[$rw].io_bytes / .[$rw].bw_bytes) \((.usr_cpu + .sys_cpu) / 100 * .job_runtime / 1000) \(.[$rw].io_bytes)"' \
                        "$json" >>"$KV"
                else
                    echo "fio_${rw}_${bs}_error fio failed (see $json)" >>"$KV"
                fi
            done
        done
    done
    # fio preallocates its file (fallocate=native); a writer that appends to a new file
    # instead extends it with every write, which ext4 and io_uring handle less well
    say "fio write bs=1M extending the file (fallocate=none), $REPS times" >&2
    for rep in $(seq "$REPS"); do
        rm -f "$DIR/fio.dat"
        drop_caches
        json="$DIR/fio-write-ext-$rep.json"
        if fio --name=ckpt-bench-write-ext --filename="$DIR/fio.dat" --rw=write --bs=1M \
            --size="${SIZE_MIB}M" --ioengine=io_uring --direct=1 --iodepth=8 --numjobs=1 \
            --end_fsync=1 --fallocate=none --output-format=json --output="$json" >/dev/null 2>&1; then
            jq -r '.jobs[0] | "run.fio_write_ext \(.write.io_bytes / .write.bw_bytes) \((.usr_cpu + .sys_cpu) / 100 * .job_runtime / 1000) \(.write.io_bytes)"' \
                "$json" >>"$KV"
        fi
    done
    rm -f "$DIR/fio.dat"
fi

# CPU seconds of every command this script ran (the second line of `times`: children)
times >"$DIR/times.txt" # not in a pipeline: a subshell would report its own children
CHILD_CPU=$(awk 'NR == 2 { n = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); n += a[1] * 60 + a[2] } print n }' "$DIR/times.txt")
rm -f "$DIR/times.txt"
echo "machine_busy_s $(echo "($(busy_ticks) - $BUSY0) / $(getconf CLK_TCK)" | bc -l)" >>"$KV"
echo "own_cpu_s $CHILD_CPU" >>"$KV"
echo "elapsed_s $(echo "$EPOCHREALTIME - $T0" | bc -l)" >>"$KV"

SRC=$(findmnt -n -o SOURCE,FSTYPE -T "$DIR" 2>/dev/null | awk '{print $1 " (" $2 ")"}' || true)
awk -v dir="$DIR" -v src="${SRC:-?}" -v thr="$THREADS" -v reps="$REPS" '
function has(k) { return (k in v) && v[k] != "" }
function gbs(bytes, s) { return s + 0 > 0 ? bytes / s / 1e9 : 0 }
function ms(s) { return s == "" ? "" : sprintf("%.1f", s * 1e3) }
# label, best seconds, worst seconds, cpu seconds, rate GB/s, compression ratio
function row(label, s, worst, cpu, rate, cr) {
    out = sprintf("%-52s %9s %9s %9s %7s %7s", label, s == "" ? "n/a" : ms(s), ms(worst), ms(cpu),
        rate == "" ? "n/a" : sprintf("%.3f", rate), cr == "" ? "" : sprintf("%.3fx", cr))
    sub(/ +$/, "", out)
    print out
}
# one row for a repeated external run: time scaled to the state size from its own rate
function runrow(label, name, cr) {
    if (!(name in rbest)) { row(label " (not run)", "", "", "", ""); return 0 }
    rate = rbytes[name] / rbest[name]
    row(label, raw / rate, raw / (rbytes[name] / rworst[name]), rcpu[name] * raw / rbytes[name], rate / 1e9, cr)
    return rate / 1e9
}
function worst_gbs(name) { return name in rworst ? rbytes[name] / rworst[name] / 1e9 : 0 }
# label, value (best against best), comparison and target, and the spread of the value over
# the repetitions (lo, hi: worst against best, best against worst; "" when unknown)
function ratio(label, x, cmp, target, lo, hi) {
    t = target == "" ? "(info)" : cmp " " target
    if (x == "") { printf "%-52s %9s %9s\n", label, "n/a", t; return }
    ok = ""
    if (cmp == ">=") ok = x >= target + 0 ? "ok" : "BELOW TARGET"
    if (cmp == "<=") ok = x <= target + 0 ? "ok" : "ABOVE TARGET"
    spread = lo != "" && hi != "" ? sprintf("(runs: %.2f .. %.2f)", lo, hi) : ""
    out = sprintf("%-52s %9.3f %9s  %-13s %s", label, x, t, ok, spread)
    sub(/ +$/, "", out)
    print out
}
$1 ~ /^run\./ {
    n = substr($1, 5)
    if (!(n in rbest) || $2 < rbest[n]) { rbest[n] = $2 + 0; rcpu[n] = $3 + 0 }
    if (!(n in rworst) || $2 > rworst[n]) rworst[n] = $2 + 0
    rbytes[n] = $4 + 0
    next
}
{ k = $1; $1 = ""; sub(/^ /, ""); v[k] = $0 ~ /^-?[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$/ ? $0 + 0 : $0 }
END {
    raw = v["raw_bytes"]
    printf "ckpt bench: %.1f MiB of f32 state (params, adam_m, adam_v; seed %s), same bytes everywhere\n", raw / 1048576, v["seed"]
    printf "disk %s, dir %s\n", src, dir
    printf "%s cores; engine threads, reading threads and zstd -T: %s; zstd level 1; GB = 1e9 bytes\n", v["cores"], thr
    if (v["drop_caches"] == "ok") print "loads and fio runs are cold: page cache dropped before each"
    else printf "loads may be WARM: page cache not dropped (%s)\n", v["drop_caches"]
    other = v["machine_busy_s"] - v["own_cpu_s"]
    if (other < 0) other = 0
    printf "other processes used %.1f CPU s of %.1f (%d cores x %.1f s)%s\n", other, v["cores"] * v["elapsed_s"], v["cores"], v["elapsed_s"], (other > 0.05 * v["cores"] * v["elapsed_s"] ? ": NOISY, figures may be low" : ": quiet")
    printf "ms = wall time, best of %s (worst alongside); cpu ms = CPU time of all threads, user + system\n", reps
    printf "\n%-52s %9s %9s %9s %7s %7s\n", "what", "ms", "worst ms", "cpu ms", "GB/s", "ratio"
    line = sprintf("%98s", ""); gsub(/ /, "-", line); print line
    row("first touch of a new buffer that size (page faults)", v["fault_s"], "", "", gbs(raw, v["fault_s"]))
    row("memcpy into a faulted buffer (1 thread, best of 3)", v["memcpy_s"], "", "", gbs(raw, v["memcpy_s"]))
    row("naive: write() 4 MiB blocks + fsync (buffered)", v["naive_s"], "", v["naive_cpu_s"], gbs(raw, v["naive_s"]))
    best_w = 0; best_r = 0
    for (i = 1; i <= 2; i++) {
        bs = i == 1 ? "1M" : "4M"
        x = runrow("disk: fio write bs=" bs " qd=8 direct io_uring", "fio_write_" bs)
        if (x > best_w) { best_w = x; worst_w = worst_gbs("fio_write_" bs) }
        x = runrow("disk: fio read  bs=" bs " qd=8 direct io_uring", "fio_read_" bs)
        if (x > best_r) { best_r = x; worst_r = worst_gbs("fio_read_" bs) }
    }
    runrow("disk: fio write bs=1M, extending file (no prealloc)", "fio_write_ext")
    zcr = has("zstd_bytes") ? raw / v["zstd_bytes"] : ""
    zstd_gbs = runrow("zstd CLI -1 -T" thr " -> /dev/null (CPU limit)", "zstd_null", zcr)
    runrow("zstd CLI -1 -T" thr " -> file + fsync", "zstd_file", zcr)
    zd_gbs = runrow("zstd CLI -d -T" thr ": our zstd -1 frames, cold -> null", "zstd_d")
    nm = split("raw zstd zstd_shuffle", modes, " ")
    split("uncompressed|zstd -1|zstd -1 + shuffle", names, "|")
    for (i = 1; i <= nm; i++) {
        m = modes[i]
        if (!has(m ".save_s")) continue
        mraw = v[m ".raw_bytes"]
        cr = v[m ".stored_bytes"] > 0 ? mraw / v[m ".stored_bytes"] : ""
        row("ours " names[i] ": stall of the first stage", v[m ".stall_first_s"], "", "", gbs(mraw, v[m ".stall_first_s"]))
        row("ours " names[i] ": stall of stage, steady", v[m ".stall_s"], v[m ".stall_max_s"], "", gbs(mraw, v[m ".stall_s"]))
        row("ours " names[i] ": save (stage start to commit)", v[m ".save_s"], v[m ".save_max_s"], v[m ".save_cpu_s"], gbs(mraw, v[m ".save_s"]), cr)
        if (has(m ".write_s"))
            row("ours " names[i] ": persist after the stage copy", v[m ".write_s"], v[m ".write_max_s"], "", gbs(mraw, v[m ".write_s"]))
        row("ours " names[i] ": load = open + read, cold", v[m ".load_s"], v[m ".load_max_s"], v[m ".load_cpu_s"], gbs(mraw, v[m ".load_s"]))
    }
    print line
    printf "%-52s %9s %9s\n", "ratio (from the best runs)", "value", "target"
    print line
    save_raw = has("raw.save_s") ? gbs(v["raw.raw_bytes"], v["raw.save_s"]) : 0
    save_z = has("zstd.save_s") ? gbs(v["zstd.raw_bytes"], v["zstd.save_s"]) : 0
    ratio("ours/fio write, uncompressed (best fio bs)", best_w > 0 && save_raw > 0 ? save_raw / best_w : "", ">=", "0.9",
          best_w > 0 ? gbs(v["raw.raw_bytes"], v["raw.save_max_s"]) / best_w : "", worst_w > 0 ? save_raw / worst_w : "")
    write_raw = has("raw.write_s") ? gbs(v["raw.raw_bytes"], v["raw.write_s"]) : 0
    ratio("ours/fio write, uncompressed, after the stage copy", best_w > 0 && write_raw > 0 ? write_raw / best_w : "", "", "",
          best_w > 0 ? gbs(v["raw.raw_bytes"], v["raw.write_max_s"]) / best_w : "", worst_w > 0 ? write_raw / worst_w : "")
    lim = best_w > 0 && zstd_gbs > 0 ? (best_w < zstd_gbs ? best_w : zstd_gbs) : ""
    zstd_worst = worst_gbs("zstd_null")
    lim_worst = worst_w > 0 && zstd_worst > 0 ? (worst_w < zstd_worst ? worst_w : zstd_worst) : ""
    ratio("ours/min(fio write, zstd CLI), zstd -1", lim != "" && save_z > 0 ? save_z / lim : "", ">=", "0.9",
          lim != "" ? gbs(v["zstd.raw_bytes"], v["zstd.save_max_s"]) / lim : "", lim_worst != "" ? save_z / lim_worst : "")
    if (has("zstd_shuffle.save_s"))
        ratio("ours/min(fio write, zstd CLI), zstd -1 + shuffle", lim != "" ? gbs(v["zstd_shuffle.raw_bytes"], v["zstd_shuffle.save_s"]) / lim : "", ">=", "0.9")
    for (i = 1; i <= nm; i++) {
        m = modes[i]
        if (!has(m ".stall_s")) continue
        ratio("stall/memcpy, " names[i] " (steady)", v["memcpy_s"] > 0 ? v[m ".stall_s"] / v["memcpy_s"] : "", "<=", "1.5",
              v["memcpy_s"] > 0 ? v[m ".stall_s"] / v["memcpy_s"] : "", v["memcpy_s"] > 0 ? v[m ".stall_max_s"] / v["memcpy_s"] : "")
    }
    for (i = 1; i <= nm; i++) {
        m = modes[i]
        if (!has(m ".load_s")) continue
        ratio("ours load/fio read, " names[i] " (best fio bs)", best_r > 0 ? gbs(v[m ".raw_bytes"], v[m ".load_s"]) / best_r : "", "", "",
              best_r > 0 ? gbs(v[m ".raw_bytes"], v[m ".load_max_s"]) / best_r : "", worst_r > 0 ? gbs(v[m ".raw_bytes"], v[m ".load_s"]) / worst_r : "")
    }
    if (has("zstd.load_s")) {
        load_z = gbs(v["zstd.raw_bytes"], v["zstd.load_s"])
        zd_worst = worst_gbs("zstd_d")
        ratio("ours load/zstd -d -T" thr ", zstd -1 (same frames)", zd_gbs > 0 ? load_z / zd_gbs : "", ">=", "0.9",
              zd_gbs > 0 ? gbs(v["zstd.raw_bytes"], v["zstd.load_max_s"]) / zd_gbs : "", zd_worst > 0 ? load_z / zd_worst : "")
        if (v["zstd.raw_chunks"] > 0) printf "  (%d chunks stored raw are not in the zstd -d baseline)\n", v["zstd.raw_chunks"]
    }
    if (has("zstd.stored_bytes")) ratio("compression ratio, ours zstd -1 (4 MiB chunks)", v["zstd.raw_bytes"] / v["zstd.stored_bytes"], "", "")
    if (has("zstd_shuffle.stored_bytes")) ratio("compression ratio, ours zstd -1 + shuffle", v["zstd_shuffle.raw_bytes"] / v["zstd_shuffle.stored_bytes"], "", "")
    if (zcr != "") ratio("compression ratio, zstd CLI -1 (whole file)", zcr, "", "")
}' "$KV"
