#!/usr/bin/env bash
# I/O against snapshot depth, over NBD, side by side in one run: one daemon, one volume per
# count in DEPTHS, each SIZE (default 1G) written in full, then that many snapshots with 4 MiB
# of random 4 KiB writes after every 100 (so the chain's layers hold real maps); and, with
# CLONES=n, a volume at the end of an n-deep clone-of-clone chain (4 MiB of random writes every
# 10 clones). Then each fio job of JOBS (rw:bs, QD32; default 4 KiB random reads; randtrim:4k
# and randwrite:512 (partial blocks, read-modify-write) exercise the chain too) on each volume
# in turn, ROUNDS times (volumes alternate inside each round, since this class of machine drifts
# within minutes). Prints per job and volume the median IOPS and p99 and the ratio to the first
# of DEPTHS; then the daemon's RSS, and the time from a restart to ready with all of it.
#   DEPTHS="0 32 200 1000 10000" CLONES=100 JOBS="randread:4k randtrim:4k" ROUNDS=3 SECS=5 \
#     FERRITE_BIN=target/debug/ferrite bench/snapshot_depth.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEPTHS=${DEPTHS:-"0 32 200 1000"}
CLONES=${CLONES:-0}
SIZE=${SIZE:-1G}
JOBS=${JOBS:-randread:4k}
ROUNDS=${ROUNDS:-3}
SECS=${SECS:-5}
DIR=${BENCH_DIR:-/tmp/ferrite-depth}
command -v fio >/dev/null || { echo "SKIPPED: fio is not installed (scripts/setup.sh installs it)"; exit 0; }
fio --enghelp 2>/dev/null | grep -qw nbd || { echo "SKIPPED: this fio has no nbd engine"; exit 0; }
if [ -z "${FERRITE_BIN:-}" ]; then
  . scripts/setup.sh
  cargo build --workspace --locked --bin ferrite >&2
  FERRITE_BIN="$CARGO_TARGET_DIR/debug/ferrite"
fi
F=$FERRITE_BIN

PID=
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT
rm -rf "$DIR"; mkdir -p "$DIR"
printf 'pool-size = "64G"\n' > "$DIR/ferrite.toml"
start_daemon() {
  "$F" daemon --config "$DIR/ferrite.toml" --data-dir "$DIR/data" >>"$DIR/ferrite.log" 2>&1 &
  PID=$!
  for _ in $(seq 6000); do "$F" pool status >/dev/null 2>&1 && return; sleep 0.01; done
  echo "the daemon did not come up; its log:" >&2; cat "$DIR/ferrite.log" >&2; exit 1
}
export FERRITE_ADMIN_SOCKET="$DIR/data/admin.sock"
start_daemon
uri() { echo "nbd+unix:///$1?socket=$DIR/data/nbd.sock"; }
scatter() { # 4 MiB of random 4 KiB writes (1024 of them)
  fio --name=scatter --ioengine=nbd --uri="$(uri "$1")" --size="$SIZE" --rw=randwrite --bs=4k --iodepth=32 \
    --number_ios=1024 --randrepeat=0 --output=/dev/null
}

for d in $DEPTHS; do
  v="d$d"
  "$F" volume create "$v" "$SIZE" >/dev/null
  "$F" export nbd "$v" >/dev/null
  fio --name=fill --ioengine=nbd --uri="$(uri "$v")" --size="$SIZE" --rw=write --bs=1M --iodepth=4 --output=/dev/null
  # Each snapshot's `ferrite snapshot create` (a CLI process and the snapshot), first and last 100.
  first=0 last=0
  for i in $(seq 1 "$d"); do
    ((i % 100 == 0)) && scatter "$v"
    t=$EPOCHREALTIME
    "$F" snapshot create "$v" "$v-s$i" >/dev/null
    t=$(((${EPOCHREALTIME/./} - ${t/./}) / 1000))
    if ((i <= 100)); then first=$((first + t)); fi
    if ((i > d - 100)); then last=$((last + t)); fi
  done
  if ((d >= 100)); then
    echo "volume $v: snapshot create $((first / 100)) ms (first 100), $((last / 100)) ms (last 100)" >&2
  fi
done
VOLS=""
for d in $DEPTHS; do VOLS="$VOLS d$d"; done
if [ "$CLONES" -gt 0 ]; then
  "$F" volume create c0 "$SIZE" >/dev/null
  "$F" export nbd c0 >/dev/null
  fio --name=fill --ioengine=nbd --uri="$(uri c0)" --size="$SIZE" --rw=write --bs=1M --iodepth=4 --output=/dev/null
  for i in $(seq 1 "$CLONES"); do
    "$F" clone "c$((i - 1))" "c$i" >/dev/null
    "$F" export nbd "c$i" >/dev/null
    ((i % 10 == 0)) && scatter "c$i"
  done
  VOLS="$VOLS c$CLONES"
fi

PARSE='
import json, sys
t = sys.stdin.read()
job = json.loads(t[t.index("{"):])["jobs"][0]
r = max((job[d] for d in ("read", "write", "trim")), key=lambda r: r["total_ios"])
print(r["iops"], r["clat_ns"]["percentile"]["99.000000"] / 1e6)
'
results=$DIR/results
: > "$results"
for round in $(seq "$ROUNDS"); do
  for job in $JOBS; do
    for v in $VOLS; do
      json=$(fio --name=depth --ioengine=nbd --uri="$(uri "$v")" --size="$SIZE" --rw="${job%%:*}" --bs="${job#*:}" \
        --iodepth=32 --runtime="$SECS" --time_based --randrepeat=0 --output-format=json)
      echo "$job $v $(python3 -c "$PARSE" <<<"$json")" >> "$results"
      echo "round $round: $job on $v done" >&2
    done
  done
done
rss=$(awk '/VmRSS/ {print $2 / 1024}' "/proc/$PID/status")
kill "$PID"; wait "$PID" || true
t0=$(date +%s.%N)
start_daemon
ready=$(python3 -c "print(f'{$(date +%s.%N) - $t0:.2f}')")
rss_after=$(awk '/VmRSS/ {print $2 / 1024}' "/proc/$PID/status")
python3 - "$results" <<'EOF'
import statistics, sys
by = {}
for job, v, iops, p99 in (l.split() for l in open(sys.argv[1])):
    by.setdefault(job, {}).setdefault(v, []).append((float(iops), float(p99)))
label = lambda v: f"{v[1:]} snapshots" if v[0] == "d" else f"{v[1:]}-deep clone chain"
print(f"{'job':>13}  {'volume':>22}  {'IOPS (median)':>13}  {'ratio':>6}  {'p99 ms (median)':>15}")
for job, vols in by.items():
    base = statistics.median(i for i, _ in next(iter(vols.values())))
    for v, rows in vols.items():
        iops = statistics.median(i for i, _ in rows)
        p99 = statistics.median(p for _, p in rows)
        print(f"{job:>13}  {label(v):>22}  {iops:>13.0f}  {iops / base:>5.2f}x  {p99:>15.2f}")
EOF
echo "daemon RSS ${rss%.*} MiB; restart to ready ${ready} s, RSS then ${rss_after%.*} MiB"
