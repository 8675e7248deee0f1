#!/usr/bin/env bash
# Where a QD1 request's time goes while the server waits: Ferrite's NBD server (pool on tmpfs)
# against nbdkit's memory plugin, one fio job at queue depth 1 (4 KiB random writes, then reads)
# over a Unix socket, on the machine as it is (idle, or under BUSY=1: one spinning process per
# CPU at nice 19). Per server and row: IOPS, the server's CPU microseconds and context switches
# (voluntary, involuntary) per request, and which of its threads burnt the CPU (the connection's
# loop, its sender, io_uring's io-wq workers, ...), from /proc before and after. With perf
# installed (PERF=1, the default where it is), the hottest kernel and user symbols of the
# Ferrite server's run too.
#   SECS=10 bench/idle_probe.sh          FERRITE_BIN=path runs that build
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${SECS:-10}
WINDOW=$(( SECS - 2 ))
SIZE=${SIZE:-256M}
DIR=${BENCH_DIR:-/dev/shm/ferrite-idle-probe}
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/ferrite/target}"
for t in fio nbdkit; do
  command -v "$t" >/dev/null || { echo "SKIPPED: $t is not installed (scripts/setup.sh installs it)"; exit 0; }
done
if [ -z "${FERRITE_BIN:-}" ]; then cargo build --workspace --locked --bin ferrite >&2; fi
FERRITE="${FERRITE_BIN:-$CARGO_TARGET_DIR/debug/ferrite}"
PERF=${PERF:-$(command -v perf >/dev/null && echo 1 || echo 0)}

rm -rf "$DIR"; mkdir -p -m 700 "$DIR" "$DIR/f"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$DIR"
}
trap cleanup EXIT
if [ "${BUSY:-0}" = 1 ]; then
  for _ in $(seq "$(nproc)"); do nice -n 19 sh -c 'while :; do :; done' & PIDS+=($!); done
fi

printf 'pool-size = "%s"\n' "$(( $(numfmt --from=iec "$SIZE") * 4 ))" > "$DIR/f.toml"
"$FERRITE" pool format --preallocate --config "$DIR/f.toml" --data-dir "$DIR/f" >&2
"$FERRITE" daemon --config "$DIR/f.toml" --data-dir "$DIR/f" >"$DIR/f.log" 2>&1 &
FPID=$!; PIDS+=($FPID)
export FERRITE_ADMIN_SOCKET="$DIR/f/admin.sock"
for _ in $(seq 600); do "$FERRITE" pool status >/dev/null 2>&1 && break; sleep 0.1; done
"$FERRITE" volume create v "$SIZE" >/dev/null
"$FERRITE" export nbd v >/dev/null
nbdkit --unix "$DIR/nbdkit.sock" -f --threads 16 memory "$SIZE" >"$DIR/nbdkit.log" 2>&1 &
KPID=$!; PIDS+=($KPID)
sleep 1
declare -A URI=([ferrite]="nbd+unix:///v?socket=$DIR/f/nbd.sock" [nbdkit]="nbd+unix:///?socket=$DIR/nbdkit.sock")
declare -A PID=([ferrite]=$FPID [nbdkit]=$KPID)
for s in ferrite nbdkit; do
  fio --name=fill --ioengine=nbd --uri="${URI[$s]}" --size="$SIZE" --rw=write --bs=1M --iodepth=4 --output=/dev/null
done

# Per thread of a process: "tid name ticks voluntary involuntary" (utime+stime in clock ticks).
threads() {
  for t in /proc/"$1"/task/*; do
    local name ticks vol inv
    name=$(tr ' ' '_' <"$t/comm")
    ticks=$(awk '{print $14 + $15}' "$t/stat")
    vol=$(awk '/^voluntary_ctxt_switches/ {print $2}' "$t/status")
    inv=$(awk '/^nonvoluntary_ctxt_switches/ {print $2}' "$t/status")
    echo "${t##*/} $name $ticks $vol $inv"
  done 2>/dev/null
}
REPORT='
import json, sys
server, rw, before, after, window, text = *sys.argv[1:6], sys.stdin.read()
j = json.loads(text[text.index("{"):])["jobs"][0]
iops = j["read"]["iops"] + j["write"]["iops"]
ios = iops * float(window)  # the requests of the window counted
parse = lambda s: {l.split()[0]: l.split()[1:] for l in s.strip().splitlines()}
b, a = parse(before), parse(after)
by_name, tot, vol, inv = {}, 0, 0, 0
for tid, (name, ticks, v, i) in a.items():
    t0, v0, i0 = (int(x) for x in b.get(tid, [name, 0, 0, 0])[1:])
    dt, dv, di = int(ticks) - t0, int(v) - v0, int(i) - i0
    # Connection threads and io-wq workers are many of one kind: summed by name.
    key = name.rstrip("0123456789-")
    by_name[key] = by_name.get(key, 0) + dt
    tot, vol, inv = tot + dt, vol + dv, inv + di
us = lambda ticks: ticks / 100 * 1e6 / ios if ios else 0
busiest = ", ".join(f"{k} {us(v):.1f}" for k, v in sorted(by_name.items(), key=lambda kv: -kv[1]) if v)
print(f"{server:<8} {rw:<10} {iops:>9.0f} {us(tot):>9.1f} {vol / ios:>7.2f} {inv / ios:>7.2f}   {busiest}")
'
echo "server   row             IOPS   CPU us/req  vol/req inv/req   CPU us/req by thread"
for rw in randwrite randread; do
  for s in ferrite nbdkit; do
    # The threads are counted while the connection is up (a connection's thread ends with it),
    # from a second in to a second before the end: WINDOW seconds of the run.
    fio --name="$rw" --ioengine=nbd --uri="${URI[$s]}" --size="$SIZE" --rw="$rw" --bs=4k --iodepth=1 \
      --runtime="$SECS" --time_based --randrepeat=0 --output-format=json >"$DIR/fio.json" &
    FIO=$!
    sleep 1
    before=$(threads "${PID[$s]}")
    if [ "$PERF" = 1 ] && [ "$s" = ferrite ]; then
      perf record -q -g -o "$DIR/perf-$rw.data" -p "${PID[$s]}" -- sleep "$WINDOW" >/dev/null 2>&1 &
      PERFPID=$!
    fi
    sleep "$WINDOW"
    after=$(threads "${PID[$s]}")
    wait "$FIO"
    [ -n "${PERFPID:-}" ] && { wait "$PERFPID" || true; PERFPID=; }
    python3 -c "$REPORT" "$s" "$rw-qd1" "$before" "$after" "$WINDOW" <"$DIR/fio.json"
  done
done
if [ "$PERF" = 1 ]; then
  for rw in randwrite randread; do
    echo
    echo "ferrite $rw-qd1: the hottest symbols (self time, all threads)"
    perf report -q -i "$DIR/perf-$rw.data" --no-children --sort sym --stdio 2>/dev/null \
      | grep -v '^$' | grep '%' | head -25
  done
fi
