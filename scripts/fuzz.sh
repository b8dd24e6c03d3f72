#!/usr/bin/env bash
# Run the libFuzzer targets of fuzz/ (every decoder of bytes that arrive from another machine).
#   scripts/fuzz.sh smoke [SECONDS]   # each target SECONDS (default 20) from its committed corpus (make test)
#   scripts/fuzz.sh full [RUNS]       # each target RUNS executions (default 10 million), corpora grown in place
# Needs cargo-fuzz on a nightly toolchain (.ci/run installs both). A crash, a hang (-timeout), an
# allocation over 512 MiB or RSS over 2 GiB fails the run and leaves the input in fuzz/artifacts/.
# STARLING_FUZZ_SKIP=1 skips (for a machine without nightly; say so where you use it).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-smoke}
TARGETS=(frame descriptor plan mcdist wire_path migrate_stream page_server enrol)
if [ "${STARLING_FUZZ_SKIP:-}" = 1 ]; then
    echo "fuzz: SKIPPED (STARLING_FUZZ_SKIP=1)"; exit 0
fi
cargo +nightly fuzz --version >/dev/null 2>&1 || {
    echo "fuzz: needs cargo-fuzz on a nightly toolchain: rustup toolchain install nightly --profile minimal; cargo install cargo-fuzz (or STARLING_FUZZ_SKIP=1)"; exit 1; }
case $mode in
    smoke) limit=(-max_total_time="${2:-20}") ;;
    full) limit=(-runs="${2:-10000000}") ;;
    *) echo "usage: $0 smoke [SECONDS] | full [RUNS]"; exit 2 ;;
esac
cd fuzz
cargo +nightly fuzz build -O
for t in "${TARGETS[@]}"; do
    mkdir -p "corpus/$t"
    log=$(mktemp)
    if cargo +nightly fuzz run -O "$t" "corpus/$t" -- "${limit[@]}" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=512 \
        -print_final_stats=1 > "$log" 2>&1; then
        runs=$(grep -m1 '^stat::number_of_executed_units' "$log" | awk '{print $2}')
        echo "fuzz $t: ${runs:-?} executions, no crash, hang or over-allocation ($(ls "corpus/$t" | wc -l) corpus inputs)"
        rm -f "$log"
    else
        echo "fuzz $t: FAILED"; grep -E "^(==|SUMMARY|artifact_prefix|Test unit written|thread .* panicked|.*panicked at)" "$log" | head -20
        echo "(full log: $log)"; exit 1
    fi
done
