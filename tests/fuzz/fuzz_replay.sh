#!/usr/bin/env bash
# fuzz_replay.sh HARNESS CORPUS_DIR - run every file of a committed corpus once through a
# libFuzzer harness (meson suite "fuzz"), so that a crash found and fixed stays fixed.
# Files are passed one by one (libFuzzer runs each once and writes nothing into the corpus).
# The harness's temp folders go to a private TMPDIR that is removed afterwards, crash or not.
# Exit: 0 every input ran clean, 1 a crash, leak, timeout or sanitizer report, 77 no inputs.
set -euo pipefail
harness=$1
dir=$2
shopt -s nullglob
inputs=("$dir"/*)
if [ ${#inputs[@]} -eq 0 ]; then
    echo "no inputs in $dir"
    exit 77
fi
TMPDIR=$(mktemp -d "${TMPDIR:-/tmp}/fuzz-replay-XXXXXX")
export TMPDIR
trap 'rm -rf "$TMPDIR"' EXIT
# -artifact_prefix: a crash's reproducer goes to the private folder, not into the source tree
# libFuzzer exits 77 on a crash by default: meson would read that as a skip
"$harness" -timeout=10 -rss_limit_mb=2048 -error_exitcode=1 -timeout_exitcode=1 \
    -artifact_prefix="$TMPDIR/" "${inputs[@]}"
