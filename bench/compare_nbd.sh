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
# MODE=memory takes the store out of the way, to show what a request costs each server: Ferrite's
# pool file and metadata on tmpfs (BENCH_DIR defaults to /dev/shm), against nbdkit's memory plugin
# (a server that does no storage work: the ceiling for an NBD server on this machine) and qemu-nbd
# on a raw file on the same tmpfs. Its rows are the 4 KiB ones and 128 KiB at QD1; it also prints,
# per row, the median latency (p50, p99, p99.9 in microseconds, fio's completion latency) and
# the server's CPU microseconds per request.
#
# Both regimes: the QD1 rows run again under a fixed background load ("-busy": one spinning
# process per CPU at nice 19), since a server that waits the costly way is slow on an idle
# machine and fast on a busy one (a vCPU that never halts wakes at no cost). BUSY=0 leaves them
# out. The load's own CPU is not the servers'.
#
# After the rounds (except in MODE=memory), Ferrite's volume (scattered by the random-write
# rows) is defragmented (`ferrite volume defrag`) and the 128 KiB QD1 read row runs once more on
# every server ("read-128k-qd1-c1-defrag"; the peers' files were never scattered).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
SECS=${SECS:-5}
SIZE=${SIZE:-1G}
MODE=${MODE:-file}
if [ "$MODE" = memory ]; then DIR=${BENCH_DIR:-/dev/shm/ferrite-bench-nbd}; else DIR=${BENCH_DIR:-$PWD/bench-nbd}; fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/ferrite/target}"
for t in fio nbdkit qemu-nbd; do
  command -v "$t" >/dev/null || { echo "SKIPPED: $t is not installed (scripts/setup.sh installs it)"; exit 0; }
done
fio --enghelp 2>/dev/null | grep -qw nbd || { echo "SKIPPED: this fio has no nbd engine"; exit 0; }
# FERRITE_BIN=path runs that binary instead of building (A/B runs of two builds).
if [ -z "${FERRITE_BIN:-}" ]; then cargo build --workspace --locked --bin ferrite >&2; fi
FERRITE="${FERRITE_BIN:-$CARGO_TARGET_DIR/debug/ferrite}"

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
SERVERS=(ferrite nbdkit qemu-nbd)
declare -A BIN=([ferrite]=$FERRITE)
# FERRITE_BEFORE=path adds that build as a fourth server, "ferrite-before", on a pool of its own
# made the same way: the before and after of a change in one run.
if [ -n "${FERRITE_BEFORE:-}" ]; then SERVERS+=(ferrite-before); BIN[ferrite-before]=$FERRITE_BEFORE; fi
loop() { # file bytes -> a loop device with direct I/O over the file, written once in full
  fio --name=prefill --filename="$1" --size="$2" --rw=write --bs=1M --direct=1 --output=/dev/null
  losetup --find --show --direct-io=on "$1"
}
if [ "$MODE" = device ]; then
  echo "preparing loop devices over pre-written files..." >&2
  KDEV=$(loop "$DIR/nbdkit.img" "$BYTES"); LOOPS+=("$KDEV")
  QDEV=$(loop "$DIR/qemu.img" "$BYTES"); LOOPS+=("$QDEV")
  KTARGET=$KDEV; QTARGET=$QDEV
elif [ "$MODE" = memory ]; then
  echo "preparing a $SIZE raw file on tmpfs..." >&2
  [ "$(stat -f -c %T "$DIR")" = tmpfs ] || { echo "MODE=memory needs BENCH_DIR on tmpfs" >&2; exit 1; }
  fio --name=prefill --filename="$DIR/raw.img" --size="$SIZE" --rw=write --bs=1M --output=/dev/null
  QTARGET=$DIR/raw.img
else
  echo "preparing a $SIZE raw file..." >&2
  fio --name=prefill --filename="$DIR/raw.img" --size="$SIZE" --rw=write --bs=1M --direct=1 --output=/dev/null
  KTARGET=$DIR/raw.img; QTARGET=$DIR/raw.img
fi
declare -A PID URI
start_ferrite() { # server: its pool (as MODE says), daemon, and a volume v of SIZE, exported
  local name=$1 bin=${BIN[$1]} d=$DIR/$1
  mkdir -p -m 700 "$d"
  if [ "$MODE" = device ]; then
    local dev; dev=$(loop "$DIR/$name.img" $(( BYTES * 2 ))); LOOPS+=("$dev")
    printf 'pool-path = "%s"\n' "$dev" > "$d.toml"
    # The prefill left zeros: nothing to refuse.
    "$bin" pool format --config "$d.toml" --data-dir "$d" >&2
  else
    # Written once in full, as the peers' raw file is: no unwritten-extent conversion on first write.
    local times=8; [ "$MODE" = memory ] && times=4
    printf 'pool-size = "%s"\n' "$(( BYTES * times ))" > "$d.toml"
    "$bin" pool format --preallocate --config "$d.toml" --data-dir "$d" >&2
  fi
  "$bin" daemon --config "$d.toml" --data-dir "$d" >"$d.log" 2>&1 &
  PIDS+=($!); PID[$name]=$!
  for _ in $(seq 600); do FERRITE_ADMIN_SOCKET="$d/admin.sock" "$bin" pool status >/dev/null 2>&1 && break; sleep 0.1; done
  FERRITE_ADMIN_SOCKET="$d/admin.sock" "$bin" volume create v "$SIZE" >/dev/null
  FERRITE_ADMIN_SOCKET="$d/admin.sock" "$bin" export nbd v >/dev/null
  URI[$name]="nbd+unix:///v?socket=$d/nbd.sock"
}
ferrite_status() { FERRITE_ADMIN_SOCKET="$DIR/$1/admin.sock" "${BIN[$1]}" pool status -o json; }
for s in "${SERVERS[@]}"; do if [[ $s == ferrite* ]]; then start_ferrite "$s"; fi; done
if [ "$MODE" = memory ]; then
  nbdkit --unix "$DIR/nbdkit.sock" -f --threads 16 memory "$SIZE" >"$DIR/nbdkit.log" 2>&1 &
else
  nbdkit --unix "$DIR/nbdkit.sock" -f --threads 16 file "$KTARGET" cache=none >"$DIR/nbdkit.log" 2>&1 &
fi
PIDS+=($!); PID[nbdkit]=$!; URI[nbdkit]="nbd+unix:///?socket=$DIR/nbdkit.sock"
# tmpfs has no page cache to bypass: qemu-nbd reads and writes its pages directly either way.
QCACHE=none; [ "$MODE" = memory ] && QCACHE=writeback
qemu-nbd -f raw --cache=$QCACHE --aio=io_uring --shared=8 --persistent -k "$DIR/qemu.sock" "$QTARGET" >"$DIR/qemu.log" 2>&1 &
PIDS+=($!); PID[qemu-nbd]=$!; URI[qemu-nbd]="nbd+unix:///?socket=$DIR/qemu.sock"
sleep 1
# Fill Ferrite's volumes (and nbdkit's memory) so reads hit data, as they do on the raw file.
fill() { fio --name=fill --ioengine=nbd --uri="$1" --size="$SIZE" --rw=write --bs=1M --iodepth=4 --output=/dev/null; }
for s in "${SERVERS[@]}"; do
  if [[ $s == ferrite* ]] || { [ "$MODE" = memory ] && [ "$s" = nbdkit ]; }; then fill "${URI[$s]}"; fi
done

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
ios = j["read"]["total_ios"] + j["write"]["total_ios"]
# Completion latency of the direction that did most of the requests, in microseconds.
d = j["read"] if j["read"]["total_ios"] >= j["write"]["total_ios"] else j["write"]
pct = d["clat_ns"].get("percentile", {})
lat = [pct.get(k, 0) / 1000 for k in ("50.000000", "99.000000", "99.900000")]
cpu_us = (c1 - c0) / 100 * 1e6 / ios if ios else 0
print(name, server, iops, (c1 - c0) / 100 / gib if gib else 0, wa, *lat, cpu_us)
'
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
[ "$MODE" = memory ] && WORKLOADS=$(grep -v '^randrw' <<<"$WORKLOADS")
[ "$MODE" = device ] && WORKLOADS+="
read 128k 16 1
write 128k 16 1
read 1m 1 1
write 1m 1 1
read 1m 16 1
write 1m 16 1"
row() { # rw bs qd conns name-suffix: one row on every server, appended to $results
  local rw=$1 bs=$2 qd=$3 conns=$4 round=$5 suffix=${6:-}
  local n=${#SERVERS[@]}
  for i in $(seq 0 $(( n - 1 ))); do
    server=${SERVERS[$(( (i + round) % n ))]}
    name="$rw-$bs-qd$qd-c$conns$suffix"
    [[ "$name" =~ ${ONLY:-.} ]] || continue
    echo "round $round/$ROUNDS: $name on $server" >&2
    c0=$(cpu "${PID[$server]}")
    stats=()
    [[ $server == ferrite* ]] && stats+=("$(ferrite_status "$server")")
    json=$(fio --name="$name" --percentile_list=50:99:99.9 --ioengine=nbd --uri="${URI[$server]}" --size="$SIZE" --rw="$rw" --rwmixread=70 \
      --bs="$bs" --iodepth=$(( qd / conns > 0 ? qd / conns : 1 )) --numjobs="$conns" --group_reporting \
      --runtime="$SECS" --time_based --randrepeat=0 --output-format=json)
    c1=$(cpu "${PID[$server]}")
    [[ $server == ferrite* ]] && stats+=("$(ferrite_status "$server")")
    python3 -c "$PARSE" "$server" "$name" "$c0" "$c1" "${stats[@]}" <<<"$json" >>"$results"
  done
}
SPIN=()
spin() { for _ in $(seq "$(nproc)"); do nice -n 19 sh -c 'while :; do :; done' & SPIN+=($!); done; }
unspin() { for p in "${SPIN[@]}"; do kill "$p" 2>/dev/null || true; done; SPIN=(); }
trap 'unspin; cleanup' EXIT
for round in $(seq 1 "$ROUNDS"); do
  while read -r rw bs qd conns; do
    # Each round starts with a different server, so a machine that speeds up or slows down
    # during a row does not always favour the same one.
    row "$rw" "$bs" "$qd" "$conns" "$round"
  done <<<"$WORKLOADS"
  if [ "${BUSY:-1}" = 1 ]; then
    spin
    while read -r rw bs qd conns; do
      [ "$qd" = 1 ] && row "$rw" "$bs" "$qd" "$conns" "$round" -busy
    done <<<"$WORKLOADS"
    unspin
  fi
done
if [ "$MODE" != memory ]; then
  echo "defragmenting Ferrite's volume..." >&2
  for s in "${SERVERS[@]}"; do
    # A pool the rows filled may have no room left for the moves: the row then runs as it is.
    if [[ $s == ferrite* ]]; then
      FERRITE_ADMIN_SOCKET="$DIR/$s/admin.sock" "${BIN[$s]}" volume defrag v >&2 || echo "$s: defrag failed" >&2
    fi
  done
  for round in $(seq 1 "$ROUNDS"); do row read 128k 1 1 "$round" -defrag; done
fi
python3 - "$results" "$MODE" <<'PY'
import sys, statistics
rows, order = {}, []
for line in open(sys.argv[1]):
    name, server, iops, cpu, wa, p50, p99, p999, cpu_us = line.split()
    if name not in order:
        order.append(name)
    rows.setdefault((name, server), []).append(
        (float(iops), float(cpu), float("nan" if wa == "-" else wa), float(p50), float(p99), float(p999), float(cpu_us)))
med = lambda k, i: statistics.median(v[i] for v in rows[k])
before = any(k[1] == "ferrite-before" for k in rows)
servers = ("ferrite", "nbdkit", "qemu-nbd") + (("ferrite-before",) if before else ())
head = "".join(f"{s:>15}" for s in servers)
print(f"{'workload':<22}{head}{'F/best':>8}{'F/qemu':>8}{'F/before':>10}   CPU s/GiB:" + "".join(f"{s:>15}" for s in servers) + "   F WA")
for n in order:
    i = {s: med((n, s), 0) for s in servers}
    c = {s: med((n, s), 1) for s in servers}
    f, best = i["ferrite"], max(i["nbdkit"], i["qemu-nbd"])
    ratio = f"{f / i['ferrite-before']:>9.2f}x" if before else f"{'':>10}"
    wa = med((n, "ferrite"), 2)
    was = "" if wa != wa else f"{wa:>7.2f}"  # NaN: no writes in the row
    print(f"{n:<22}" + "".join(f"{i[s]:>15.0f}" for s in servers) + f"{f / best:>7.2f}x{f / i['qemu-nbd']:>7.2f}x{ratio}"
          + "            " + "".join(f"{c[s]:>15.2f}" for s in servers) + f" {was}")
if sys.argv[2] == "memory":
    print("\nlatency, microseconds (p50 / p99 / p99.9), and server CPU microseconds per request")
    print(f"{'workload':<22}" + "".join(f"{s:>24}" for s in servers) + "".join(f"{'CPU ' + s:>20}" for s in servers))
    for n in order:
        lat = "".join(f"{med((n, s), 3):>9.1f}/{med((n, s), 4):>6.1f}/{med((n, s), 5):>7.1f}" for s in servers)
        print(f"{n:<22}{lat}" + "".join(f"{med((n, s), 6):>20.2f}" for s in servers))
PY
rm -f "$results"
