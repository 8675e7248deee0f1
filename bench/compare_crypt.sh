#!/usr/bin/env bash
# Encrypted vs plain volumes, in one run, two ways:
# - engine: `engine-load` (io_uring backend, file pool) on a plain volume and on an encrypted one
#   (FERRITE_BENCH_ENCRYPT=1), each on a pool of its own;
# - nbd: one daemon (file pool, written once in full) serving a plain and an encrypted volume over
#   NBD (Unix socket) to fio's nbd engine, after both were filled; the daemon's CPU per row.
# Alternating plain/encrypted, ROUNDS rounds per workload; prints the median IOPS of each, the
# encrypted/plain ratio, and the CPU each spends per GiB moved.
#
#   ROUNDS=3 SECS=5 SIZE=1G BENCH_DIR=/work/bench VIA="engine nbd" bench/compare_crypt.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
SECS=${SECS:-5}
SIZE=${SIZE:-1G}
DIR=${BENCH_DIR:-$PWD/bench-data}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/ferrite/target}"
VIA=${VIA:-engine nbd}
WORKLOADS=${ONLY:-randwrite-4k-qd32 randread-4k-qd32 seqwrite-128k-qd1 seqread-128k-qd1}
echo "building..." >&2
cargo build --workspace --locked --bin engine-load --bin ferrite >&2
LOAD="$CARGO_TARGET_DIR/debug/engine-load"
FERRITE="$CARGO_TARGET_DIR/debug/ferrite"
mkdir -p "$DIR"
DAEMON=
cleanup() {
  [ -n "$DAEMON" ] && kill "$DAEMON" 2>/dev/null && wait "$DAEMON" 2>/dev/null
  rm -rf "$DIR"/crypt.*
}
trap cleanup EXIT
BYTES=$(python3 -c "import sys; u={'K':10,'M':20,'G':30}; s=sys.argv[1]; print(int(s[:-1])<<u[s[-1]] if s[-1] in u else int(s))" "$SIZE")
report() { # results-file title: the table of medians
  python3 - "$1" "$SECS" "$2" <<'PY'
import sys, statistics
rows = {}
for line in open(sys.argv[1]):
    mode, name, iops, mibs, cpu = line.split()
    rows.setdefault((name, mode), []).append((float(iops), float(mibs), float(cpu)))
print(sys.argv[3])
print(f"{'workload':22} {'plain IOPS':>11} {'encr. IOPS':>11} {'ratio':>6} {'plain CPU-s/GiB':>16} {'encr. CPU-s/GiB':>16}")
for name in dict.fromkeys(n for n, _ in rows):
    p, e = rows[(name, 'plain')], rows[(name, 'encrypted')]
    med = lambda r, i: statistics.median(x[i] for x in r)
    secs = float(sys.argv[2])
    per_gib = lambda r: statistics.median(x[2] / max(x[1] * secs / 1024, 1e-9) for x in r)
    print(f"{name:22} {med(p,0):11.0f} {med(e,0):11.0f} {med(e,0)/med(p,0):6.2f} {per_gib(p):16.2f} {per_gib(e):16.2f}")
PY
}

if [[ " $VIA " == *" nbd "* ]]; then
  command -v fio >/dev/null && fio --enghelp 2>/dev/null | grep -qw nbd || { echo "SKIPPED nbd: no fio with the nbd engine" >&2; VIA=${VIA/nbd/}; }
fi
if [[ " $VIA " == *" nbd "* ]]; then
  d=$(mktemp -d "$DIR/crypt.XXXXXX")
  chmod 700 "$d"
  printf 'pool-size = "%s"\n' "$(( BYTES * 6 ))" >"$d/ferrite.toml"
  "$FERRITE" pool format --preallocate --config "$d/ferrite.toml" --data-dir "$d" >&2
  "$FERRITE" daemon --config "$d/ferrite.toml" --data-dir "$d" >"$d/daemon.log" 2>&1 &
  DAEMON=$!
  export FERRITE_ADMIN_SOCKET="$d/admin.sock"
  for _ in $(seq 600); do "$FERRITE" pool status >/dev/null 2>&1 && break; sleep 0.1; done
  "$FERRITE" volume create plain "$SIZE" >/dev/null
  "$FERRITE" volume create encrypted "$SIZE" --encrypt >/dev/null
  for v in plain encrypted; do
    "$FERRITE" export nbd "$v" >/dev/null
    echo "filling $v..." >&2
    fio --name=fill --ioengine=nbd --uri="nbd+unix:///$v?socket=$d/nbd.sock" --size="$SIZE" --rw=write --bs=1M --iodepth=4 --output=/dev/null
  done
  cpu() { awk '{print $14 + $15}' "/proc/$DAEMON/stat"; }
  results=$(mktemp)
  for round in $(seq 1 "$ROUNDS"); do
    for name in $WORKLOADS; do
      IFS=- read -r rw bs qd <<<"$name"
      rw=${rw/seq/}
      for mode in plain encrypted; do
        echo "nbd round $round/$ROUNDS: $name $mode" >&2
        c0=$(cpu)
        json=$(fio --name="$name" --ioengine=nbd --uri="nbd+unix:///$mode?socket=$d/nbd.sock" --size="$SIZE" --rw="$rw" \
          --bs="$bs" --iodepth="${qd#qd}" --runtime="$SECS" --time_based --randrepeat=0 --output-format=json)
        c1=$(cpu)
        python3 -c '
import json, sys
text = sys.stdin.read()
j = json.loads(text[text.index("{"):])["jobs"][0]
iops = j["read"]["iops"] + j["write"]["iops"]
mibs = (j["read"]["bw_bytes"] + j["write"]["bw_bytes"]) / 2**20
print(sys.argv[1], sys.argv[2], iops, mibs, (int(sys.argv[4]) - int(sys.argv[3])) / 100)
' "$mode" "$name" "$c0" "$c1" <<<"$json" >>"$results"
      done
    done
  done
  kill "$DAEMON"; wait "$DAEMON" 2>/dev/null || true; DAEMON=
  unset FERRITE_ADMIN_SOCKET
  rm -rf "$d"
  report "$results" "through NBD (fio nbd engine, one daemon; CPU: the daemon's)"
  rm -f "$results"
fi

[[ " $VIA " == *" engine "* ]] || exit 0
results=$(mktemp)
for round in $(seq 1 "$ROUNDS"); do
  for name in $WORKLOADS; do
    for mode in plain encrypted; do
      echo "round $round/$ROUNDS: $name $mode" >&2
      d=$(mktemp -d "$DIR/crypt.XXXXXX")
      enc=0; [ "$mode" = encrypted ] && enc=1
      line=$(FERRITE_BENCH_ENCRYPT=$enc "$LOAD" "$d" "$name" "$SECS" "$BYTES")
      rm -rf "$d"
      echo "$mode $line" >>"$results"
    done
  done
done
report "$results" "through the engine (engine-load, a pool per run; CPU: the process's)"
rm -f "$results"
