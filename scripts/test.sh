#!/usr/bin/env bash
# The whole test suite: setup, formatting, lints, then every test. Used by .ci/run.
#   FERRITE_LONG=1 scripts/test.sh     runs the long property-test mode as well
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh

step() { printf '\n== %s\n' "$*" >&2; }
step "rustfmt"
cargo fmt --all --check
step "build (first cold build compiles RocksDB: ~15-25 min on 2 cores)"
cargo build --workspace --all-targets --locked
step "clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
step "doc tests"
cargo test --workspace --doc --locked -q
# nextest last: its summary line is the suite's closing line.
step "tests"
cargo nextest run --workspace --locked --no-fail-fast --status-level fail --final-status-level slow
