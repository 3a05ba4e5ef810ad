#!/usr/bin/env bash
# Runs every cargo-fuzz target for a bounded time, starting from the corpus
# committed in fuzz/corpus/. Fails (exit 1) if any target crashes, panics,
# leaks, times out or exceeds its memory limits.
#
#   scripts/fuzz.sh [SECONDS]        # explore, per target, default 60
#   scripts/fuzz.sh replay           # run each committed input once, then stop
#   scripts/fuzz.sh build            # only build what `replay` runs (CI builds
#                                    # it at low priority while the tests run)
#
# CI uses `replay`: it is deterministic, so a gate fails only on a change
# that breaks an input already known, never on a new find by chance (that is
# how the fragment bug in redact_url surfaced: in an unrelated CI run).
# Exploration is for a developer or a scheduled job; every crash it finds is
# fixed and then committed to fuzz/corpus/<target>/ so replay keeps it fixed.
#
# Environment:
#   FUZZ_TARGETS="key_parse copy_parse"   run only these (default: all)
#   FUZZ_SANITIZER=none                   default: address
#   FUZZ_MERGE=1   merge inputs that found new coverage back into
#                  fuzz/corpus/<target>/ (libFuzzer -merge=1, i.e. minimised)
#
# cargo-fuzz needs nightly-only rustc flags (-Z sanitizer, sancov passes);
# the stable toolchain accepts them with RUSTC_BOOTSTRAP=1. The committed
# corpus is only read: new inputs go to a scratch directory. A crashing
# input is written to fuzz/artifacts/<target>/, the full libFuzzer log to
# fuzz/artifacts/logs/<target>.log (both git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."

duration="${1:-60}"
replay=0
build_only=0
if [ "$duration" = replay ]; then
    replay=1
elif [ "$duration" = build ]; then
    replay=1
    build_only=1
elif ! [[ "$duration" =~ ^[0-9]+$ ]] || [ "$duration" -lt 1 ]; then
    echo "usage: $0 [SECONDS|replay|build]" >&2
    exit 2
fi
targets="${FUZZ_TARGETS:-key_parse config_parse filter_decode copy_parse pgoutput_decode token_verify}"
sanitizer="${FUZZ_SANITIZER:-address}"
cargo_fuzz_version=0.13.2

if [ -f "$HOME/.cargo/env" ]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
fi
export RUSTC_BOOTSTRAP=1
export CARGO_TERM_COLOR=never

# libfuzzer-sys compiles libFuzzer (C++).
if ! command -v c++ >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
    else
        echo "fuzz: a C++ compiler (c++) is needed to build libFuzzer" >&2
        exit 1
    fi
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz $cargo_fuzz_version"
    cargo install cargo-fuzz --version "$cargo_fuzz_version" --locked --quiet
fi

# A replay runs each committed input once: unoptimised code is fast enough
# for that, and its build takes a third of the optimised one's time (CI's
# 40-minute budget). Exploration needs the speed.
mode=()
if [ "$replay" = 1 ]; then
    mode=(--dev)
fi
# The lock file is part of the build: one that no longer matches the
# manifests fails here (cargo fuzz has no --locked of its own) instead of
# being rewritten, a tracked file changed by a build.
(cd fuzz && cargo fetch --locked --quiet)
echo "fuzz: building targets (sanitizer: $sanitizer${mode[*]:+, ${mode[*]}})"
start=$(date +%s)
if [ "$replay" = 1 ]; then
    # Every target in one cargo invocation: the library is compiled once
    # (a build per target compiled it once per target, ~40 s each).
    cargo fuzz build "${mode[@]}" --sanitizer "$sanitizer"
else
    # shellcheck disable=SC2086
    for t in $targets; do
        cargo fuzz build "${mode[@]}" --sanitizer "$sanitizer" "$t"
    done
fi
echo "fuzz: built in $(($(date +%s) - start)) s"
if [ "$build_only" = 1 ]; then
    exit 0
fi

# A replay runs the binaries just built (`cargo fuzz run` would check the
# build again, and rebuilt the library for each target); exploration goes
# through `cargo fuzz run`. Either way: corpus directories, then options.
host=$(rustc -vV | sed -n 's/^host: //p')
run_target() {
    local t=$1
    shift
    if [ "$replay" = 1 ]; then
        ASAN_OPTIONS="detect_odr_violation=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}" \
            "fuzz/target/$host/debug/$t" -artifact_prefix="fuzz/artifacts/$t/" "$@"
    else
        local dirs=("$1" "$2")
        shift 2
        cargo fuzz run --sanitizer "$sanitizer" "$t" "${dirs[@]}" -- "$@"
    fi
}

mkdir -p fuzz/artifacts/logs
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

failed=()
for t in $targets; do
    corpus="fuzz/corpus/$t"
    mkdir -p "$corpus" "$scratch/$t" "fuzz/artifacts/$t"
    log="fuzz/artifacts/logs/$t.log"
    if [ "$replay" = 1 ]; then
        # -runs=0: execute the given corpus once and exit.
        args=(-runs=0)
    else
        args=("-max_total_time=$duration")
    fi
    args+=(
        -rss_limit_mb=2048
        -malloc_limit_mb=512
        -timeout=10
        -print_final_stats=1
    )
    if [ -f "fuzz/dict/$t.dict" ]; then
        args+=("-dict=fuzz/dict/$t.dict")
    fi
    if [ "$replay" = 1 ]; then
        echo "fuzz: $t: replaying $(find "$corpus" -type f | wc -l) corpus files"
    else
        echo "fuzz: $t for ${duration}s ($(find "$corpus" -type f | wc -l) corpus files)"
    fi
    # One process: the machines have 2 cores, and -jobs/-workers would move
    # libFuzzer's output into fuzz-N.log files in the working directory.
    # New inputs go to the scratch directory (first), the committed corpus
    # (second) is only read.
    if run_target "$t" "$scratch/$t" "$corpus" "${args[@]}" >"$log" 2>&1; then
        grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -n 1 | sed "s/^/fuzz: $t: /"
        grep -E '^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)' "$log" |
            sed "s/^/fuzz: $t: /"
        if [ "${FUZZ_MERGE:-0}" = 1 ] && [ -n "$(ls -A "$scratch/$t")" ]; then
            before=$(find "$corpus" -type f | wc -l)
            cargo fuzz run --sanitizer "$sanitizer" "$t" "$corpus" "$scratch/$t" -- -merge=1 \
                >>"$log" 2>&1
            echo "fuzz: $t: corpus $before -> $(find "$corpus" -type f | wc -l) files"
        fi
    else
        echo "fuzz: $t FAILED; the panic or error, then the last lines of $log:"
        grep -m 3 -A 4 -E 'panicked at|ERROR: (AddressSanitizer|libFuzzer)' "$log" || true
        echo "..."
        tail -n 40 "$log"
        echo "fuzz: crashing input(s):"
        ls -l "fuzz/artifacts/$t" || true
        echo "fuzz: reproduce: RUSTC_BOOTSTRAP=1 cargo fuzz run $t fuzz/artifacts/$t/<file>"
        failed+=("$t")
    fi
done

if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz: FAILED: ${failed[*]}"
    exit 1
fi
if [ "$replay" = 1 ]; then
    echo "fuzz: every committed input replayed without a failure"
else
    echo "fuzz: all targets ran ${duration}s without a failure"
fi
