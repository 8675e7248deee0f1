# In the guest (run by tests/vm/guest.sh, ublk_drv unloaded): Ferrite volumes as kernel NBD block
# devices over the daemon's Unix socket, attached with nbd-client (interop) and with
# `ferrite attach`, which falls back to the kernel NBD client (netlink) without ublk.
# fio verify on the raw device; ext4 and xfs: mkfs, mount, a tree of files, sync, unmount,
# detach, re-attach, mount, compare checksums; fstrim + reclaim gives space back; a snapshot
# attaches read-only; an encrypted volume reads and writes the same, across a data-key rotation;
# the daemon replaced three times (SIGTERM, kill -9) under fio on ext4: the device pauses, no
# I/O error.
set -euo pipefail
D=/tmp/ferrite; mkdir -p $D
DEV_PREFIX=/dev/nbd
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
start_daemon 'pool-size = "2G"\nsegment-size = "4M"\nlog-level = "warn,ferrite_daemon::records::attachments=info"\nnbd-device-timeout-s = 5\n'
modprobe nbd nbds_max=4

step "fio verify on the raw device (nbd-client)"
f volume create raw 256M >/dev/null; f export nbd raw >/dev/null
timeout 60 nbd-client -u $D/nbd.sock /dev/nbd0 -N raw -b 4096 >/dev/null
fio_verify /dev/nbd0
timeout 60 nbd-client -d /dev/nbd0 >/dev/null

fs_lifecycle ext4
fs_lifecycle xfs
encrypted_lifecycle

step "snapshot attached read-only"
snapshot_mount
umount /mnt/snap; detach "$DEV"

step "the daemon replaced three times under fio on ext4: a pause, no error"
f volume create io 256M >/dev/null
attach io 2>/dev/null; IODEV=$DEV
restarts_under_io "$IODEV" restart_local
grep -c "kernel NBD device reconnected" $D/daemon.log
detach "$IODEV"

step "scrub, clean shutdown"
f pool scrub 2>/dev/null
stop_daemon
echo "NBD_LIFECYCLE_OK"
