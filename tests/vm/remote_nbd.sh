# In the guest (run by tests/vm/guest.sh): another node's volume as a kernel NBD device. Two
# daemons, "node-a" in a network namespace joined to the guest's by a veth pair, "node-b" in the
# guest's own (the kernel's NBD netlink family lives there): node-a serves the volume on its TLS
# NBD listener, node-b attaches it with `ferrite attach --remote`, relaying the kernel client's
# plaintext over TLS with its own certificate, as a Kubernetes node without a copy does.
# fio verify; ext4 across detach and re-attach; growth followed online (`ferrite refresh`); an
# export granted to another identity is refused; node-a's daemon replaced three times (SIGTERM,
# kill -9) under fio on ext4 over the relayed device: a pause, no I/O error; stopping the export
# holds the device's I/O for device-hold-s, then fails it (nothing hangs), and it detaches cleanly.
set -euo pipefail
D=/tmp/ferrite-remote; rm -rf $D; mkdir -p $D/a $D/b
DEV_PREFIX=/dev/nbd
# node-b's hold: past the longest replacement of node-a's daemon under TCG (a SIGTERM drains and
# checkpoints, then a new daemon opens the pool): a pause of 20.7 s was seen, and a hold of 20 s
# failed relayed writes once.
HOLD=40
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
trap 'echo "--- node-b log"; tail -20 $D/b.log; echo "--- node-a log"; tail -20 $D/a.log' ERR
fa() { FERRITE_ADMIN_SOCKET=$D/a/admin.sock f "$@"; }
fb() { FERRITE_ADMIN_SOCKET=$D/b/admin.sock f "$@"; }
modprobe nbd nbds_max=4
modprobe veth

step "two nodes: node-a (10.77.0.2, its own namespace) serves, node-b (10.77.0.1) attaches"
ip netns add node-a
ip link add fer-b type veth peer name fer-a
ip link set fer-a netns node-a
ip addr add 10.77.0.1/24 dev fer-b; ip link set fer-b up
ip -n node-a addr add 10.77.0.2/24 dev fer-a; ip -n node-a link set fer-a up; ip -n node-a link set lo up
f certs $D/pki node-a 10.77.0.2 >/dev/null 2>&1
f certs $D/pki node-b 10.77.0.1 >/dev/null 2>&1
tls() { printf 'tls-cert = "%s"\ntls-key = "%s"\ntls-client-ca = "%s"\n' "$D/pki/$1.pem" "$D/pki/$1-key.pem" "$D/pki/ca.pem"; }
{ printf 'pool-size = "1G"\nsegment-size = "4M"\nlog-level = "warn"\nnbd-listen = "10.77.0.2:10809"\n'; tls node-a; } > $D/a.toml
{ printf 'pool-size = "256M"\nsegment-size = "4M"\nlog-level = "info"\nnbd-device-timeout-s = 5\ndevice-hold-s = %s\n' $HOLD; tls node-b; } > $D/b.toml
start_a() {
  ip netns exec node-a "${DAEMON_BIN:-$FERRITE}" daemon --config $D/a.toml --data-dir $D/a >> $D/a.log 2>&1 &
  A=$!
}
start_a
"$FERRITE" daemon --config $D/b.toml --data-dir $D/b >> $D/b.log 2>&1 &
B=$!
for _ in $(seq 300); do fa pool status >/dev/null 2>&1 && fb pool status >/dev/null 2>&1 && break; sleep 0.2; done
fa volume create v 256M >/dev/null
fa export nbd v --allow node-b >/dev/null

step "fio verify through the relay"
DEV=$(fb attach v --remote 10.77.0.2:10809 --export v)
test -b "$DEV"; case $DEV in /dev/nbd*) ;; *) echo "expected an NBD device, got $DEV"; exit 1;; esac
fb attachments | grep -q "nbd via 10.77.0.2:10809" || { fb attachments; echo "attachment does not say it is remote"; exit 1; }
fio_verify "$DEV"

step "ext4: files, detach, attach again, compare"
mkfs.ext4 -q -F "$DEV"; mkdir -p /mnt/remote; mount "$DEV" /mnt/remote
write_tree /mnt/remote; sums /mnt/remote > /tmp/remote.sums
sync; umount /mnt/remote; fb detach "$DEV" >/dev/null
DEV=$(fb attach v --remote 10.77.0.2:10809 --export v 2>/dev/null); mount "$DEV" /mnt/remote
(cd /mnt/remote && sha256sum --quiet -c /tmp/remote.sums)

step "node-a grows the volume; node-b's device follows, ext4 grows online"
fa volume resize v 512M >/dev/null
[ "$(blockdev --getsize64 "$DEV")" = $((256 << 20)) ]
fb refresh "$DEV" >/dev/null
[ "$(blockdev --getsize64 "$DEV")" = $((512 << 20)) ] || { echo "device did not take the new size"; exit 1; }
resize2fs "$DEV" >/dev/null 2>&1
[ "$(df -B1M --output=size /mnt/remote | tail -1)" -gt 400 ] || { df /mnt/remote; echo "ext4 did not grow"; exit 1; }
(cd /mnt/remote && sha256sum --quiet -c /tmp/remote.sums)

step "node-a's daemon replaced three times under fio on the relayed device: a pause, no error"
restart_a() {
  kill -"$1" $A; wait $A 2>/dev/null || true
  DAEMON_BIN=$(next_binary) start_a
  for _ in $(seq 300); do fa pool status >/dev/null 2>&1 && return 0; sleep 0.2; done
  echo "node-a did not start"; tail -30 $D/a.log; exit 1
}
fa volume create io 256M >/dev/null
fa export nbd io --allow node-b >/dev/null
IODEV=$(fb attach io --remote 10.77.0.2:10809 --export io)
restarts_under_io "$IODEV" restart_a
grep -c "kernel NBD device reconnected" $D/b.log
fb detach "$IODEV" >/dev/null

step "an export granted to another node is refused"
fa export nbd v --name for-c --allow node-c >/dev/null
if err=$(fb attach v-c --remote 10.77.0.2:10809 --export for-c 2>&1); then
  echo "attached an export granted to node-c: $err"; exit 1
fi
echo "refused: $err"
case $err in *for-c*) ;; *) echo "the error does not name the export"; exit 1;; esac
fb attachments | grep -q v-c && { echo "a refused attach left an attachment"; exit 1; }

step "stopping the export holds the device's I/O for device-hold-s ($HOLD s), then fails it"
fa export stop v >/dev/null
t0=$(date +%s)
rc=0; timeout 120 dd if="$DEV" of=/dev/null bs=4k count=1 skip=12345 iflag=direct 2>/dev/null || rc=$?
held=$(( $(date +%s) - t0 ))
echo "read ended with $rc after $held s"
[ "$rc" != 0 ] || { echo "a read went through after the export stopped"; exit 1; }
[ "$rc" != 124 ] || { echo "the read hung past the hold time"; exit 1; }
[ "$held" -ge $((HOLD - 2)) ] || { echo "the read failed before the hold time"; exit 1; }
umount -l /mnt/remote
fb detach "$DEV" >/dev/null
fb attachments | grep -q "10.77.0.2" && { echo "attachment left behind"; exit 1; }

step "both daemons stop cleanly"
kill -TERM $B; wait $B || { echo "node-b exited with $?"; cat $D/b.log; exit 1; }
kill -TERM $A; wait $A || { echo "node-a exited with $?"; cat $D/a.log; exit 1; }
ip netns del node-a

step "the CSI path: a node without the volume stages it from its primary"
BIN=$(cat .vm-daemon-tests)
(cd /tmp && timeout 600 "$BIN" --ignored --exact kubernetes::csi_node::a_node_without_the_volume_stages_it_from_its_primary --nocapture)
step "the CSI path: a node without storage (no daemon) stages it in its node plugin, which survives kill -9"
(cd /tmp && timeout 600 "$BIN" --ignored --exact kubernetes::csi_node::a_node_without_storage_stages_it_from_its_primary --nocapture)
echo "REMOTE_NBD_OK"
