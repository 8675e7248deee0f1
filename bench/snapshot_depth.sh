#!/usr/bin/env bash
# Reads against snapshot depth, over NBD, side by side in one run: one daemon, one volume per
# count in DEPTHS, each 1 GiB written in full, then that many snapshots with 4 MiB of random
# 4 KiB writes after every 100 (so the chain's layers hold real maps); then fio 4 KiB random
# reads at QD32 on each volume in turn, ROUNDS times (volumes alternate inside each round, since
# this class of machine drifts within minutes). Prints per volume the median IOPS and p99, and
# the ratio to the volume with no snapshot.
#   DEPTHS="0 32 200 1000" ROUNDS=3 SECS=5 FERRITE_BIN=target/debug/ferrite bench/snapshot_depth.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEPTHS=${DEPTHS:-"0 32 200 1000"}
ROUNDS=${ROUNDS:-3}
SECS=${SECS:-5}
DIR=${BENCH_DIR:-/tmp/ferrite-depth}
command -v fio >/dev/null || { echo "SKIPPED: fio is not installed (scripts/setup.sh installs it)"; exit 0; }
fio --enghelp 2>/dev/null | grep -qw nbd || { echo "SKIPPED: this fio has no nbd engine"; exit 0; }
if [ -z "${FERRITE_BIN:-}" ]; then
  . scripts/setup.sh
  cargo build --locked -p ferrite >&2
  FERRITE_BIN="$CARGO_TARGET_DIR/debug/ferrite"
fi
F=$FERRITE_BIN

PID=
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT
rm -rf "$DIR"; mkdir -p "$DIR"
printf 'pool-size = "64G"\n' > "$DIR/ferrite.toml"
"$F" daemon --config "$DIR/ferrite.toml" --data-dir "$DIR/data" >"$DIR/ferrite.log" 2>&1 &
PID=$!
export FERRITE_ADMIN_SOCKET="$DIR/data/admin.sock"
for _ in $(seq 600); do "$F" pool status >/dev/null 2>&1 && break; sleep 0.1; done
uri() { echo "nbd+unix:///$1?socket=$DIR/data/nbd.sock"; }
scatter() { # 4 MiB of random 4 KiB writes (1024 of them)
  fio --name=scatter --ioengine=nbd --uri="$(uri "$1")" --size=1G --rw=randwrite --bs=4k --iodepth=32 \
    --number_ios=1024 --randrepeat=0 --output=/dev/null
}

for d in $DEPTHS; do
  v="d$d"
  "$F" volume create "$v" 1G >/dev/null
  "$F" export nbd "$v" >/dev/null
  fio --name=fill --ioengine=nbd --uri="$(uri "$v")" --size=1G --rw=write --bs=1M --iodepth=4 --output=/dev/null
  start=$(date +%s.%N)
  for i in $(seq 1 "$d"); do
    ((i % 100 == 0)) && scatter "$v"
    "$F" snapshot create "$v" "$v-s$i" >/dev/null
  done
  echo "volume $v: $d snapshots in $(python3 -c "print(f'{$(date +%s.%N) - $start:.1f}')") s" >&2
done

PARSE='
import json, sys
t = sys.stdin.read()
r = json.loads(t[t.index("{"):])["jobs"][0]["read"]
print(r["iops"], r["clat_ns"]["percentile"]["99.000000"] / 1e6)
'
results=$DIR/results
: > "$results"
for round in $(seq "$ROUNDS"); do
  for d in $DEPTHS; do
    json=$(fio --name=depth --ioengine=nbd --uri="$(uri "d$d")" --size=1G --rw=randread --bs=4k --iodepth=32 \
      --runtime="$SECS" --time_based --randrepeat=0 --output-format=json)
    echo "$d $(python3 -c "$PARSE" <<<"$json")" >> "$results"
    echo "round $round: $d snapshots done" >&2
  done
done
rss=$(awk '/VmRSS/ {print $2 / 1024}' "/proc/$PID/status")
python3 - "$results" "$rss" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
by = {}
for d, iops, p99 in rows:
    by.setdefault(int(d), []).append((float(iops), float(p99)))
base = statistics.median(i for i, _ in by[min(by)])
print(f"{'snapshots':>9}  {'IOPS (median)':>13}  {'vs ' + str(min(by)):>7}  {'p99 ms (median)':>15}")
for d in sorted(by):
    iops = statistics.median(i for i, _ in by[d])
    p99 = statistics.median(p for _, p in by[d])
    print(f"{d:>9}  {iops:>13.0f}  {iops / base:>6.2f}x  {p99:>15.2f}")
print(f"daemon RSS {float(sys.argv[2]):.0f} MiB")
EOF
