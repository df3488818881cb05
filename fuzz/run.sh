#!/usr/bin/env bash
# Builds and runs the arfuse fuzz targets with libFuzzer on the STABLE toolchain.
#
#   fuzz/run.sh build                      # instrumented release build of both targets
#   fuzz/run.sh run TARGET [SECONDS] [ARGS] # fuzz TARGET (fuzz_bytes | fuzz_structured)
#   fuzz/run.sh replay TARGET FILE...      # run inputs once (a crash reproduces here)
#
# cargo-fuzz needs nightly for its sanitizer flags; the coverage instrumentation that
# libFuzzer needs is available on stable through -Cpasses=sancov-module and
# -Cllvm-args. `--target` keeps the flags off build scripts and proc macros.
# See docs/fuzzing.md.
set -euo pipefail
cd "$(dirname "$0")"
TRIPLE="$(rustc -vV | sed -n 's/^host: //p')"
BIN="target/$TRIPLE/release"
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module \
-Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
-Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares"

build() {
    cargo build --release --bins --target "$TRIPLE"
}

case "${1:-}" in
build)
    build
    ;;
run)
    target="${2:?target: fuzz_bytes or fuzz_structured}"
    secs="${3:-60}"
    shift $(( $# < 3 ? $# : 3 ))
    [ -x "$BIN/$target" ] || build
    mkdir -p "corpus/$target" "artifacts/$target"
    seeds=("corpus-seed/$target")
    if [ "$target" = fuzz_bytes ]; then
        for d in ../ir-fixtures/small ../ir-fixtures/models ../ir-fixtures/exported ../ir-fixtures/hostile; do
            [ -d "$d" ] && seeds+=("$d")
        done
    fi
    # -timeout: one input taking 10 s is a hang; -rss_limit_mb: 2 GiB is a leak or an
    # unbounded allocation (the limits allow at most a few hundred MiB).
    # fuzz_structured reads its input as choices (zeros past the end): -len_control=0
    # lets libFuzzer use the whole -max_len from the start instead of growing it slowly.
    len=(-max_len=65536)
    [ "$target" = fuzz_structured ] && len=(-max_len=4096 -len_control=0)
    exec "$BIN/$target" "corpus/$target" "${seeds[@]}" \
        -artifact_prefix="artifacts/$target/" \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 "${len[@]}" \
        -print_final_stats=1 "$@"
    ;;
replay)
    target="${2:?target}"
    shift 2
    [ -x "$BIN/$target" ] || build
    exec "$BIN/$target" -runs=1 "$@"
    ;;
*)
    sed -n '2,10p' "$0"
    exit 2
    ;;
esac
