#!/usr/bin/env bash
# mkinitrd.sh KERNEL_DIR OUT: a tiny initramfs (busybox-static and the 9p/overlay modules,
# decompressed because busybox insmod cannot read .ko.xz) that mounts the host root read-only
# over 9p with a tmpfs overlay, mounts one host directory read-write at its own path, links the
# guest kernel's modules into /lib/modules, runs the test script as root, prints an exit marker
# and powers off.
set -euo pipefail
KROOT=$1 OUT=$2
V=$(ls "$KROOT/lib/modules"); M="$KROOT/lib/modules/$V"
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
mkdir -p "$T"/{bin,dev,proc,sys,newroot,lower,rw,mods}
cp /bin/busybox "$T/bin/busybox"; ln -s busybox "$T/bin/sh"
for m in fs/netfs/netfs net/9p/9pnet net/9p/9pnet_virtio fs/9p/9p fs/overlayfs/overlay; do
  xz -dc "$M/kernel/$m.ko.xz" > "$T/mods/$(basename "$m").ko"
done
echo "$V" > "$T/kver"
cat > "$T/init" <<'INIT'
#!/bin/sh
export PATH=/bin
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
for m in netfs 9pnet 9pnet_virtio 9p overlay; do insmod /mods/$m.ko || echo "insmod $m failed"; done
mount -t 9p -o ro,trans=virtio,version=9p2000.L,msize=512000,cache=loose hostroot /lower || { echo "9p mount failed"; poweroff -f; }
mount -t tmpfs -o mode=0755 rw /rw; mkdir -p /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work root /newroot || { echo "overlay failed"; poweroff -f; }
for d in proc sys dev; do mount --move /$d /newroot/$d; done
mount -t tmpfs -o mode=0755 tmpfs /newroot/run; mkdir -p /newroot/run/lock
mkdir -p /newroot/dev/pts; mount -t devpts devpts /newroot/dev/pts
for w in $(cat /newroot/proc/cmdline); do
  case $w in vmtest.rw=*) RW=${w#vmtest.rw=};; vmtest.mods=*) MODS=${w#vmtest.mods=};; esac
done
[ -n "$RW" ] && [ "$RW" != / ] && mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 hostrw /newroot$RW
mkdir -p /newroot/lib/modules; ln -sfn "$MODS" /newroot/lib/modules/$(cat /kver)
exec switch_root /newroot /bin/sh -c '
  export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TERM=dumb
  ip link set lo up 2>/dev/null
  S=$(sed -n "s/.*vmtest.script=\([^ ]*\).*/\1/p" /proc/cmdline)
  C=$(sed -n "s/.*vmtest.cwd=\([^ ]*\).*/\1/p" /proc/cmdline); cd "${C:-/}"
  /bin/bash "$S" </dev/null; rc=$?
  echo "@@VMTEST_EXIT=$rc@@"; sync; echo o > /proc/sysrq-trigger; sleep 5'
INIT
chmod +x "$T/init"
(cd "$T" && find . | busybox cpio -o -H newc 2>/dev/null | gzip -1) > "$OUT"
