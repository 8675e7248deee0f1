#!/usr/bin/env bash
# The main job: set up, build, and run Ferrite's engine demo on an embedded default pool under
# ./ferrite-data (a 4 GiB sparse file and a RocksDB directory). Extra arguments go to `ferrite demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
# The dev profile builds dependencies optimised (see Cargo.toml), and shares its artifacts with
# the test suite, so RocksDB is compiled once for both.
echo "building ferrite (the first build compiles RocksDB: ~15-25 min on 2 cores)..." >&2
cargo build --locked -p ferrite
exec "$CARGO_TARGET_DIR/debug/ferrite" demo "$@"
