#!/usr/bin/env bash
# Backups to S3, in one run against SeaweedFS on loopback (installed by scripts/setup.sh from
# PyPI): full backup beside a raw parallel PUT loop to the same store, an incremental after 1%
# random 4 KiB rewrites, a clone's backup (dedup), a full restore; request counts of each.
#   VOLUME_GIB=10 CHUNK_MIB=4 CONCURRENCY=8 bench/backup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
cargo build --workspace --locked --bin backup-bench >&2
DIR=$(mktemp -d "${BENCH_DIR:-/var/tmp}/ferrite-backup-bench.XXXX")
trap 'kill "$WEED_PID" 2>/dev/null; wait "$WEED_PID" 2>/dev/null; rm -rf "$DIR"' EXIT
mkdir -p "$DIR/store" "$DIR/pool"
P=$((20000 + RANDOM % 20000))
"$FERRITE_WEED" server -dir="$DIR/store" -ip=127.0.0.1 -ip.bind=127.0.0.1 -master.volumeSizeLimitMB=1024 -volume.max=200 -s3.port.iceberg=0 -s3.port.lance=0 \
  -master.port=$P -volume.port=$((P + 1)) -filer.port=$((P + 2)) -s3 -s3.port=$((P + 3)) > "$DIR/weed.log" 2>&1 &
WEED_PID=$!
for _ in $(seq 1 120); do
  curl -s -o /dev/null -X PUT "http://127.0.0.1:$((P + 3))/bench" && break
  sleep 0.5
done
until [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$((P + 3))/bench?max-keys=1")" = 200 ]; do sleep 0.5; done
echo "SeaweedFS $("$FERRITE_WEED" version 2>/dev/null | head -1 | awk '{print $3}') on 127.0.0.1:$((P + 3)); $(nproc) cores"
"$CARGO_TARGET_DIR/debug/backup-bench" "$DIR/pool" "http://127.0.0.1:$((P + 3))" bench \
  "${VOLUME_GIB:-10}" "${CHUNK_MIB:-4}" "${CONCURRENCY:-8}"
echo "store on disk: $(du -sh "$DIR/store" | cut -f1)"
