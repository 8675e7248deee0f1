#!/usr/bin/env bash
# What a change to a build profile or to the I/O path runs before it lands: the binary
# scripts/run.sh serves with, built from BASE (default: the commit the change starts from,
# `git merge-base HEAD origin/main`, else HEAD~1) and from the working tree, side by side in one
# run, alternating inside each round (this class of machine drifts by several times within
# minutes: compare within a round, and medians):
#   - local writes and reads over NBD with the pool in memory (bench/ab_nbd.sh on /dev/shm:
#     4 KiB random write and read at QD1 and QD32), IOPS and server CPU per GiB;
#   - synchronous replicas (bench/sync_replicas.sh, needs root): 4 KiB random writes at QD1 and
#     QD32 with 1, 2 and 3 copies, p50, the ratio to one copy, CPU µs and context switches per
#     write (skipped without root or fio).
# Prints the medians of each binary and new/base per row; paste them into the change's note.
#   ROUNDS=3 SECS=5 bench/before_landing.sh [BASE]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
SECS=${SECS:-5}
DIR=${BENCH_DIR:-/tmp/ferrite-before-landing}
BASE=${1:-$(git merge-base HEAD origin/main 2>/dev/null || git rev-parse HEAD~1)}
. scripts/setup.sh >/dev/null
rm -rf "$DIR"; mkdir -p "$DIR"
trap 'git worktree remove --force "$DIR/base-src" 2>/dev/null || true' EXIT

echo "building the working tree and $BASE (shared target dir)" >&2
cargo build --workspace --locked --bins >&2
cp "$CARGO_TARGET_DIR/debug/ferrite" "$DIR/new"
git worktree add -q --detach "$DIR/base-src" "$BASE"
(cd "$DIR/base-src" && cargo build --workspace --locked --bins >&2)
cp "$CARGO_TARGET_DIR/debug/ferrite" "$DIR/base"
cp "$CARGO_TARGET_DIR/debug/delay-line" "$DIR/delay-line" 2>/dev/null || true
# Leave the working tree's binaries in the target dir, as they were (the base's build wrote over
# them; touching the binary's root makes cargo link it again).
touch daemon/src/main.rs
cargo build --workspace --locked --bins >&2

OUT=$DIR/rows.txt
: > "$OUT"
echo "local: NBD, pool in memory" >&2
BENCH_DIR=/dev/shm/ferrite-before-landing POOL=2G ROUNDS=$ROUNDS SECS=$SECS \
  WORKLOADS="randwrite:1 randwrite:32 randread:1 randread:32" bench/ab_nbd.sh "$DIR/base" "$DIR/new" |
  awk '{bin = ($2 ~ /\/new$/) ? "new" : "base"; print "local", $1, bin, $5, $7}' >> "$OUT"
if [ "$(id -u)" = 0 ] && command -v fio >/dev/null; then
  for round in $(seq "$ROUNDS"); do
    for bin in base new; do
      echo "replicas: round $round/$ROUNDS, $bin" >&2
      SECS=$SECS ROWS="randwrite-4k-qd1 randwrite-4k-qd32" FERRITE_BIN="$DIR/$bin" bench/sync_replicas.sh 2>/dev/null |
        awk -v bin=$bin '$1 ~ /^randwrite-4k-qd/ && NF == 10 {print "sync", $1 "/" $2 "copies", bin, $3, $9, $8, $5, $10}' >> "$OUT"
    done
  done
fi
python3 - "$OUT" <<'EOF'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    rows.setdefault((f[0], f[1]), {}).setdefault(f[2], []).append([float(x) for x in f[3:]])
med = lambda runs, i: statistics.median(r[i] for r in runs)
print(f"{'row':<32}{'base':>10}{'new':>10}{'new/base':>10}   other medians (base -> new)")
for (kind, name), by in rows.items():
    if 'base' not in by or 'new' not in by:
        continue
    b, n = by['base'], by['new']
    if kind == 'local':
        other = f"CPU s/GiB {med(b, 1):.2f} -> {med(n, 1):.2f}"
    else:
        other = (f"CPU µs/write {med(b, 1):.1f} -> {med(n, 1):.1f}, p50 µs {med(b, 3):.0f} -> {med(n, 3):.0f}, "
                 f"ctx/write {med(b, 4):.1f} -> {med(n, 4):.1f}, vs 1 copy {med(b, 2):.2f} -> {med(n, 2):.2f}")
    print(f"{kind + ' ' + name:<32}{med(b, 0):>10.0f}{med(n, 0):>10.0f}{med(n, 0) / med(b, 0):>10.2f}   {other}")
EOF
