#!/usr/bin/env bash
# Ferrite's ublk device vs. rublk's loop target and the kernel loop device, each over a file of
# the same size on the same filesystem, in one run: fio (libaio, direct) 4 KiB random read and
# write at QD1 and QD32, 128 KiB sequential read and write, ROUNDS rounds alternating the three;
# prints median IOPS and the Ferrite/peer ratios.
#
# Needs a kernel with ublk_drv (/dev/ublk-control) and root; anywhere else it prints SKIPPED.
# (This machine kind has no ublk driver, and the QEMU guest of tests/vm is emulated: no numbers.)
#
#   ROUNDS=3 SECS=5 SIZE=1G BENCH_DIR=/work/bench bench/compare_ublk.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
SECS=${SECS:-5}
SIZE=${SIZE:-1G}
DIR=${BENCH_DIR:-$PWD/bench-data}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/ferrite/target}"

[ -e /dev/ublk-control ] || { echo "SKIPPED: no /dev/ublk-control (this kernel has no ublk driver loaded)"; exit 0; }
[ "$(id -u)" = 0 ] || { echo "SKIPPED: needs root to add block devices"; exit 0; }
command -v fio >/dev/null || { echo "SKIPPED: fio is not installed"; exit 0; }
command -v rublk >/dev/null || { echo "installing rublk (cargo install)..." >&2; cargo install --locked rublk >&2; }

echo "building ferrite..." >&2
cargo build --locked --workspace --bin ferrite
FERRITE="$CARGO_TARGET_DIR/debug/ferrite"
mkdir -p "$DIR/ferrite"
BYTES=$(python3 -c "import sys; u={'K':10,'M':20,'G':30}; s=sys.argv[1]; print(int(s[:-1])<<u[s[-1]] if s[-1] in u else int(s))" "$SIZE")
fio --name=prefill --filename="$DIR/loop.img" --size="$SIZE" --rw=write --bs=1M --ioengine=libaio \
    --direct=1 --iodepth=8 --output=/dev/null
cp --sparse=never "$DIR/loop.img" "$DIR/rublk.img"

export FERRITE_ADMIN_SOCKET="$DIR/ferrite/admin.sock"
printf 'pool-size = "%s"\nlog-level = "warn"\n' "$((BYTES * 3))" > "$DIR/ferrite/ferrite.toml"
"$FERRITE" daemon --config "$DIR/ferrite/ferrite.toml" --data-dir "$DIR/ferrite" &
DAEMON=$!
LOOP=""; RUBLK_ID=""
cleanup() {
  [ -n "$LOOP" ] && losetup -d "$LOOP" || true
  [ -n "$RUBLK_ID" ] && rublk del -n "$RUBLK_ID" || true
  "$FERRITE" detach bench >/dev/null 2>&1 || true
  kill -TERM "$DAEMON" 2>/dev/null; wait "$DAEMON" 2>/dev/null || true
  rm -rf "$DIR/loop.img" "$DIR/rublk.img" "$DIR/ferrite"
}
trap cleanup EXIT
for _ in $(seq 100); do "$FERRITE" pool status >/dev/null 2>&1 && break; sleep 0.1; done
"$FERRITE" volume create bench "$SIZE" >/dev/null
FDEV=$("$FERRITE" attach --transport ublk bench)
fio --name=prefill --filename="$FDEV" --rw=write --bs=1M --ioengine=libaio --direct=1 --iodepth=8 --output=/dev/null
LOOP=$(losetup -f --show --direct-io=on "$DIR/loop.img")
RUBLK_ID=$(rublk add loop -f "$DIR/rublk.img" | sed -n 's/.*dev id \([0-9]*\).*/\1/p' | head -1)
[ -n "$RUBLK_ID" ] || RUBLK_ID=$(ls /sys/class/ublk-char | sed 's/ublkc//' | sort -n | tail -1)
RDEV=/dev/ublkb$RUBLK_ID

WORKLOADS="randread-4k-qd1 randread 4k 1
randread-4k-qd32 randread 4k 32
randwrite-4k-qd1 randwrite 4k 1
randwrite-4k-qd32 randwrite 4k 32
read-128k read 128k 4
write-128k write 128k 4"
results=$(mktemp)
for round in $(seq 1 "$ROUNDS"); do
  while read -r name rw bs qd; do
    for who in ferrite rublk loop; do
      case $who in ferrite) dev=$FDEV;; rublk) dev=$RDEV;; loop) dev=$LOOP;; esac
      iops=$(fio --name=b --filename="$dev" --rw="$rw" --bs="$bs" --iodepth="$qd" --ioengine=libaio \
        --direct=1 --time_based --runtime="$SECS" --output-format=json | python3 -c \
        "import json,sys; j=json.load(sys.stdin)['jobs'][0]; print(int(j['read']['iops']+j['write']['iops']))")
      echo "$name $who $iops" >> "$results"
    done
  done <<< "$WORKLOADS"
  echo "round $round/$ROUNDS done" >&2
done
python3 - "$results" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    name, who, iops = line.split()
    rows.setdefault(name, {}).setdefault(who, []).append(int(iops))
print(f"{'workload':18} {'ferrite':>9} {'rublk-loop':>10} {'loop':>9} {'F/rublk':>8} {'F/loop':>7}")
for name, r in rows.items():
    m = {k: statistics.median(v) for k, v in r.items()}
    print(f"{name:18} {m['ferrite']:9.0f} {m['rublk']:10.0f} {m['loop']:9.0f} "
          f"{m['ferrite'] / m['rublk']:8.2f} {m['ferrite'] / m['loop']:7.2f}")
PY
