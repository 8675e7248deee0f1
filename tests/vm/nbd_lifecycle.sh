# In the guest (run by tests/vm/guest.sh, ublk_drv unloaded): Ferrite volumes as kernel NBD block
# devices over the daemon's Unix socket, attached with nbd-client (interop) and with
# `ferrite attach`, which falls back to the kernel NBD client (netlink) without ublk.
# fio verify on the raw device; ext4 and xfs: mkfs, mount, a tree of files, sync, unmount,
# detach, re-attach, mount, compare checksums; fstrim + reclaim gives space back; a snapshot
# attaches read-only.
set -euo pipefail
FERRITE=${FERRITE:-$(cat .vm-ferrite 2>/dev/null || echo /root/.cache/ferrite/target/debug/ferrite)}
D=/tmp/ferrite; mkdir -p $D
printf 'pool-size = "2G"\nsegment-size = "4M"\nlog-level = "warn"\n' > $D/ferrite.toml
"$FERRITE" daemon --config $D/ferrite.toml --data-dir $D > $D/daemon.log 2>&1 &
DAEMON=$!
export FERRITE_ADMIN_SOCKET=$D/admin.sock
for _ in $(seq 300); do "$FERRITE" pool status >/dev/null 2>&1 && break; sleep 0.2; done
f() { timeout 120 "$FERRITE" "$@"; }
step() { echo "== $*"; }
modprobe nbd nbds_max=4
# `ferrite attach` prints the device it made; without ublk it must be a kernel NBD device.
attach() {
  DEV=$(f attach "$1"); test -b "$DEV"
  case $DEV in /dev/nbd*) ;; *) echo "expected the NBD fallback, got $DEV"; exit 1;; esac
}
detach() { f detach "$1" >/dev/null; }
live() { f -o json pool status | sed -n 's/.*"live":\([0-9]*\).*/\1/p'; }

step "fio verify on the raw device (nbd-client)"
f volume create raw 256M >/dev/null; f export nbd raw >/dev/null
timeout 60 nbd-client -u $D/nbd.sock /dev/nbd0 -N raw -b 4096 >/dev/null
timeout 300 fio --name=v --filename=/dev/nbd0 --ioengine=libaio --direct=1 --rw=randwrite --bs=4k \
  --iodepth=16 --size=32M --verify=crc32c --verify_fatal=1 --verify_state_save=0 --eta=never --output=/dev/null
timeout 300 fio --name=s --filename=/dev/nbd0 --ioengine=libaio --direct=1 --rw=write --bs=128k \
  --iodepth=4 --offset=64M --size=32M --verify=crc32c --verify_fatal=1 --verify_state_save=0 --eta=never --output=/dev/null
timeout 60 nbd-client -d /dev/nbd0 >/dev/null

for fs in ext4 xfs; do
  step "$fs: mkfs, files, detach, re-attach, compare (ferrite attach)"
  f volume create "$fs" 512M >/dev/null
  attach "$fs"
  if [ "$fs" = ext4 ]; then mkfs.ext4 -q -F "$DEV"; else mkfs.xfs -q -f "$DEV"; fi
  mkdir -p /mnt/$fs; mount "$DEV" /mnt/$fs
  for i in $(seq 40); do
    mkdir -p /mnt/$fs/d$((i % 5))
    head -c $((i * 37 * 1024)) /dev/urandom > /mnt/$fs/d$((i % 5))/f$i
  done
  head -c 24M /dev/urandom > /mnt/$fs/big
  (cd /mnt/$fs && find . -type f -print0 | sort -z | xargs -0 sha256sum) > /tmp/$fs.sums
  sync; umount /mnt/$fs; detach "$DEV"
  attach "$fs"; mount "$DEV" /mnt/$fs
  (cd /mnt/$fs && sha256sum --quiet -c /tmp/$fs.sums)
  step "$fs: delete files, fstrim, reclaim"
  before=$(live)
  rm -rf /mnt/$fs/big /mnt/$fs/d1 /mnt/$fs/d2; sync
  fstrim -v /mnt/$fs
  f pool reclaim >/dev/null
  after=$(live)
  echo "live bytes: $before -> $after"
  [ "$after" -lt $((before - 20 * 1024 * 1024)) ] || { echo "fstrim gave back too little"; exit 1; }
  umount /mnt/$fs; detach "$DEV"
done

step "snapshot attached read-only"
f snapshot create ext4 s1 >/dev/null
attach ext4@s1
[ "$(blockdev --getro "$DEV")" = 1 ] || { echo "snapshot device is writable"; exit 1; }
mkdir -p /mnt/snap; mount -o ro,noload "$DEV" /mnt/snap
test -f /mnt/snap/d0/f5
umount /mnt/snap; detach "$DEV"

step "scrub, clean shutdown"
f pool scrub 2>/dev/null
kill -TERM $DAEMON
wait $DAEMON || { echo "daemon exited with $?"; cat $D/daemon.log; exit 1; }
echo "NBD_LIFECYCLE_OK"
