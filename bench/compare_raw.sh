#!/usr/bin/env bash
# Engine vs. the raw file, in one run, on the same filesystem.
#
# For each workload (4 KiB random write/read at QD1 and QD32, 128 KiB and 1 MiB sequential
# writes at QD1 and QD16, 128 KiB sequential read), runs fio (ioengine=io_uring, direct=1) on a preallocated raw file and
# `engine-load` (the engine's io_uring backend on a pool file) for the same time, alternating, for
# ROUNDS rounds; prints the median IOPS of each and the engine/raw ratio.
#
#   ROUNDS=3 SECS=5 SIZE=1G BENCH_DIR=/work/bench bench/compare_raw.sh
#   ONLY='seqwrite-1m-qd1 randwrite-4k-qd1' runs only the workloads named.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
SECS=${SECS:-5}
SIZE=${SIZE:-1G}
DIR=${BENCH_DIR:-$PWD/bench-data}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/ferrite/target}"

command -v fio >/dev/null || { echo "SKIPPED: fio is not installed (scripts/setup.sh installs it)"; exit 0; }
echo "building engine-load..." >&2
# --workspace: a single-package build resolves other features and rebuilds RocksDB. The dev
# profile builds the engine and the bench with opt-level 2 (Cargo.toml).
cargo build --workspace --locked --bin engine-load >&2
LOAD="$CARGO_TARGET_DIR/debug/engine-load"

mkdir -p "$DIR"
trap 'rm -rf "$DIR/raw.img" "$DIR"/eng.*' EXIT
BYTES=$(python3 -c "import sys; u={'K':10,'M':20,'G':30}; s=sys.argv[1]; print(int(s[:-1])<<u[s[-1]] if s[-1] in u else int(s))" "$SIZE")
echo "preallocating the raw file ($SIZE)..." >&2
fio --name=prefill --filename="$DIR/raw.img" --size="$SIZE" --rw=write --bs=1M --ioengine=io_uring \
    --direct=1 --iodepth=8 --output=/dev/null

# name rw bs qd
WORKLOADS="randwrite-4k-qd1 randwrite 4k 1
randwrite-4k-qd32 randwrite 4k 32
randread-4k-qd1 randread 4k 1
randread-4k-qd32 randread 4k 32
seqwrite-128k-qd1 write 128k 1
seqwrite-128k-qd16 write 128k 16
seqwrite-1m-qd1 write 1m 1
seqwrite-1m-qd16 write 1m 16
seqread-128k-qd1 read 128k 1"

results=$(mktemp)
for round in $(seq 1 "$ROUNDS"); do
  while read -r name rw bs qd; do
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then continue; fi
    echo "round $round/$ROUNDS: $name" >&2
    raw=$(fio --name="$name" --filename="$DIR/raw.img" --size="$SIZE" --rw="$rw" --bs="$bs" \
      --ioengine=io_uring --direct=1 --iodepth="$qd" --runtime="$SECS" --time_based \
      --randrepeat=0 --output-format=json |
      python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; print(j['read']['iops']+j['write']['iops'])")
    d=$(mktemp -d "$DIR/eng.XXXX")
    eng=$("$LOAD" "$d" "$name" "$SECS" "$BYTES" | awk '{print $2}')
    rm -rf "$d"
    echo "$name $raw $eng" >>"$results"
  done <<<"$WORKLOADS"
done

python3 - "$results" <<'PY'
import sys, statistics
rows = {}
order = []
for line in open(sys.argv[1]):
    name, raw, eng = line.split()
    if name not in rows:
        order.append(name)
    rows.setdefault(name, []).append((float(raw), float(eng)))
print(f"{'workload':<20} {'raw IOPS':>10} {'engine IOPS':>12} {'engine/raw':>11}   (medians of {len(rows[order[0]])} rounds)")
for name in order:
    raw = statistics.median(r for r, _ in rows[name])
    eng = statistics.median(e for _, e in rows[name])
    print(f"{name:<20} {raw:>10.0f} {eng:>12.0f} {eng / raw:>10.2f}x")
PY
rm -f "$results"
