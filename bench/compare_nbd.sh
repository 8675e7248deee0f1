#!/usr/bin/env bash
# Ferrite's NBD server vs. nbdkit's file plugin and qemu-nbd serving a raw file on the same
# filesystem, in one run, over Unix sockets, with the same fio (nbd engine) workloads: 4 KiB
# random read / write / 70-30 mix at QD1 and QD32 with 1 and 4 connections, and 128 KiB
# sequential read and write. Prints medians of IOPS, Ferrite/peer ratios, and server CPU seconds
# per GiB moved.
#
# Peers are configured to bypass the page cache as Ferrite does (qemu-nbd --cache=none,
# nbdkit file cache=none), so all three measure the same disk.
#   ROUNDS=3 SECS=5 SIZE=1G BENCH_DIR=/work/bench-nbd bench/compare_nbd.sh
# ONLY=regex runs only the workloads whose name (e.g. randrw-4k-qd1-c1) matches.
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
if [ -z "${FERRITE_BIN:-}" ]; then cargo build --locked -p ferrite >&2; fi
FERRITE="${FERRITE_BIN:-$CARGO_TARGET_DIR/debug/ferrite}"

rm -rf "$DIR"; mkdir -p "$DIR"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT
echo "preparing a $SIZE raw file and the Ferrite volume..." >&2
fio --name=prefill --filename="$DIR/raw.img" --size="$SIZE" --rw=write --bs=1M --direct=1 --output=/dev/null
# Ferrite's pool is a fresh sparse file (there is no way yet to format a pre-written file), so
# its writes also pay ext4's unwritten-extent conversion; the raw file of the peers is written.
printf 'pool-size = "%s"\n' "$(( $(numfmt --from=iec "$SIZE") * 8 ))" > "$DIR/ferrite.toml"
"$FERRITE" daemon --config "$DIR/ferrite.toml" --data-dir "$DIR/ferrite" >"$DIR/ferrite.log" 2>&1 &
PIDS+=($!); FPID=$!
export FERRITE_ADMIN_SOCKET="$DIR/ferrite/admin.sock"
for _ in $(seq 600); do "$FERRITE" pool status >/dev/null 2>&1 && break; sleep 0.1; done
"$FERRITE" volume create v "$SIZE" >/dev/null
"$FERRITE" export nbd v >/dev/null
nbdkit --unix "$DIR/nbdkit.sock" -f --threads 16 file "$DIR/raw.img" cache=none >"$DIR/nbdkit.log" 2>&1 &
PIDS+=($!); KPID=$!
qemu-nbd -f raw --cache=none --aio=io_uring --shared=8 --persistent -k "$DIR/qemu.sock" "$DIR/raw.img" >"$DIR/qemu.log" 2>&1 &
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
print(name, server, iops, (c1 - c0) / 100 / gib if gib else 0)
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
for round in $(seq 1 "$ROUNDS"); do
  while read -r rw bs qd conns; do
    # Each round starts with a different server, so a machine that speeds up or slows down
    # during a row does not always favour the same one.
    servers=(ferrite nbdkit qemu-nbd)
    for i in 0 1 2; do
      server=${servers[$(( (i + round) % 3 ))]}
      name="$rw-$bs-qd$qd-c$conns"
      [[ "$name" =~ ${ONLY:-.} ]] || continue
      echo "round $round/$ROUNDS: $name on $server" >&2
      c0=$(cpu "${PID[$server]}")
      json=$(fio --name="$name" --ioengine=nbd --uri="${URI[$server]}" --size="$SIZE" --rw="$rw" --rwmixread=70 \
        --bs="$bs" --iodepth=$(( qd / conns > 0 ? qd / conns : 1 )) --numjobs="$conns" --group_reporting \
        --runtime="$SECS" --time_based --randrepeat=0 --output-format=json)
      c1=$(cpu "${PID[$server]}")
      python3 -c "$PARSE" "$server" "$name" "$c0" "$c1" <<<"$json" >>"$results"
    done
  done <<<"$WORKLOADS"
done
python3 - "$results" <<'PY'
import sys, statistics
rows, order = {}, []
for line in open(sys.argv[1]):
    name, server, iops, cpu = line.split()
    if name not in order:
        order.append(name)
    rows.setdefault((name, server), []).append((float(iops), float(cpu)))
med = lambda k, i: statistics.median(v[i] for v in rows[k])
print(f"{'workload':<22}{'ferrite':>9}{'nbdkit':>9}{'qemu-nbd':>10}{'F/best':>8}   CPU s/GiB: ferrite nbdkit qemu-nbd")
for n in order:
    f, k, q = (med((n, s), 0) for s in ("ferrite", "nbdkit", "qemu-nbd"))
    cf, ck, cq = (med((n, s), 1) for s in ("ferrite", "nbdkit", "qemu-nbd"))
    print(f"{n:<22}{f:>9.0f}{k:>9.0f}{q:>10.0f}{f / max(k, q):>7.2f}x   {cf:>8.2f} {ck:>6.2f} {cq:>8.2f}")
PY
rm -f "$results"
