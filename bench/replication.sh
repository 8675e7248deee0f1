#!/usr/bin/env bash
# Replication numbers in one run, between two daemons in two network namespaces this script
# makes (a veth pair, 10.203.0.1 and .2), over the real mutual-TLS link:
#   1. initial sync of a thin SIZE volume holding DATA bytes (written by fio at scattered 1 MiB
#      offsets), next to nbdcopy of the same volume over NBD with TLS on the same link into a
#      volume of the other daemon; bytes sent vs allocated, bytes on the wire (veth counters);
#   2. incremental efficiency: bytes on the wire / (changed blocks x 4 KiB) after INCR of random
#      4 KiB writes;
#   3. RPO: lag samples (1/s) for RPO_SECS of rate-limited random writes (RATE IOPS) with a
#      10 s interval: p50/p99/max;
#   4. failover: force-promote of a FAILOVER_SIZE volume (wall time), then failback: FAILBACK
#      of random writes on the promoted side, demote + resync of the old primary, bytes that
#      crossed vs bytes changed.
# Needs root (ip netns), fio with its nbd engine, nbdcopy.
#   SIZE=64G DATA=1G INCR=64M RPO_SECS=120 RATE=2000 FERRITE_BIN=target/debug/ferrite bench/replication.sh
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE=${SIZE:-64G}
DATA=${DATA:-1G}
INCR=${INCR:-64M}
RPO_SECS=${RPO_SECS:-120}
RATE=${RATE:-2000}
FAILOVER_SIZE=${FAILOVER_SIZE:-10G}
FAILBACK=${FAILBACK:-64M}
DIR=${BENCH_DIR:-/tmp/ferrite-repl}
for t in fio nbdcopy ip python3; do
  command -v $t >/dev/null || { echo "SKIPPED: $t is not installed (scripts/setup.sh installs it)"; exit 0; }
done
[ "$(id -u)" = 0 ] || { echo "SKIPPED: network namespaces need root"; exit 0; }
if [ -z "${FERRITE_BIN:-}" ]; then
  . scripts/setup.sh
  cargo build --workspace --locked --bin ferrite >&2
  FERRITE_BIN="$CARGO_TARGET_DIR/debug/ferrite"
fi
F=$FERRITE_BIN
NS=(frbench-a frbench-b)
IP=(10.203.0.1 10.203.0.2)

cleanup() {
  for d in a b; do [ -f "$DIR/$d/pid" ] && kill -9 "$(cat "$DIR/$d/pid")" 2>/dev/null; done
  wait 2>/dev/null || true
  for n in "${NS[@]}"; do ip netns del "$n" 2>/dev/null || true; done
  rm -rf "$DIR"
}
trap cleanup EXIT
cleanup
mkdir -p "$DIR/a" "$DIR/b"
for i in 0 1; do ip netns add "${NS[$i]}"; ip -n "${NS[$i]}" link set lo up; done
ip link add frba type veth peer name frbb
ip link set frba netns "${NS[0]}"; ip link set frbb netns "${NS[1]}"
ip -n "${NS[0]}" addr add "${IP[0]}/24" dev frba; ip -n "${NS[0]}" link set frba up
ip -n "${NS[1]}" addr add "${IP[1]}/24" dev frbb; ip -n "${NS[1]}" link set frbb up
wire() { ip netns exec "${NS[0]}" cat /sys/class/net/frba/statistics/tx_bytes; }
wire_b() { ip netns exec "${NS[1]}" cat /sys/class/net/frbb/statistics/tx_bytes; }

PKI=$DIR/pki
"$F" certs "$PKI" host-a "${IP[0]}" >/dev/null
"$F" certs "$PKI" host-b "${IP[1]}" >/dev/null
"$F" certs "$PKI" client >/dev/null
start() { # start DIR NS IP NAME
  cat > "$1/ferrite.toml" <<EOF
pool-size = "96G"
admin-listen = "$3:7070"
nbd-listen = "$3:10809"
tls-cert = "$PKI/$4.pem"
tls-key = "$PKI/$4-key.pem"
tls-client-ca = "$PKI/ca.pem"
[roles]
"host-a" = "replication-peer"
"host-b" = "replication-peer"
EOF
  ip netns exec "$2" "$F" daemon --config "$1/ferrite.toml" --data-dir "$1" >>"$1/log" 2>&1 &
  echo $! > "$1/pid"
  for _ in $(seq 6000); do "$F" --admin-socket "$1/admin.sock" pool status >/dev/null 2>&1 && return; sleep 0.01; done
  echo "a daemon did not come up:" >&2; cat "$1/log" >&2; exit 1
}
start "$DIR/a" "${NS[0]}" "${IP[0]}" host-a
start "$DIR/b" "${NS[1]}" "${IP[1]}" host-b
A() { "$F" --admin-socket "$DIR/a/admin.sock" "$@"; }
B() { "$F" --admin-socket "$DIR/b/admin.sock" "$@"; }
field() { python3 -c "import json,sys; print(json.load(sys.stdin)$1)"; }
now() { date +%s.%N; }
fio_on() { # fio_on SOCKET VOLUME ARGS...
  local sock=$1 vol=$2; shift 2
  fio --name=w --ioengine=nbd --uri="nbd+unix:///$vol?socket=$sock" --output=/dev/null "$@"
}

echo "== 1. initial sync: a $SIZE volume holding $DATA"
A volume create v "$SIZE" >/dev/null
A export nbd v >/dev/null
fio_on "$DIR/a/nbd.sock" v --rw=randwrite --bs=1M --iodepth=8 --size="$SIZE" --io_size="$DATA" --refill_buffers
alloc=$(A -o json volume show v | field '["allocated"]')
A replica enable v "tcp://${IP[1]}:7070" --interval 0 >/dev/null
w0=$(wire); t0=$(now)
sent=$(A -o json replica sync v 2>/dev/null | field '["data_bytes"]')
t1=$(now); w1=$(wire)
repl_s=$(python3 -c "print($t1-$t0)")
# nbdcopy of the same volume, TLS on the same link, into a volume of the other daemon.
B volume create dst "$SIZE" >/dev/null
B export nbd dst >/dev/null
TLSDIR=$DIR/libnbd; mkdir -p "$TLSDIR"
cp "$PKI/ca.pem" "$TLSDIR/ca-cert.pem"; cp "$PKI/client.pem" "$TLSDIR/client-cert.pem"; cp "$PKI/client-key.pem" "$TLSDIR/client-key.pem"
A export nbd "v@$(A -o json replica status v | field '["last_snapshot"]')" --name src >/dev/null
w2=$(wire); t2=$(now)
ip netns exec "${NS[1]}" nbdcopy "nbds://${IP[0]}:10809/src?tls-certificates=$TLSDIR" "nbd+unix:///dst?socket=$DIR/b/nbd.sock"
t3=$(now); w3=$(wire)
copy_s=$(python3 -c "print($t3-$t2)")
python3 - "$alloc" "$sent" "$((w1-w0))" "$repl_s" "$((w3-w2))" "$copy_s" <<'EOF'
import sys
alloc, sent, wire, secs, cwire, csecs = (float(x) for x in sys.argv[1:])
mib = 1 << 20
print(f"allocated {alloc/mib:.0f} MiB; replication sent {sent/mib:.0f} MiB of data, {wire/mib:.0f} MiB on the wire "
      f"({wire/alloc:.3f}x allocated) in {secs:.1f} s = {sent/mib/secs:.0f} MiB/s")
print(f"nbdcopy (TLS, same link): {cwire/mib:.0f} MiB on the wire in {csecs:.1f} s = {alloc/mib/csecs:.0f} MiB/s; "
      f"replication/nbdcopy throughput {(sent/secs)/(alloc/csecs):.2f}x")
EOF
A export stop src >/dev/null

echo "== 2. incremental: $INCR of random 4 KiB writes"
base=$(A -o json replica status v | field '["last_snapshot"]')
fio_on "$DIR/a/nbd.sock" v --rw=randwrite --bs=4k --iodepth=16 --size="$SIZE" --io_size="$INCR" --refill_buffers
A snapshot create v probe >/dev/null
changed=$(A -o json snapshot diff v@probe --since "$base" | field '["bytes"]')
A snapshot delete probe >/dev/null
w0=$(wire)
sent=$(A -o json replica sync v 2>/dev/null | field '["data_bytes"]')
w1=$(wire)
python3 -c "c,s,w=$changed,$sent,$((w1-w0)); print(f'changed {c/2**20:.1f} MiB (blocks x 4 KiB), data sent {s/2**20:.1f} MiB, wire {w/2**20:.1f} MiB: wire/changed = {w/c:.3f}')"

echo "== 3. RPO: ${RPO_SECS}s of random writes at $RATE IOPS, 10 s interval"
A replica enable v "tcp://${IP[1]}:7070" --interval 10s >/dev/null
fio_on "$DIR/a/nbd.sock" v --rw=randwrite --bs=4k --iodepth=4 --size="$SIZE" --rate_iops="$RATE" \
  --time_based --runtime="$RPO_SECS" --refill_buffers &
FIO=$!
: > "$DIR/lag"
for _ in $(seq "$RPO_SECS"); do A -o json replica status v | field '["lag_seconds"]' >> "$DIR/lag"; sleep 1; done
wait $FIO
python3 - "$DIR/lag" <<'EOF'
import sys, statistics
v = sorted(float(x) for x in open(sys.argv[1]))
p = lambda q: v[min(len(v) - 1, int(q * len(v)))]
print(f"lag over {len(v)} samples: p50 {p(0.5):.1f} s, p99 {p(0.99):.1f} s, max {v[-1]:.1f} s (goal: p99 <= 20 s)")
EOF
A replica enable v "tcp://${IP[1]}:7070" --interval 0 >/dev/null

echo "== 4. failover of a $FAILOVER_SIZE volume, and failback"
A volume create big "$FAILOVER_SIZE" >/dev/null
A export nbd big >/dev/null
fio_on "$DIR/a/nbd.sock" big --rw=randwrite --bs=1M --iodepth=8 --size="$FAILOVER_SIZE" --io_size=1G --refill_buffers
A replica enable big "tcp://${IP[1]}:7070" --interval 0 >/dev/null
A replica sync big >/dev/null 2>&1
kill -9 "$(cat "$DIR/a/pid")"; rm "$DIR/a/pid"
t0=$(now); B replica promote big --force >/dev/null; t1=$(now)
python3 -c "print(f'force-promote of a $FAILOVER_SIZE volume: {($t1-$t0)*1000:.0f} ms (CLI round trip included)')"
B export nbd big >/dev/null
fio_on "$DIR/b/nbd.sock" big --rw=randwrite --bs=4k --iodepth=16 --size="$FAILOVER_SIZE" --io_size="$FAILBACK" --refill_buffers
start "$DIR/a" "${NS[0]}" "${IP[0]}" host-a
A replica demote big >/dev/null
B snapshot create big probe >/dev/null
changed=$(B -o json snapshot diff big@probe --since "$(B -o json replica status big | field '["last_snapshot"]')" | field '["bytes"]')
B snapshot delete probe >/dev/null
w0=$(wire_b)
A replica resync big >/dev/null
for _ in $(seq 600); do [ "$(A -o json replica status big | field '["resynced"]')" = True ] && break; sleep 0.5; done
w1=$(wire_b)
sent=$(B -o json replica status big | field '["last_sync_bytes"]')
python3 -c "c,s,w=$changed,$sent,$((w1-w0)); print(f'failback resync: changed {c/2**20:.1f} MiB, data sent {s/2**20:.1f} MiB, wire {w/2**20:.1f} MiB ({w/c:.3f}x changed)')"
