# In the guest (run by tests/vm/guest.sh): Ferrite volumes as ublk block devices.
# fio verify on /dev/ublkbN; ext4 and xfs: mkfs, files, detach, re-attach, compare checksums;
# fstrim + reclaim gives space back; a snapshot attaches read-only; kill -9 of the daemon with a
# mounted filesystem under I/O, restart: device and mount survive, flushed data intact; a clean
# daemon restart keeps the device too; growing a volume and the resize fallback of this kernel.
set -euo pipefail
FERRITE=${FERRITE:-$(cat .vm-ferrite 2>/dev/null || echo /root/.cache/ferrite/target/debug/ferrite)}
D=/tmp/ferrite-ublk; mkdir -p $D
printf 'pool-size = "2G"\nsegment-size = "4M"\nlog-level = "info,ferrite_ublk=debug"\nublk-queues = 2\nublk-depth = 32\n' > $D/ferrite.toml
export FERRITE_ADMIN_SOCKET=$D/admin.sock
start_daemon() {
  "$FERRITE" daemon --config $D/ferrite.toml --data-dir $D >> $D/daemon.log 2>&1 &
  DAEMON=$!
  for _ in $(seq 300); do "$FERRITE" pool status >/dev/null 2>&1 && return 0; sleep 0.2; done
  echo "daemon did not start"; cat $D/daemon.log; exit 1
}
trap 'echo "--- daemon log"; tail -40 $D/daemon.log' ERR
f() { timeout 120 "$FERRITE" "$@"; }
step() { echo "== $*"; }
attach() { DEV=$(f attach "$@"); test -b "$DEV"; }
live() { f -o json pool status | sed -n 's/.*"live":\([0-9]*\).*/\1/p'; }
sums() { (cd "$1" && find . -type f -print0 | sort -z | xargs -0 sha256sum); }
write_tree() {
  for i in $(seq 40); do
    mkdir -p "$1/d$((i % 5))"
    head -c $((i * 37 * 1024)) /dev/urandom > "$1/d$((i % 5))/f$i"
  done
  head -c 24M /dev/urandom > "$1/big"
}

modprobe ublk_drv
start_daemon

step "auto transport picks ublk; fio verify on the raw device"
f volume create raw 256M >/dev/null
attach raw 2> $D/attach.txt
cat $D/attach.txt
case $DEV in /dev/ublkb*) ;; *) echo "expected a ublk device, got $DEV"; exit 1;; esac
grep -q "using \[USER_RECOVERY" $D/attach.txt
[ "$(blockdev --getsize64 "$DEV")" = $((256 << 20)) ]
[ "$(cat /sys/block/$(basename "$DEV")/queue/logical_block_size)" = 512 ]
[ "$(cat /sys/block/$(basename "$DEV")/queue/physical_block_size)" = 4096 ]
grep -q "write back" /sys/block/$(basename "$DEV")/queue/write_cache
[ "$(cat /sys/block/$(basename "$DEV")/queue/discard_granularity)" = 4096 ]
timeout 300 fio --name=v --filename="$DEV" --ioengine=libaio --direct=1 --rw=randwrite --bs=4k \
  --iodepth=16 --size=32M --verify=crc32c --verify_fatal=1 --verify_state_save=0 --eta=never --output=/dev/null
timeout 300 fio --name=s --filename="$DEV" --ioengine=libaio --direct=1 --rw=write --bs=128k \
  --iodepth=4 --offset=64M --size=32M --verify=crc32c --verify_fatal=1 --verify_state_save=0 --eta=never --output=/dev/null
timeout 300 fio --name=m --filename="$DEV" --ioengine=libaio --direct=1 --rw=randrw --bs=512 \
  --iodepth=8 --offset=128M --size=4M --verify=crc32c --verify_fatal=1 --verify_state_save=0 --eta=never --output=/dev/null
blkdiscard -o $((64 << 20)) -l $((32 << 20)) "$DEV"
[ "$(dd if="$DEV" bs=1M skip=64 count=1 iflag=direct status=none | tr -d '\0' | wc -c)" = 0 ]
f attachments | grep -q "$DEV"
f detach "$DEV" >/dev/null
[ ! -e "$DEV" ]
echo "detach with nothing attached fails cleanly:"
! f detach "$DEV"

for fs in ext4 xfs; do
  step "$fs: mkfs, files, detach, re-attach, compare"
  f volume create "$fs" 512M >/dev/null
  attach "$fs" 2>/dev/null
  if [ "$fs" = ext4 ]; then mkfs.ext4 -q -F "$DEV"; else mkfs.xfs -q -f "$DEV"; fi
  mkdir -p /mnt/$fs; mount "$DEV" /mnt/$fs
  write_tree /mnt/$fs
  sums /mnt/$fs > /tmp/$fs.sums
  sync; umount /mnt/$fs; f detach "$DEV" >/dev/null
  attach "$fs" 2>/dev/null; mount "$DEV" /mnt/$fs
  (cd /mnt/$fs && sha256sum --quiet -c /tmp/$fs.sums)
  step "$fs: delete files, fstrim, reclaim"
  before=$(live)
  rm -rf /mnt/$fs/big /mnt/$fs/d1 /mnt/$fs/d2; sync
  fstrim -v /mnt/$fs
  f pool reclaim >/dev/null
  after=$(live)
  echo "live bytes: $before -> $after"
  [ "$after" -lt $((before - 20 * 1024 * 1024)) ] || { echo "fstrim gave back too little"; exit 1; }
  umount /mnt/$fs; f detach "$DEV" >/dev/null
done

step "snapshot attached read-only; attached things cannot be deleted"
f snapshot create ext4 s1 >/dev/null
attach ext4@s1 2>/dev/null
[ "$(blockdev --getro "$DEV")" = 1 ] || { echo "snapshot device is writable"; exit 1; }
mkdir -p /mnt/snap; mount -o ro,noload "$DEV" /mnt/snap
test -f /mnt/snap/d0/f5
! f snapshot delete s1 2> $D/err.txt
grep -q "detach it first" $D/err.txt
umount /mnt/snap; f detach ext4@s1 >/dev/null

step "kill -9 the daemon under I/O with ext4 mounted; restart recovers the device"
attach ext4 2>/dev/null; UDEV=$DEV
mount "$UDEV" /mnt/ext4
mkdir -p /mnt/ext4/flushed
for i in $(seq 20); do head -c 256K /dev/urandom > /mnt/ext4/flushed/f$i; done
sync -f /mnt/ext4
sums /mnt/ext4/flushed > /tmp/flushed.sums
( i=0; while true; do i=$((i + 1)); head -c 64K /dev/urandom > /mnt/ext4/busy$((i % 50)) || exit 0; done ) &
WRITER=$!
sleep 2
kill -9 $DAEMON; wait $DAEMON 2>/dev/null || true
echo "daemon killed; device still there:"; test -b "$UDEV"
start_daemon
grep -q "ublk device recovered" $D/daemon.log
sleep 2; kill $WRITER; wait $WRITER 2>/dev/null || true
sync -f /mnt/ext4
(cd /mnt/ext4/flushed && sha256sum --quiet -c /tmp/flushed.sums)
head -c 1M /dev/urandom > /mnt/ext4/after; sync -f /mnt/ext4
f attachments | grep -q "$UDEV"

step "clean daemon restart (SIGTERM) keeps the mounted device"
sums /mnt/ext4 > /tmp/all.sums
kill -TERM $DAEMON; wait $DAEMON
start_daemon
echo x > /mnt/ext4/after-term; sync -f /mnt/ext4
(cd /mnt/ext4 && sha256sum --quiet -c /tmp/all.sums)

step "grow while attached: resize2fs after the kernel sees the new size"
f volume resize ext4 768M 2> $D/resize.txt >/dev/null
cat $D/resize.txt
if grep -q "resized online" $D/resize.txt; then
  [ "$(blockdev --getsize64 "$UDEV")" = $((768 << 20)) ]
else
  # This kernel's fallback: the device keeps its size until re-attached.
  grep -q "until it is detached and attached again" $D/resize.txt
  umount /mnt/ext4; f detach ext4 >/dev/null; attach ext4 2>/dev/null; UDEV=$DEV
  [ "$(blockdev --getsize64 "$UDEV")" = $((768 << 20)) ]
  mount "$UDEV" /mnt/ext4
fi
resize2fs "$UDEV"
[ "$(df -B1M --output=size /mnt/ext4 | tail -1)" -gt 700 ]
(cd /mnt/ext4 && sha256sum --quiet -c /tmp/all.sums)
umount /mnt/ext4; f detach "$UDEV" >/dev/null

step "scrub, clean shutdown"
f pool scrub 2>/dev/null
kill -TERM $DAEMON
wait $DAEMON || { echo "daemon exited with $?"; cat $D/daemon.log; exit 1; }
echo "UBLK_LIFECYCLE_OK"
