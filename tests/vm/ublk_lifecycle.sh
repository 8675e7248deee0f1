# In the guest (run by tests/vm/guest.sh): Ferrite volumes as ublk block devices.
# fio verify on /dev/ublkbN; ext4 and xfs: mkfs, files, detach, re-attach, compare checksums;
# fstrim + reclaim gives space back; a snapshot attaches read-only; kill -9 of the daemon with a
# mounted filesystem under I/O, restart: device and mount survive, flushed data intact; kill -9
# right after writes no flush covered (raw device and ext4 files): every one reads back, and
# fsck finds the filesystem clean; a clean
# daemon restart keeps the device too; growing a volume (online where the kernel has UPDATE_SIZE,
# else the fallback), and the grown device kept through two more restarts; the daemon replaced three times under fio on ext4: a pause, no I/O error;
# a daemon that never comes back: the watchdog fails the held I/O with EIO after the hold (timed).
set -euo pipefail
D=/tmp/ferrite-ublk; mkdir -p $D
DEV_PREFIX=/dev/ublkb
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
trap 'echo "--- daemon log"; tail -40 $D/daemon.log' ERR
modprobe ublk_drv
start_daemon 'pool-size = "2G"\nsegment-size = "4M"\nlog-level = "info,ferrite_ublk=debug"\nublk-queues = 2\nublk-depth = 32\n'

step "auto transport picks ublk; fio verify on the raw device"
f volume create raw 256M >/dev/null
attach raw 2> $D/attach.txt
cat $D/attach.txt
grep -q "using \[USER_RECOVERY" $D/attach.txt
[ "$(blockdev --getsize64 "$DEV")" = $((256 << 20)) ]
[ "$(cat /sys/block/$(basename "$DEV")/queue/logical_block_size)" = 512 ]
[ "$(cat /sys/block/$(basename "$DEV")/queue/physical_block_size)" = 4096 ]
grep -q "write back" /sys/block/$(basename "$DEV")/queue/write_cache
[ "$(cat /sys/block/$(basename "$DEV")/queue/discard_granularity)" = 4096 ]
fio_verify "$DEV"
timeout 300 fio --name=m --filename="$DEV" --ioengine=libaio --direct=1 --rw=randrw --bs=512 \
  --iodepth=8 --offset=128M --size=4M --verify=crc32c --verify_fatal=1 --verify_state_save=0 --eta=never --output=/dev/null
blkdiscard -o $((64 << 20)) -l $((32 << 20)) "$DEV"
[ "$(dd if="$DEV" bs=1M skip=64 count=1 iflag=direct status=none | tr -d '\0' | wc -c)" = 0 ]
f attachments | grep -q "$DEV"
detach "$DEV"
[ ! -e "$DEV" ]
echo "detach with nothing attached fails cleanly:"
! f detach "$DEV"

fs_lifecycle ext4
fs_lifecycle xfs
encrypted_lifecycle

step "snapshot attached read-only; attached things cannot be deleted"
snapshot_mount
! f snapshot delete s1 2> $D/err.txt
grep -q "detach it first" $D/err.txt
umount /mnt/snap; detach ext4@s1

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
  umount /mnt/ext4; detach ext4; attach ext4 2>/dev/null; UDEV=$DEV
  [ "$(blockdev --getsize64 "$UDEV")" = $((768 << 20)) ]
  mount "$UDEV" /mnt/ext4
fi
resize2fs "$UDEV"
[ "$(df -B1M --output=size /mnt/ext4 | tail -1)" -gt 700 ]
(cd /mnt/ext4 && sha256sum --quiet -c /tmp/all.sums)
step "a grown device survives the daemon's restarts (SIGTERM, then kill -9)"
kill -TERM $DAEMON; wait $DAEMON; start_daemon
kill -9 $DAEMON; wait $DAEMON 2>/dev/null || true; start_daemon
[ "$(blockdev --getsize64 "$UDEV")" = $((768 << 20)) ]
head -c 4M /dev/urandom > /mnt/ext4/after-grow; sync -f /mnt/ext4
sleep 3; f attachments | grep -q "$UDEV"
(cd /mnt/ext4 && sha256sum --quiet -c /tmp/all.sums)
umount /mnt/ext4
# Everything above, kills included, left a consistent filesystem.
fsck.ext4 -n -f "$UDEV"
detach "$UDEV"

# kill_recover: kill -9 of the daemon half a second after the writes, restart; the devices are
# recovered (a failure shows the daemon's log).
kill_recover() {
  sleep 0.5
  kill -9 $DAEMON; wait $DAEMON 2>/dev/null || true
  start_daemon
  [ "$(grep -c "ublk device recovered" $D/daemon.log)" -gt "$1" ] || { tail -40 $D/daemon.log; exit 1; }
}

step "kill -9 right after writes no flush covered, raw device: every acknowledged block comes back"
# 32 MiB of O_DIRECT writes, acknowledged and never flushed (a holder process keeps the device
# open, so no last close syncs it; not this shell, whose open files the next daemon would
# inherit, and a daemon holding its own device cannot delete it), then the kill; the same device
# reads every block back.
f volume create unsynced 64M >/dev/null
attach unsynced 2>/dev/null; RDEV=$DEV
head -c 32M /dev/urandom > $D/unsynced.bin
( exec 7<>"$RDEV"; exec sleep 3600 ) &
HOLDER=$!
dd if=$D/unsynced.bin of="$RDEV" bs=4k oflag=direct status=none
kill_recover "$(grep -c "ublk device recovered" $D/daemon.log)"
kill $HOLDER; wait $HOLDER 2>/dev/null || true
dd if="$RDEV" bs=1M count=32 iflag=direct status=none | cmp - $D/unsynced.bin
detach "$RDEV" || { tail -40 $D/daemon.log; exit 1; }
f volume delete unsynced >/dev/null; rm -f $D/unsynced.bin

step "kill -9 right after writes no flush covered, ext4: every file comes back, fsck clean"
# Files written with O_DIRECT and no sync: their blocks went to the device, and only the journal
# and the page cache know of them.
attach ext4 2>/dev/null; UDEV=$DEV
mount "$UDEV" /mnt/ext4
mkdir -p /mnt/ext4/unsynced
for i in $(seq 16); do
  head -c $((i * 64 * 1024)) /dev/urandom > $D/u$i
  dd if=$D/u$i of=/mnt/ext4/unsynced/u$i bs=64k oflag=direct status=none
done
kill_recover "$(grep -c "ublk device recovered" $D/daemon.log)"
echo 3 > /proc/sys/vm/drop_caches
for i in $(seq 16); do cmp /mnt/ext4/unsynced/u$i $D/u$i; done
(cd /mnt/ext4 && sha256sum --quiet -c /tmp/all.sums)
umount /mnt/ext4
fsck.ext4 -n -f "$UDEV"
detach "$UDEV" || { tail -40 $D/daemon.log; exit 1; }
rm -f $D/u[0-9]*
echo "every acknowledged block read back after kill -9 (raw device, ext4 files)"

step "QoS on a ublk device: 300 write IOPS hold over 10 s; a change applies within a second"
f volume create qos 64M --write-iops 300 --burst 250ms >/dev/null
attach qos 2>/dev/null; QDEV=$DEV
q="--filename=$QDEV --ioengine=libaio --direct=1 --rw=randwrite --bs=4k --iodepth=16 --size=32M --time_based"
# Terse output: field 49 is the write IOPS (the first second, burst included, is not counted).
iops=$(timeout 120 fio --name=q $q --runtime=10 --ramp_time=1 --minimal | awk -F';' '{printf "%d", $49}')
echo "limited to 300: $iops IOPS"
[ "$iops" -ge 285 ] && [ "$iops" -le 315 ]
start=$(date +%s%N)
timeout 120 fio --name=c $q --runtime=10 --log_avg_msec=250 --write_iops_log=$D/qos --eta=never --output=/dev/null &
FIO=$!
sleep 4; f volume set qos --write-iops 600 >/dev/null
changed=$((($(date +%s%N) - start) / 1000000)) # ms into the run: the CLI itself takes ~1 s here
wait $FIO
# Mean of the samples from 1.25 s after the change (the new limit's 250 ms burst spent) to the
# end. A window fixed at 5.25 s counted the burst whenever the CLI was slow: 658 IOPS once on 6.17.
after=$(awk -F', *' -v from=$((changed + 1250)) '$1 > from { s += $2; n++ } END { printf "%d", n ? s / n : 0 }' $D/qos_iops.1.log)
echo "after the change to 600: $after IOPS"
[ "$after" -ge 570 ] && [ "$after" -le 630 ]
detach "$QDEV"

step "the daemon replaced three times under fio on ext4: a pause, no error"
f volume create io 256M >/dev/null
attach io 2>/dev/null; IODEV=$DEV
restarts_under_io "$IODEV" restart_local
detach "$IODEV"

step "a daemon that never comes back: the watchdog fails its device's I/O (EIO) after device-hold-s"
echo 'device-hold-s = 6' >> $D/ferrite.toml
kill -TERM $DAEMON; wait $DAEMON; start_daemon
f volume create held 64M >/dev/null
attach held 2>/dev/null; HDEV=$DEV; HID=${HDEV#/dev/ublkb}
mkfs.ext4 -q -F "$HDEV"; mkdir -p /mnt/held; mount "$HDEV" /mnt/held
grep -q "\"id\": $HID" $D/ublk-hold.json
"$FERRITE" watchdog >> $D/watchdog.log 2>&1 &
DOG=$!
kill -9 $DAEMON; wait $DAEMON 2>/dev/null || true
t0=$(date +%s%N)
if timeout 60 dd if=/dev/urandom of=/mnt/held/f bs=64k count=1 oflag=direct 2> $D/held.err; then
  echo "a write succeeded with no daemon"; exit 1
fi
held_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
cat $D/held.err
grep -q "Input/output error" $D/held.err
echo "held I/O failed with EIO after $held_ms ms (device-hold-s = 6)"
[ "$held_ms" -ge 5000 ] && [ "$held_ms" -le 15000 ]
grep "ublk device failed" $D/watchdog.log
timeout 30 umount /mnt/held 2>/dev/null || umount -l /mnt/held
for _ in $(seq 50); do [ -e /sys/class/ublk-char/ublkc$HID ] || break; sleep 0.2; done
[ ! -e /sys/class/ublk-char/ublkc$HID ] || { echo "the failed device was not deleted"; exit 1; }
start_daemon
grep -q "ublk device is gone; not recovering it" $D/daemon.log
kill $DOG; wait $DOG 2>/dev/null || true

step "scrub, clean shutdown"
f pool scrub 2>/dev/null
stop_daemon
echo "UBLK_LIFECYCLE_OK"
