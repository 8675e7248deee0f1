#!/usr/bin/env bash
# A/B of two or more Ferrite builds over NBD: for each round and each binary, a fresh daemon on a
# sparse pool, a 1 GiB volume filled sequentially and then scattered by 3 s of random writes,
# then the fio (nbd engine) workloads. Prints one line per (workload, binary, round): IOPS and
# server CPU seconds per GiB moved. Binaries alternate inside each round, so compare them within
# a round: this class of machine drifts by several times within minutes.
#   ROUNDS=2 SECS=5 WORKLOADS="randread:32 randrw:1 write:1:128k" bench/ab_nbd.sh /tmp/old /tmp/new
# A workload is rw:iodepth[:bs[:jobs]] (bs default 4k, jobs default 1; fio's --rw names).
# POOL sets the pool's size (default 8G); POOL=1536M keeps the cleaner working through the rows.
set -euo pipefail
ROUNDS=${ROUNDS:-2}
SECS=${SECS:-5}
WORKLOADS=${WORKLOADS:-"randread:32 randread:1 randrw:32 randrw:1 randwrite:1 write:1:128k"}
DIR=${BENCH_DIR:-/tmp/ferrite-ab}
[ $# -ge 1 ] || { echo "usage: $0 FERRITE_BINARY..." >&2; exit 2; }
command -v fio >/dev/null || { echo "SKIPPED: fio is not installed (scripts/setup.sh installs it)"; exit 0; }
fio --enghelp 2>/dev/null | grep -qw nbd || { echo "SKIPPED: this fio has no nbd engine"; exit 0; }

PID=
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
PARSE='
import json, sys
t = sys.stdin.read()
j = json.loads(t[t.index("{"):])["jobs"][0]  # fio may print notes before the JSON
iops = j["read"]["iops"] + j["write"]["iops"]
gib = (j["read"]["io_bytes"] + j["write"]["io_bytes"]) / 2**30
print(f"{sys.argv[1]:<20} {sys.argv[2]:<30} round {sys.argv[5]}  {iops:9.0f} IOPS  {(int(sys.argv[4]) - int(sys.argv[3])) / 100 / gib if gib else 0:6.2f} CPU s/GiB")
'
for round in $(seq "$ROUNDS"); do
  for bin in "$@"; do
    echo "round $round/$ROUNDS: $bin" >&2
    rm -rf "$DIR"; mkdir -p "$DIR"
    printf 'pool-size = "%s"\n' "${POOL:-8G}" > "$DIR/ferrite.toml"
    "$bin" daemon --config "$DIR/ferrite.toml" --data-dir "$DIR/data" >"$DIR/ferrite.log" 2>&1 &
    PID=$!
    export FERRITE_ADMIN_SOCKET="$DIR/data/admin.sock"
    for _ in $(seq 600); do "$bin" pool status >/dev/null 2>&1 && break; sleep 0.1; done
    "$bin" volume create v 1G >/dev/null
    "$bin" export nbd v >/dev/null
    uri="nbd+unix:///v?socket=$DIR/data/nbd.sock"
    fio --name=fill --ioengine=nbd --uri="$uri" --size=1G --rw=write --bs=1M --iodepth=4 --output=/dev/null
    fio --name=scatter --ioengine=nbd --uri="$uri" --size=1G --rw=randwrite --bs=4k --iodepth=32 --runtime=3 \
      --time_based --output=/dev/null
    for w in $WORKLOADS; do
      IFS=: read -r rw qd bs jobs <<<"$w"
      c0=$(cpu "$PID")
      json=$(fio --name=ab --ioengine=nbd --uri="$uri" --size=1G --rw="$rw" --rwmixread=70 --bs="${bs:-4k}" \
        --iodepth="$qd" --numjobs="${jobs:-1}" --group_reporting --runtime="$SECS" --time_based --randrepeat=0 \
        --output-format=json)
      c1=$(cpu "$PID")
      python3 -c "$PARSE" "$w" "$bin" "$c0" "$c1" "$round" <<<"$json"
    done
    kill "$PID"; wait "$PID" 2>/dev/null || true; PID=
  done
done
