#!/usr/bin/env bash
# Data-parallel step time at W = 1, 2, 4 on the demo model, and a sharded snapshot at W = 4
# restored at W = 2. Prints figures and ratios against the W = 1 baseline run the same way.
#
#   bench/dist_bench.sh [--build DIR] [--data DIR] [--steps N]
#
# On a machine with fewer cores than ranks the ranks share cores: the step time then shows
# the overhead of the collectives and of splitting the batch, not a speed-up.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=$here/build data=$here/data/brown steps=20
while [ $# -gt 0 ]; do
    case $1 in
    --build) build=$2; shift 2 ;;
    --data) data=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    *) echo "usage: $0 [--build DIR] [--data DIR] [--steps N]" >&2; exit 2 ;;
    esac
done
export OPENBLAS_NUM_THREADS=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
model=(--n-layer 4 --n-embd 128 --n-head 4 --seq-len 128 --micro-batch 4 --global-batch 16
       --lr 3e-3 --warmup 5 --seed 1337)

port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }

# launch W LOGPREFIX ARGS...: W ranks, waits for all; rank r's stderr in LOGPREFIX.r
launch() {
    local w=$1 log=$2; shift 2
    local p; p=$(port)
    local pids=()
    for ((r = 0; r < w; r++)); do
        RANK=$r WORLD_SIZE=$w MASTER_ADDR=127.0.0.1 MASTER_PORT=$p \
            "$build/train" --data "$data/train_*.bin" "${model[@]}" "$@" >"$log.out.$r" 2>"$log.$r" &
        pids+=($!)
    done
    local rc=0
    for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
    return $rc
}

# median step time (ms) of rank 0, skipping the first 3 steps
median_ms() { grep -o ' [0-9]* ms ' "$1" | awk '{print $1}' | tail -n +4 | sort -n |
              awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

printf '%-28s %10s %10s %12s\n' "run" "step ms" "vs W=1" "digest"
base=
for w in 1 2 4; do
    launch $w "$work/w$w" --steps "$steps"
    ms=$(median_ms "$work/w$w.0")
    digest=$(grep -o 'params_digest=[0-9a-f]*' "$work/w$w.out.0" | cut -d= -f2)
    [ -z "$base" ] && base=$ms
    printf '%-28s %10s %10.2f %12s\n' "W=$w ZeRO-2 (cores: $(nproc))" "$ms" \
        "$(echo "$ms / $base" | bc -l)" "${digest:0:12}"
done

ck=$work/ck
launch 4 "$work/s4" --steps 10 --ckpt-dir "$ck" --ckpt-every 10 --no-direct-io
stall=$(grep -o 'stall [0-9.]* ms' "$work/s4.0" | tail -1 | awk '{print $2}')
persist=$(grep -o 'persist [0-9]* ms' "$work/s4.0" | tail -1 | awk '{print $2}')
bytes=$(du -sb "$ck/step-000000010" | cut -f1)
launch 2 "$work/r2" --steps 10 --ckpt-dir "$ck" --resume auto
load=$(grep -o 'checked in [0-9]* ms' "$work/r2.0" | awk '{print $3}')
echo
echo "snapshot at W=4: stall ${stall} ms (rank 0), commit after ${persist} ms (all 4 shards durable,"
echo "  votes collected, manifest merged and renamed); $(echo "$bytes / 1024" | bc) KiB on disk"
echo "restore at W=2 (re-shard 4 -> 2, range reads, params all-gather, digest check): ${load} ms"
