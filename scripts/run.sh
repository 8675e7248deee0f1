#!/usr/bin/env bash
# The main job: set up, build, start the ferrite daemon on an embedded default pool under
# ./ferrite-data (a sparse 16 GiB file plus RocksDB metadata), create a 1 GiB volume "demo",
# export it over NBD and print how to use it. The daemon stays in the foreground; Ctrl-C (SIGINT)
# or SIGTERM stops it cleanly. Run it again and it reopens the same pool.
#   FERRITE_DATA_DIR=/path scripts/run.sh     picks another data directory
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
# The dev profile builds dependencies optimised (see Cargo.toml) and shares its artifacts with
# the test suite, so RocksDB is compiled once for both.
echo "building ferrite (the first build compiles RocksDB: ~15-25 min on 2 cores)..." >&2
cargo build --locked --workspace --bin ferrite
FERRITE="$CARGO_TARGET_DIR/debug/ferrite"
DATA="${FERRITE_DATA_DIR:-$PWD/ferrite-data}"
mkdir -p "$DATA"
export FERRITE_ADMIN_SOCKET="$DATA/admin.sock"

"$FERRITE" daemon --data-dir "$DATA" &
DAEMON=$!
# Ctrl-C (or SIGTERM) stops the daemon cleanly; the script exits with the daemon's status.
trap 'kill -TERM $DAEMON 2>/dev/null; rc=0; wait $DAEMON || rc=$?; exit $rc' INT TERM
for _ in $(seq 1 600); do
  "$FERRITE" pool status >/dev/null 2>&1 && break
  kill -0 $DAEMON 2>/dev/null || { echo "the daemon exited; see the messages above" >&2; exit 1; }
  sleep 0.1
done
"$FERRITE" volume show demo >/dev/null 2>&1 || "$FERRITE" volume create demo 1G
"$FERRITE" export list | grep -qw demo || "$FERRITE" export nbd demo >/dev/null
echo
"$FERRITE" pool status
echo
"$FERRITE" export list
cat <<EOT

Ferrite is serving volume "demo" over NBD. From another shell:
  nbdinfo 'nbd+unix:///demo?socket=$DATA/nbd.sock'
  qemu-img info 'nbd:unix:$DATA/nbd.sock:exportname=demo'
  qemu-io -f raw -c 'write -P 0xab 0 1M' -c 'read -P 0xab 0 1M' 'nbd:unix:$DATA/nbd.sock:exportname=demo'
  FERRITE_ADMIN_SOCKET=$DATA/admin.sock $FERRITE volume list
Press Ctrl-C to stop the daemon (it drains, flushes and checkpoints).
EOT
wait $DAEMON
