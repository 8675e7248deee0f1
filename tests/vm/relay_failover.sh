# In the guest (run by tests/vm/guest.sh): a relayed kernel NBD device follows its volume's
# primary through a failover. Three daemons: node-a (10.77.0.2) and node-c (10.77.1.2) in network
# namespaces of their own, each joined to the guest's by a veth pair (the guest routes between
# them), node-b (10.77.0.1/10.77.1.1) in the guest's. The volume has two copies, node-a's (the
# primary) and node-c's, node-b votes as the witness and relays the volume's device from node-a,
# told node-c is the other copy (`attach --copy`). Under fio with verify on ext4, node-a's daemon
# is killed (-9) and node-c's copy promoted (node-b's vote makes the majority): the device holds
# its I/O, skips node-c while it serves the export read-only (not yet primary), reconnects once
# it is the primary — no I/O error, no verify failure, fsck clean, the pause printed.
set -euo pipefail
D=/tmp/ferrite-failover; rm -rf $D; mkdir -p $D/a $D/b $D/c
DEV_PREFIX=/dev/nbd
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
trap 'for n in b a c; do echo "--- node-$n log"; tail -25 $D/$n.log; done' ERR
fa() { FERRITE_ADMIN_SOCKET=$D/a/admin.sock f "$@"; }
fb() { FERRITE_ADMIN_SOCKET=$D/b/admin.sock f "$@"; }
fc() { FERRITE_ADMIN_SOCKET=$D/c/admin.sock f "$@"; }
modprobe nbd nbds_max=4
modprobe veth

step "three nodes: node-a and node-c hold the volume's copies, node-b votes and relays"
sysctl -qw net.ipv4.ip_forward=1
net() { # net NODE GUEST-ADDR NODE-ADDR SUBNET-OF-THE-OTHER GUEST-NEXT-HOP
  ip netns add "$1"
  ip link add "g-$1" type veth peer name "n-$1"
  ip link set "n-$1" netns "$1"
  ip addr add "$2/24" dev "g-$1"; ip link set "g-$1" up
  ip -n "$1" addr add "$3/24" dev "n-$1"; ip -n "$1" link set "n-$1" up; ip -n "$1" link set lo up
  ip -n "$1" route add "$4" via "$2"
}
net node-a 10.77.0.1 10.77.0.2 10.77.1.0/24
net node-c 10.77.1.1 10.77.1.2 10.77.0.0/24
for n in "node-a 10.77.0.2" "node-b 10.77.0.1" "node-c 10.77.1.2"; do f certs $D/pki $n >/dev/null 2>&1; done
conf() { # conf NODE ADDR EXTRA: a daemon with TLS on its admin and NBD listeners
  printf 'pool-size = "512M"\nsegment-size = "4M"\nlog-level = "info"\nadmin-listen = "%s:7070"\n' "$2"
  printf 'nbd-listen = "%s:10809"\ntls-cert = "%s"\ntls-key = "%s"\ntls-client-ca = "%s"\n%b' \
    "$2" "$D/pki/$1.pem" "$D/pki/$1-key.pem" "$D/pki/ca.pem" "$3"
  printf '[roles]\n"node-a" = "replication-peer"\n"node-c" = "replication-peer"\n'
  printf '"node-b" = ["replication-peer", "nbd-client"]\n'
}
conf node-a 10.77.0.2 '' > $D/a.toml
conf node-c 10.77.1.2 '' > $D/c.toml
conf node-b 10.77.0.1 'nbd-device-timeout-s = 5\ndevice-hold-s = 90\n' > $D/b.toml
ip netns exec node-a "$FERRITE" daemon --config $D/a.toml --data-dir $D/a >> $D/a.log 2>&1 &
A=$!
ip netns exec node-c "$FERRITE" daemon --config $D/c.toml --data-dir $D/c >> $D/c.log 2>&1 &
C=$!
"$FERRITE" daemon --config $D/b.toml --data-dir $D/b >> $D/b.log 2>&1 &
B=$!
for _ in $(seq 300); do
  fa pool status >/dev/null 2>&1 && fb pool status >/dev/null 2>&1 && fc pool status >/dev/null 2>&1 && break
  sleep 0.2
done
fa volume create fv 256M --replicas 2 --peer tcp://10.77.1.2:7070 --witness tcp://10.77.0.1:7070 >/dev/null
for _ in $(seq 300); do fa replica status fv | grep -q "10.77.1.2:7070 *in-sync" && break; sleep 0.2; done
fa replica status fv
fa export nbd fv --allow node-b >/dev/null
DEV=$(fb attach fv --remote 10.77.0.2:10809 --export fv --copy 10.77.1.2:10809)
fb attachments | grep -q "via 10.77.0.2:10809"

step "node-a killed under fio on ext4, node-c's copy promoted: the device follows, no error"
failover() {
  kill -9 $A; wait $A 2>/dev/null || true
  # node-c's copy serves the export read-only until it is promoted: the relay must skip it.
  fc export nbd fv --allow node-b >/dev/null
  sleep 3
  fc replica promote fv
}
restarts_under_io "$DEV" failover KILL
fb attachments | grep -q "via 10.77.1.2:10809" || { fb attachments; echo "the device did not follow"; exit 1; }
grep -q "not the volume's primary" $D/b.log || { echo "the relay never met the read-only copy"; exit 1; }
grep "the device follows it" $D/b.log
grep "kernel NBD device reconnected" $D/b.log
fb detach "$DEV" >/dev/null

step "the survivors stop cleanly"
kill -TERM $B; wait $B || { echo "node-b exited with $?"; exit 1; }
kill -TERM $C; wait $C || { echo "node-c exited with $?"; exit 1; }
ip netns del node-a; ip netns del node-c
echo "RELAY_FAILOVER_OK"
