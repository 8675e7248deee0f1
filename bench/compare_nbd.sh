#!/usr/bin/env bash
# Ferrite's NBD server vs. nbdkit's file plugin and qemu-nbd serving a raw file on the same
# filesystem, in one run, over Unix sockets, with the same fio (nbd engine) workloads: 4 KiB
# random read / write / 70-30 mix at QD1 and QD32 with 1 and 4 connections, and 128 KiB
# sequential read and write. Prints medians of IOPS, Ferrite/peer ratios (F/best, and F/qemu
# against the peer that bypasses the page cache), server CPU seconds per GiB moved, and F WA:
# Ferrite's media bytes written per client byte during the row (above 1: its cleaner's share).
#
# Peers are configured to bypass the page cache as far as they can (qemu-nbd --cache=none is
# O_DIRECT; nbdkit's file plugin (1.32, Debian 12) has no O_DIRECT: its cache=none writes through
# the page cache and drops the pages after, so its sequential rows include write-behind and the
# kernel's readahead).
#   ROUNDS=3 SECS=5 SIZE=1G BENCH_DIR=/work/bench-nbd bench/compare_nbd.sh
# ONLY=regex runs only the workloads whose name (e.g. randrw-4k-qd1-c1) matches.
#
# MODE=device serves block devices, as production does: each server gets a loop device of its
# own (direct I/O to a pre-written backing file), Ferrite's formatted with `ferrite pool format`
# (twice SIZE, so the cleaner has room), the peers' of SIZE; all three open them O_DIRECT. It adds
# 128 KiB and 1 MiB sequential rows at QD16 and 1 MiB at QD1. Needs root (losetup). Once the rows
# have written more than twice SIZE, Ferrite's write rows include its cleaner's work (the peers
# overwrite in place; F WA shows how much): what idle cleaning (while the peers run their rows)
# did not compact ahead. ONLY='write-' shows the write path alone.
#
# After the rounds, Ferrite's volume (scattered by the random-write rows) is defragmented
# (`ferrite volume defrag`) and the 128 KiB QD1 read row runs once more on all three
# ("read-128k-qd1-c1-defrag"; the peers' files were never scattered).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
SECS=${SECS:-5}
SIZE=${SIZE:-1G}
DIR=${BENCH_DIR:-$PWD/bench-nbd}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/ferrite/target}"
for t in fio nbdkit qemu-nbd; do
  command -v "$t" >/dev/null || { echo "SKIPPED: $t is not installed (scripts/setup.sh installs it)"; exit 0; }
done
fio --enghelp 2>/dev/null | grep -qw nbd || { echo "SKIPPED: this fio has no nbd engine"; exit 0; }
# FERRITE_BIN=path runs that binary instead of building (A/B runs of two builds).
if [ -z "${FERRITE_BIN:-}" ]; then cargo build --workspace --locked --bin ferrite >&2; fi
FERRITE="${FERRITE_BIN:-$CARGO_TARGET_DIR/debug/ferrite}"

MODE=${MODE:-file}
rm -rf "$DIR"; mkdir -p "$DIR"
PIDS=()
LOOPS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for l in "${LOOPS[@]}"; do losetup -d "$l" 2>/dev/null || true; done
  rm -rf "$DIR"
}
trap cleanup EXIT
BYTES=$(numfmt --from=iec "$SIZE")
if [ "$MODE" = device ]; then
  echo "preparing three loop devices over pre-written files..." >&2
  loop() { # file bytes -> a loop device with direct I/O over the file, written once in full
    fio --name=prefill --filename="$1" --size="$2" --rw=write --bs=1M --direct=1 --output=/dev/null
    losetup --find --show --direct-io=on "$1"
  }
  FDEV=$(loop "$DIR/ferrite.img" $(( BYTES * 2 ))); LOOPS+=("$FDEV")
  KDEV=$(loop "$DIR/nbdkit.img" "$BYTES"); LOOPS+=("$KDEV")
  QDEV=$(loop "$DIR/qemu.img" "$BYTES"); LOOPS+=("$QDEV")
  printf 'pool-path = "%s"\n' "$FDEV" > "$DIR/ferrite.toml"
  # The prefill left zeros: nothing to refuse.
  "$FERRITE" pool format --config "$DIR/ferrite.toml" --data-dir "$DIR/ferrite" >&2
  KTARGET=$KDEV; QTARGET=$QDEV
else
  echo "preparing a $SIZE raw file and the Ferrite volume..." >&2
  fio --name=prefill --filename="$DIR/raw.img" --size="$SIZE" --rw=write --bs=1M --direct=1 --output=/dev/null
  printf 'pool-size = "%s"\n' "$(( BYTES * 8 ))" > "$DIR/ferrite.toml"
  # Written once in full, as the peers' raw file is: no unwritten-extent conversion on first write.
  "$FERRITE" pool format --preallocate --config "$DIR/ferrite.toml" --data-dir "$DIR/ferrite" >&2
  KTARGET=$DIR/raw.img; QTARGET=$DIR/raw.img
fi
"$FERRITE" daemon --config "$DIR/ferrite.toml" --data-dir "$DIR/ferrite" >"$DIR/ferrite.log" 2>&1 &
PIDS+=($!); FPID=$!
export FERRITE_ADMIN_SOCKET="$DIR/ferrite/admin.sock"
for _ in $(seq 600); do "$FERRITE" pool status >/dev/null 2>&1 && break; sleep 0.1; done
"$FERRITE" volume create v "$SIZE" >/dev/null
"$FERRITE" export nbd v >/dev/null
nbdkit --unix "$DIR/nbdkit.sock" -f --threads 16 file "$KTARGET" cache=none >"$DIR/nbdkit.log" 2>&1 &
PIDS+=($!); KPID=$!
qemu-nbd -f raw --cache=none --aio=io_uring --shared=8 --persistent -k "$DIR/qemu.sock" "$QTARGET" >"$DIR/qemu.log" 2>&1 &
PIDS+=($!); QPID=$!
sleep 1
# Fill Ferrite's volume so reads hit data, as they do on the raw file.
fio --name=fill --ioengine=nbd --uri="nbd+unix:///v?socket=$DIR/ferrite/nbd.sock" --size="$SIZE" --rw=write \
    --bs=1M --iodepth=4 --output=/dev/null

cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
PARSE='
import json, sys
server, name, c0, c1 = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
text = sys.stdin.read()
j = json.loads(text[text.index("{"):])["jobs"][0]  # fio may print notes before the JSON
iops = j["read"]["iops"] + j["write"]["iops"]
gib = (j["read"]["io_bytes"] + j["write"]["io_bytes"]) / 2**30
# Ferrite: media bytes written per client byte during the row (what the cleaner added), from pool
# status before and after.
wa = "-"
if len(sys.argv) > 6:
    p0, p1 = (json.loads(a) for a in sys.argv[5:7])
    client = p1["client_bytes_written"] - p0["client_bytes_written"]
    if client:
        wa = "%.2f" % ((p1["media_bytes_written"] - p0["media_bytes_written"]) / client)
print(name, server, iops, (c1 - c0) / 100 / gib if gib else 0, wa)
'
declare -A URI=([ferrite]="nbd+unix:///v?socket=$DIR/ferrite/nbd.sock" [nbdkit]="nbd+unix:///?socket=$DIR/nbdkit.sock" \
  [qemu-nbd]="nbd+unix:///?socket=$DIR/qemu.sock")
declare -A PID=([ferrite]=$FPID [nbdkit]=$KPID [qemu-nbd]=$QPID)
results=$(mktemp)
WORKLOADS="randread 4k 1 1
randread 4k 32 1
randread 4k 32 4
randwrite 4k 1 1
randwrite 4k 32 1
randwrite 4k 32 4
randrw 4k 1 1
randrw 4k 32 1
randrw 4k 32 4
read 128k 1 1
write 128k 1 1"
[ "$MODE" = device ] && WORKLOADS+="
read 128k 16 1
write 128k 16 1
read 1m 1 1
write 1m 1 1
read 1m 16 1
write 1m 16 1"
row() { # rw bs qd conns name-suffix: one row on the three servers, appended to $results
  local rw=$1 bs=$2 qd=$3 conns=$4 round=$5 suffix=${6:-}
  servers=(ferrite nbdkit qemu-nbd)
  for i in 0 1 2; do
    server=${servers[$(( (i + round) % 3 ))]}
    name="$rw-$bs-qd$qd-c$conns$suffix"
    [[ "$name" =~ ${ONLY:-.} ]] || continue
    echo "round $round/$ROUNDS: $name on $server" >&2
    c0=$(cpu "${PID[$server]}")
    stats=()
    [ "$server" = ferrite ] && stats+=("$("$FERRITE" pool status -o json)")
    json=$(fio --name="$name" --ioengine=nbd --uri="${URI[$server]}" --size="$SIZE" --rw="$rw" --rwmixread=70 \
      --bs="$bs" --iodepth=$(( qd / conns > 0 ? qd / conns : 1 )) --numjobs="$conns" --group_reporting \
      --runtime="$SECS" --time_based --randrepeat=0 --output-format=json)
    c1=$(cpu "${PID[$server]}")
    [ "$server" = ferrite ] && stats+=("$("$FERRITE" pool status -o json)")
    python3 -c "$PARSE" "$server" "$name" "$c0" "$c1" "${stats[@]}" <<<"$json" >>"$results"
  done
}
for round in $(seq 1 "$ROUNDS"); do
  while read -r rw bs qd conns; do
    # Each round starts with a different server, so a machine that speeds up or slows down
    # during a row does not always favour the same one.
    row "$rw" "$bs" "$qd" "$conns" "$round"
  done <<<"$WORKLOADS"
done
echo "defragmenting Ferrite's volume..." >&2
"$FERRITE" volume defrag v >&2
for round in $(seq 1 "$ROUNDS"); do row read 128k 1 1 "$round" -defrag; done
python3 - "$results" <<'PY'
import sys, statistics
rows, order = {}, []
for line in open(sys.argv[1]):
    name, server, iops, cpu, wa = line.split()
    if name not in order:
        order.append(name)
    rows.setdefault((name, server), []).append((float(iops), float(cpu), float("nan" if wa == "-" else wa)))
med = lambda k, i: statistics.median(v[i] for v in rows[k])
print(f"{'workload':<22}{'ferrite':>9}{'nbdkit':>9}{'qemu-nbd':>10}{'F/best':>8}{'F/qemu':>8}"
      "   CPU s/GiB: ferrite nbdkit qemu-nbd   F WA")
for n in order:
    f, k, q = (med((n, s), 0) for s in ("ferrite", "nbdkit", "qemu-nbd"))
    cf, ck, cq = (med((n, s), 1) for s in ("ferrite", "nbdkit", "qemu-nbd"))
    wa = med((n, "ferrite"), 2)
    was = "" if wa != wa else f"{wa:>7.2f}"  # NaN: no writes in the row
    print(f"{n:<22}{f:>9.0f}{k:>9.0f}{q:>10.0f}{f / max(k, q):>7.2f}x{f / q:>7.2f}x"
          f"   {cf:>8.2f} {ck:>6.2f} {cq:>8.2f} {was}")
PY
rm -f "$results"
