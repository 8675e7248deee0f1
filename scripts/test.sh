#!/usr/bin/env bash
# The whole test suite: setup, formatting, lints, then every test. Used by .ci/run.
#   FERRITE_LONG=1 scripts/test.sh     runs the long property-test mode as well
#   FERRITE_VM=0 scripts/test.sh       skips the tier that boots a QEMU guest for kernel block devices
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
# Kernel block devices (ublk, kernel NBD client) exist only in a QEMU guest here. The
# harness installs what it needs on first use and prints SKIPPED where it cannot.
if [ "${FERRITE_VM:-1}" != 0 ]; then
  step "VM tier: Ferrite volumes as ublk and kernel NBD devices in one QEMU guest (TCG, ~4 min)"
  echo "$CARGO_TARGET_DIR/debug/ferrite" > .vm-ferrite
  cargo test --workspace --locked --no-run --test csi_node --message-format=json 2>/dev/null |
    sed -n 's/.*"executable":"\([^"]*\/csi_node-[^"]*\)".*/\1/p' > .vm-csi-node
  trap 'rm -f .vm-ferrite .vm-csi-node' EXIT
  VM_TIMEOUT=1500 bash tests/vm/run.sh tests/vm/guest.sh
else
  echo "SKIPPED: VM tier (FERRITE_VM=0)" >&2
fi
# nextest last: its summary line is the suite's closing line.
step "tests"
cargo nextest run --workspace --locked --no-fail-fast --status-level fail --final-status-level slow
