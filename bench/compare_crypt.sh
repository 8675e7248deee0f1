#!/usr/bin/env bash
# Encrypted vs plain volumes through the engine, in one run: `engine-load` (io_uring backend,
# file pool) on a plain volume and on an encrypted one (FERRITE_BENCH_ENCRYPT=1), alternating,
# ROUNDS rounds per workload; prints the median IOPS and CPU-seconds of each, the
# encrypted/plain ratio, and the CPU each spends per GiB moved.
#
#   ROUNDS=3 SECS=5 SIZE=1G BENCH_DIR=/work/bench bench/compare_crypt.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
SECS=${SECS:-5}
SIZE=${SIZE:-1G}
DIR=${BENCH_DIR:-$PWD/bench-data}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/ferrite/target}"
echo "building engine-load..." >&2
cargo build --workspace --locked --bin engine-load >&2
LOAD="$CARGO_TARGET_DIR/debug/engine-load"
mkdir -p "$DIR"
trap 'rm -rf "$DIR"/crypt.*' EXIT
BYTES=$(python3 -c "import sys; u={'K':10,'M':20,'G':30}; s=sys.argv[1]; print(int(s[:-1])<<u[s[-1]] if s[-1] in u else int(s))" "$SIZE")
results=$(mktemp)
for round in $(seq 1 "$ROUNDS"); do
  for name in ${ONLY:-randwrite-4k-qd32 randread-4k-qd32 seqwrite-128k-qd1 seqread-128k-qd1}; do
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
python3 - "$results" "$SECS" <<'PY'
import sys, statistics
rows = {}
for line in open(sys.argv[1]):
    mode, name, iops, mibs, cpu = line.split()
    rows.setdefault((name, mode), []).append((float(iops), float(mibs), float(cpu)))
print(f"{'workload':22} {'plain IOPS':>11} {'encr. IOPS':>11} {'ratio':>6} {'plain CPU-s/GiB':>16} {'encr. CPU-s/GiB':>16}")
for name in dict.fromkeys(n for n, _ in rows):
    p, e = rows[(name, 'plain')], rows[(name, 'encrypted')]
    med = lambda r, i: statistics.median(x[i] for x in r)
    secs = float(sys.argv[2])
    per_gib = lambda r: statistics.median(x[2] / max(x[1] * secs / 1024, 1e-9) for x in r)
    print(f"{name:22} {med(p,0):11.0f} {med(e,0):11.0f} {med(e,0)/med(p,0):6.2f} {per_gib(p):16.2f} {per_gib(e):16.2f}")
PY
rm -f "$results"
