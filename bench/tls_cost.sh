#!/usr/bin/env bash
# What TLS costs NBD over TCP: one daemon with `nbd-tls = "allow"` (plaintext and STARTTLS on the
# same listener) and a server certificate from `ferrite certs`; fio's nbd engine runs each
# workload over nbd:// and nbds:// in turn, alternating inside each round. fio's engine cannot
# name certificate files in its URI (libnbd refuses local files there), so the client presents no
# certificate and skips verifying the server's (tls-verify-peer=false): what is measured is the
# encryption of the data path, which mutual TLS does not change (it costs only the handshake). Prints IOPS and server
# CPU seconds per GiB per (workload, transport, round), then medians and TLS/plain ratios.
#   ROUNDS=3 SECS=5 WORKLOADS="randread:32 randwrite:32" bench/tls_cost.sh [FERRITE_BINARY]
set -euo pipefail
ROUNDS=${ROUNDS:-3}
SECS=${SECS:-5}
WORKLOADS=${WORKLOADS:-"randread:32 randwrite:32"}
DIR=${BENCH_DIR:-/tmp/ferrite-tls-cost}
BIN=${1:-${CARGO_TARGET_DIR:-$HOME/.cache/ferrite/target}/debug/ferrite}
command -v fio >/dev/null || { echo "SKIPPED: fio is not installed (scripts/setup.sh installs it)"; exit 0; }
fio --enghelp 2>/dev/null | grep -qw nbd || { echo "SKIPPED: this fio has no nbd engine"; exit 0; }

PID=
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
rm -rf "$DIR"; mkdir -p "$DIR"
"$BIN" certs "$DIR/pki" server 127.0.0.1 >/dev/null
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cat > "$DIR/ferrite.toml" <<TOML
pool-size = "8G"
nbd-listen = "127.0.0.1:$PORT"
nbd-tls = "allow"
tls-cert = "$DIR/pki/server.pem"
tls-key = "$DIR/pki/server-key.pem"
TOML
"$BIN" daemon --config "$DIR/ferrite.toml" --data-dir "$DIR/data" >"$DIR/ferrite.log" 2>&1 &
PID=$!
export FERRITE_ADMIN_SOCKET="$DIR/data/admin.sock"
for _ in $(seq 600); do "$BIN" pool status >/dev/null 2>&1 && break; sleep 0.1; done
"$BIN" volume create v 1G >/dev/null
"$BIN" export nbd v >/dev/null
plain="nbd://127.0.0.1:$PORT/v"
tls="nbds://127.0.0.1:$PORT/v?tls-verify-peer=false"
fio --name=fill --ioengine=nbd --uri="$plain" --size=1G --rw=write --bs=1M --iodepth=4 --output=/dev/null
PARSE='
import json, sys
t = sys.stdin.read()
j = json.loads(t[t.index("{"):])["jobs"][0]
iops = j["read"]["iops"] + j["write"]["iops"]
gib = (j["read"]["io_bytes"] + j["write"]["io_bytes"]) / 2**30
print(f"{sys.argv[1]} {sys.argv[2]} {iops:.0f} {(int(sys.argv[4]) - int(sys.argv[3])) / 100 / gib if gib else 0:.2f}")
'
results=$(mktemp)
for round in $(seq "$ROUNDS"); do
  for w in $WORKLOADS; do
    IFS=: read -r rw qd <<<"$w"
    # Which transport goes first changes every round, so drift does not always favour one.
    order="plain tls"; [ $((round % 2)) = 0 ] && order="tls plain"
    for t in $order; do
      uri=$plain; [ "$t" = tls ] && uri=$tls
      c0=$(cpu "$PID")
      json=$(fio --name=tls --ioengine=nbd --uri="$uri" --size=1G --rw="$rw" --bs=4k --iodepth="$qd" \
        --runtime="$SECS" --time_based --randrepeat=0 --output-format=json)
      c1=$(cpu "$PID")
      line=$(python3 -c "$PARSE" "$w" "$t" "$c0" "$c1" <<<"$json")
      echo "round $round: $line" >&2
      echo "$line" >> "$results"
    done
  done
done
python3 - "$results" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
print(f"{'workload':<14} {'plain IOPS':>10} {'tls IOPS':>10} {'tls/plain':>9}   CPU s/GiB plain  tls")
for w in dict.fromkeys(r[0] for r in rows):
    med = lambda t, i: statistics.median(float(r[i]) for r in rows if r[0] == w and r[1] == t)
    p, t = med("plain", 2), med("tls", 2)
    print(f"{w:<14} {p:>10.0f} {t:>10.0f} {t / p:>8.2f}x   {med('plain', 3):>14.2f} {med('tls', 3):>5.2f}")
PY
rm -f "$results"
