#!/usr/bin/env bash
# Synchronous replicas in one run: three daemons in network namespaces this script makes, each
# plugged into one bridge (the "switch") by a veth pair, over the real mutual-TLS streams. On
# host 0, volumes with 1, 2 and 3 copies; fio through NBD (unix socket on host 0) on each in
# turn: 4 KiB random write at QD1 and QD32, 128 KiB sequential write at QD8. Prints IOPS,
# MiB/s, p50/p99 completion latency, the latency each row adds over one copy, and the link's
# round trip (ping) next to it. DELAY_MS adds that many ms to every round trip between hosts (a
# WAN): netem on each host's link, half each way, or where the kernel has no netem a delay line
# (bench/src/bin/delay-line.rs) in front of each daemon's replication endpoint, holding each
# direction half of it; DELAY_LINE=1 takes the delay line even at 0 ms (the baseline of its ratio).
# Needs root (ip netns, tc), fio with its nbd engine.
# Then a rebuild by what changed (a REBUILD_SIZE volume, default 2G, written in full, with a
# replica and a witness; the replica stopped while 1% of it is rewritten, then let go) next to
# a full copy of a volume like it to a new replica, and a failover: kill -9 of the primary during writes, promote on a
# replica, export, first write acknowledged there.
# ROWS (space-separated row names, "rebuild", "failover") runs only those rows.
#   SECS=10 DELAY_MS=0 FERRITE_BIN=target/debug/ferrite bench/sync_replicas.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${SECS:-10}
DELAY_MS=${DELAY_MS:-0}
DIR=${BENCH_DIR:-/tmp/ferrite-sync}
LINE=${DELAY_LINE:-0}
for t in fio ip tc ping python3 qemu-io; do
  command -v $t >/dev/null || { echo "SKIPPED: $t is not installed (scripts/setup.sh installs it)"; exit 0; }
done
[ "$(id -u)" = 0 ] || { echo "SKIPPED: network namespaces need root"; exit 0; }
if [ -z "${FERRITE_BIN:-}" ]; then
  . scripts/setup.sh
  cargo build --workspace --locked --bin ferrite >&2
  FERRITE_BIN="$CARGO_TARGET_DIR/debug/ferrite"
fi
F=$FERRITE_BIN
DELAY_LINE_BIN=$(dirname "$F")/delay-line
NS=(frsync0 frsync1 frsync2)
HUB=frsynchub
IP=(10.204.0.1 10.204.0.2 10.204.0.3)

cleanup() {
  for i in 0 1 2; do
    for p in pid line.pid; do [ -f "$DIR/$i/$p" ] && kill -9 "$(cat "$DIR/$i/$p")" 2>/dev/null; done
  done
  wait 2>/dev/null || true
  for n in "${NS[@]}" $HUB; do ip netns del "$n" 2>/dev/null || true; done
  rm -rf "$DIR"
}
trap cleanup EXIT
cleanup
ip netns add $HUB
ip -n $HUB link add br0 type bridge
ip -n $HUB link set br0 up
for i in 0 1 2; do
  ip netns add "${NS[$i]}"; ip -n "${NS[$i]}" link set lo up
  ip link add "frs$i" netns "${NS[$i]}" type veth peer name "p$i" netns $HUB
  ip -n "${NS[$i]}" addr add "${IP[$i]}/24" dev "frs$i"; ip -n "${NS[$i]}" link set "frs$i" up
  ip -n $HUB link set "p$i" master br0; ip -n $HUB link set "p$i" up
  if [ "$DELAY_MS" != 0 ] && [ "$LINE" = 0 ] &&
    ! ip netns exec "${NS[$i]}" tc qdisc replace dev "frs$i" root netem delay "$((DELAY_MS * 500))us" 2>/dev/null; then
    echo "this kernel has no netem: a delay line holds each replication stream instead" >&2
    LINE=1
  fi
done
PORT=7070
if [ "$LINE" = 1 ]; then
  [ -x "$DELAY_LINE_BIN" ] || { echo "no $DELAY_LINE_BIN: cargo build --workspace builds it" >&2; exit 1; }
  PORT=7071
fi

PKI=$DIR/pki
for i in 0 1 2; do "$F" certs "$PKI" "host-$i" "${IP[$i]}" >/dev/null; done
for i in 0 1 2; do
  mkdir -p "$DIR/$i"
  cat > "$DIR/$i/ferrite.toml" <<EOF
pool-size = "8G"
admin-listen = "${IP[$i]}:7070"
replication-endpoint = "tcp://${IP[$i]}:$PORT"
tls-cert = "$PKI/host-$i.pem"
tls-key = "$PKI/host-$i-key.pem"
tls-client-ca = "$PKI/ca.pem"
sync-mark-interval-ms = 5000
[roles]
"host-0" = "replication-peer"
"host-1" = "replication-peer"
"host-2" = "replication-peer"
EOF
  if [ "$LINE" = 1 ]; then
    ip netns exec "${NS[$i]}" "$DELAY_LINE_BIN" "${IP[$i]}:7071" "${IP[$i]}:7070" "$((DELAY_MS * 500))" &
    echo $! > "$DIR/$i/line.pid"
  fi
  ip netns exec "${NS[$i]}" "$F" daemon --config "$DIR/$i/ferrite.toml" --data-dir "$DIR/$i" >>"$DIR/$i/log" 2>&1 &
  echo $! > "$DIR/$i/pid"
done
for i in 0 1 2; do
  for _ in $(seq 6000); do "$F" --admin-socket "$DIR/$i/admin.sock" pool status >/dev/null 2>&1 && break; sleep 0.01; done
done
A() { "$F" --admin-socket "$DIR/0/admin.sock" "$@"; }
E1="tcp://${IP[1]}:$PORT"; E2="tcp://${IP[2]}:$PORT"
A volume create c1 2G >/dev/null
A volume create c2 2G --replicas 2 --peer "$E1" >/dev/null
A volume create c3 2G --replicas 3 --peer "$E1" --peer "$E2" >/dev/null
for v in c1 c2 c3; do A export nbd $v >/dev/null; done
rtt=$(ip netns exec "${NS[0]}" ping -q -c 50 -i 0.01 "${IP[1]}" | python3 -c "import sys; l=[x for x in sys.stdin if 'min/avg' in x][0]; print(float(l.split('=')[1].split('/')[1])*1000)")
[ "$LINE" = 1 ] && rtt=$((${rtt%.*} + DELAY_MS * 1000))
echo "link round trip host 0 -> host 1: ${rtt%.*} µs (ping avg$([ "$DELAY_MS" = 0 ] || echo ", with the ${DELAY_MS} ms added"))$([ "$LINE" = 1 ] && echo "; through delay lines")"
# In a VM, an idle vCPU halts and its wake-up is a trip through the hypervisor: at QD1 each
# mirrored write waits on several (bench/HISTORY.md, issue 86: p50 two copies 151-181 µs with
# halting, 59-84 µs with the guest's halt polling on). Printed so rows from machines compare.
poll=/sys/module/haltpoll/parameters/guest_halt_poll_ns
[ -r $poll ] && echo "guest halt polling: guest_halt_poll_ns=$(cat $poll)$([ "$(cat $poll)" = 0 ] && echo " (off: idle vCPUs halt)")"

# The machine's busy CPU time (user, system, irq, softirq: µs) and context switches so far,
# from /proc/stat: the daemons, fio and the network stack together.
cpu_ctxt() {
  python3 -c "
l={x.split()[0]: x.split()[1:] for x in open('/proc/stat')}
c=[int(v) for v in l['cpu']]
hz=__import__('os').sysconf('SC_CLK_TCK')
print((c[0]+c[1]+c[2]+c[5]+c[6]) * 1000000 // hz, l['ctxt'][0])"
}
run() { # run VOLUME NAME FIO-ARGS... -> one JSON line
  local v=$1 name=$2; shift 2
  local before after
  before=$(cpu_ctxt)
  fio --name=w --ioengine=nbd --uri="nbd+unix:///$v?socket=$DIR/0/nbd.sock" --output-format=json \
    --output="$DIR/fio.json" --time_based --runtime="$SECS" --size=1G "$@" >&2
  after=$(cpu_ctxt)
  python3 -c "
import json,sys
j=json.load(open('$DIR/fio.json'))['jobs'][0]['write']
p=j['clat_ns']['percentile']
b,a=[int(x) for x in '$before'.split()],[int(x) for x in '$after'.split()]
n=max(1,j['total_ios'])
print(json.dumps({'row':'$name','copies':'$v'[1],'iops':j['iops'],'mibs':j['bw']/1024,'p50':p['50.000000']/1000,'p99':p['99.000000']/1000,
  'cpu':(a[0]-b[0])/n,'ctxt':(a[1]-b[1])/n}))"
}
OUT=$DIR/rows.jsonl
: > "$OUT"
for row in "randwrite-4k-qd1:--rw=randwrite --bs=4k --iodepth=1" \
           "randwrite-4k-qd32:--rw=randwrite --bs=4k --iodepth=32" \
           "write-128k-qd8:--rw=write --bs=128k --iodepth=8"; do
  name=${row%%:*}; args=${row#*:}
  case " ${ROWS:-$name} " in *" $name "*) ;; *) continue ;; esac
  for v in c1 c2 c3; do
    # shellcheck disable=SC2086
    run $v "$name" $args >> "$OUT"
  done
done
[ -s "$OUT" ] && for v in c3; do A -o json replica status $v | python3 -c "import json,sys; j=json.load(sys.stdin); print(f\"{j['volume']}: {j['requests']} mirrored requests, +{j['added_latency_us']:.0f} µs each on average (status)\")"; done
python3 - "$OUT" "$rtt" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
if not rows:
    sys.exit(0)
rtt = float(sys.argv[2])
print("CPU: busy µs per write on the whole machine (daemons, fio, softirq); ctx: context switches per write, all of it")
print(f"{'row':<20}{'copies':>7}{'IOPS':>10}{'MiB/s':>9}{'p50 µs':>9}{'p99 µs':>9}{'+p50 µs':>9}{'vs 1':>7}{'CPU µs':>8}{'ctx':>6}")
one = {r['row']: r for r in rows if r['copies'] == '1'}
for r in rows:
    o = one[r['row']]
    print(f"{r['row']:<20}{r['copies']:>7}{r['iops']:>10.0f}{r['mibs']:>9.1f}{r['p50']:>9.0f}{r['p99']:>9.0f}"
          f"{r['p50'] - o['p50']:>9.0f}{r['iops'] / o['iops']:>7.2f}{r['cpu']:>8.1f}{r['ctxt']:>6.1f}")
def row(name):
    return {r['copies']: r for r in rows if r['row'] == name}
q1, q32, seq = row('randwrite-4k-qd1'), row('randwrite-4k-qd32'), row('write-128k-qd8')
if q1:
    print(f"goal QD1: 2 copies <= 1 + RTT + 40 = {q1['1']['p50'] + rtt + 40:.0f} µs: {q1['2']['p50']:.0f}; "
          f"3 copies <= 2 + 20 = {q1['2']['p50'] + 20:.0f} µs: {q1['3']['p50']:.0f}")
if q32:
    print(f"goal QD32: 2 copies >= 0.45x one: {q32['2']['iops'] / q32['1']['iops']:.2f}x; CPU per write <= 2.2x one: "
          f"{q32['2']['cpu'] / q32['1']['cpu']:.2f}x; context switches per write <= 1: {q32['2']['ctxt']:.1f}; "
          f"3 copies >= 0.33x one: {q32['3']['iops'] / q32['1']['iops']:.2f}x")
if seq:
    print(f"goal 128 KiB sequential: 2 copies >= 0.6x one: {seq['2']['mibs'] / seq['1']['mibs']:.2f}x")
EOF

want() { case " ${ROWS:-rebuild failover} " in *" $1 "*) return 0 ;; esac; return 1; }
now_ms() { date +%s%3N; }
tx() { ip netns exec "${NS[0]}" cat /sys/class/net/frs0/statistics/tx_bytes; }
state() { # state VOLUME ENDPOINT [HOST]
  "$F" --admin-socket "$DIR/${3:-0}/admin.sock" -o json replica status "$1" |
    python3 -c "import json,sys; print(next(m['state'] for m in json.load(sys.stdin)['members'] if m['endpoint']=='$2'))"
}
until_state() { # until_state VOLUME ENDPOINT STATE SECONDS
  for _ in $(seq $(($4 * 20))); do [ "$(state "$1" "$2")" = "$3" ] && return 0; sleep 0.05; done
  echo "$2 did not become $3 in $4 s" >&2; return 1
}
fill() { # fill VOLUME FIO-ARGS...
  local v=$1; shift
  fio --name=fill --ioengine=nbd --uri="nbd+unix:///$v?socket=$DIR/0/nbd.sock" --output=/dev/null "$@" >&2
}
if want rebuild; then
  RB=${REBUILD_SIZE:-2G}
  # Two copies and a witness: writes go on while the replica is away.
  A volume create r "$RB" --replicas 2 --peer "$E1" --witness "$E2" >/dev/null
  A volume create full "$RB" >/dev/null
  for v in r full; do
    A export nbd $v >/dev/null
    fill $v --rw=write --bs=1M --iodepth=4 --size="$RB"
  done
  bytes=$(A -o json volume list | python3 -c "import json,sys; print(next(v['size'] for v in json.load(sys.stdin) if v['name']=='r'))")
  # A mark with the member (every 5 s after writes), then the member stops answering.
  for _ in $(seq 200); do
    A -o json replica status r | python3 -c "import json,sys; sys.exit(0 if all(m['mark'] for m in json.load(sys.stdin)['members']) else 1)" && break
    sleep 0.1
  done
  kill -STOP "$(cat "$DIR/1/pid")"
  changed=$((bytes / 100))
  fill r --rw=randwrite --bs=64k --iodepth=8 --size="$RB" --io_size="$changed"
  until_state r "$E1" ejected 30
  before=$(tx); t0=$(now_ms)
  kill -CONT "$(cat "$DIR/1/pid")"
  until_state r "$E1" in-sync 600
  t1=$(now_ms); rebuilt=$(($(tx) - before))
  before=$(tx); t2=$(now_ms)
  A replica add full "$E1" --sync >/dev/null
  until_state full "$E1" in-sync 1200
  t3=$(now_ms); full=$(($(tx) - before))
  echo "rebuild of a $RB volume with 1% rewritten ($((changed >> 20)) MiB): $((t1 - t0)) ms, $((rebuilt >> 20)) MiB on the wire;" \
    "full copy to a new replica: $((t3 - t2)) ms, $((full >> 20)) MiB on the wire" \
    "(time ratio $(python3 -c "print(f'{($t1 - $t0) / max(1, $t3 - $t2):.3f}')"))"
fi
if want failover; then
  A volume create f 256M --replicas 3 --peer "$E1" --peer "$E2" >/dev/null
  A export nbd f >/dev/null
  # Its writes fail once the primary is gone: their errors are expected.
  fill f --rw=randwrite --bs=4k --iodepth=4 --size=256M --time_based --runtime=30 2>/dev/null &
  writer=$!
  sleep 2
  t0=$(now_ms)
  kill -9 "$(cat "$DIR/0/pid")"
  B() { "$F" --admin-socket "$DIR/1/admin.sock" "$@"; }
  until B replica promote f >/dev/null 2>&1; do sleep 0.05; done
  B export nbd f >/dev/null
  qemu-io -f raw "nbd+unix:///f?socket=$DIR/1/nbd.sock" -c "write -P 7 0 4k" >/dev/null
  t1=$(now_ms)
  wait "$writer" 2>/dev/null || true
  echo "failover: kill -9 of the primary to the first write acknowledged by the promoted replica: $((t1 - t0)) ms (goal < 5000)"
fi
