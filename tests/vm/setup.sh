#!/usr/bin/env bash
# Prepares the QEMU guest for the tests that need real kernel block devices (ublk, kernel NBD):
# qemu-system-x86 (bookworm-backports, TCG: this machine kind has no usable KVM), a Debian
# kernel *extracted, not installed* (ublk_drv and nbd as modules) and a busybox initramfs that
# boots into the host's root filesystem (9p, read-only, tmpfs overlay), so host-built binaries
# run in the guest unchanged. Idempotent; everything lives in $FERRITE_VM_DIR.
#
# FERRITE_VM_KERNEL picks the kernel: 6.12 (default; bookworm-backports, what most users run:
# ublk with user recovery, no QUIESCE or UPDATE_SIZE) or 6.17 (trixie-backports, read through a
# private apt state so the host's is untouched: QUIESCE, USER_RECOVERY_FAIL_IO, UPDATE_SIZE).
# FERRITE_VM_DIR defaults to ~/.cache/ferrite/vm (6.12) or ~/.cache/ferrite/vm-6.17.
#
# Exits 0 with a "SKIPPED:" line when it cannot work here (not root, no apt, no network, no
# kernel package), so callers can skip instead of failing.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
KERNEL=${FERRITE_VM_KERNEL:-6.12}
case $KERNEL in
  6.12) VMDIR=${FERRITE_VM_DIR:-$HOME/.cache/ferrite/vm} ;;
  6.17) VMDIR=${FERRITE_VM_DIR:-$HOME/.cache/ferrite/vm-6.17} ;;
  *) echo "FERRITE_VM_KERNEL must be 6.12 or 6.17, not $KERNEL" >&2; exit 2 ;;
esac
skip() { echo "SKIPPED: VM harness unavailable: $*"; exit 0; }
[ "$(id -u)" = 0 ] || skip "needs root to install packages"
command -v apt-get >/dev/null || skip "no apt-get"
[ "$(uname -m)" = x86_64 ] || skip "x86_64 only"
mkdir -p "$VMDIR"; cd "$VMDIR"
if [ -f ready ] && [ -d kernel/boot ] && [ -f initrd.img ] && command -v qemu-system-x86_64 >/dev/null \
  && command -v dmsetup >/dev/null; then
  # A changed initramfs recipe is rebuilt; nothing else needs redoing.
  [ initrd.img -nt "$HERE/mkinitrd.sh" ] || bash "$HERE/mkinitrd.sh" "$VMDIR/kernel" "$VMDIR/initrd.img"
  echo "vm: ready in $VMDIR"; exit 0
fi
export DEBIAN_FRONTEND=noninteractive
echo "vm: installing qemu-system-x86 (bookworm-backports) and guest tools..." >&2
if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [ -n "$uri" ] || uri=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$uri" ] || skip "cannot find the Debian mirror to add bookworm-backports"
  printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$uri" > /etc/apt/sources.list.d/bookworm-backports.sources
fi
timeout 600 apt-get update -q >/dev/null || skip "apt-get update failed (offline?)"
# The backports qemu-utils this machine kind ships conflicts with bookworm's qemu-system 7.2.
timeout 900 apt-get install -y -q --no-install-recommends -t bookworm-backports qemu-system-x86 >/dev/null \
  || skip "cannot install qemu-system-x86 from bookworm-backports"
timeout 900 apt-get install -y -q --no-install-recommends kmod busybox-static xz-utils cpio nbd-client \
  e2fsprogs xfsprogs util-linux fio dmsetup >/dev/null || skip "cannot install the guest tools"
if [ ! -d kernel/boot ] && [ "$KERNEL" = 6.12 ]; then
  echo "vm: downloading the bookworm-backports kernel (extracted here, not installed)..." >&2
  pkg=$(apt-cache show linux-image-amd64 | awk '/^Version:/{v=$2} /^Depends:/ && v ~ /bpo12/ {print $2; exit}')
  [ -n "$pkg" ] || skip "no bookworm-backports kernel package"
  rm -rf kernel dl; mkdir -p dl
  (cd dl && timeout 600 apt-get download "$pkg" >/dev/null 2>&1) || skip "cannot download $pkg"
  dpkg-deb -x dl/"$pkg"_*.deb kernel
  rm -rf dl
elif [ ! -d kernel/boot ]; then
  echo "vm: downloading the trixie-backports 6.17 kernel (extracted here, not installed)..." >&2
  uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  [ -n "$uri" ] || uri=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$uri" ] || skip "cannot find the Debian mirror to reach trixie-backports"
  apt_dir=$VMDIR/apt; mkdir -p "$apt_dir/lists/partial"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $uri trixie-backports main" > "$apt_dir/sources.list"
  apt_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=- -o "Dir::State::Lists=$apt_dir/lists"
    -o APT::Get::List-Cleanup=0)
  timeout 600 apt-get "${apt_opts[@]}" update -q >/dev/null || skip "apt-get update of trixie-backports failed"
  pkg=$(apt-cache "${apt_opts[@]}" pkgnames linux-image-6.17 | grep -E '^linux-image-6\.17\.[0-9.]+\+deb13-amd64$' | sort -V | tail -1)
  [ -n "$pkg" ] || skip "no linux-image-6.17 package in trixie-backports"
  rm -rf kernel dl; mkdir -p dl
  (cd dl && timeout 900 apt-get "${apt_opts[@]}" download "$pkg" >/dev/null 2>&1) || skip "cannot download $pkg"
  dpkg-deb -x dl/"$pkg"_*.deb kernel
  # Merged /usr: the modules are under usr/lib; depmod -b and the initramfs expect lib/modules.
  [ -e kernel/lib ] || ln -s usr/lib kernel/lib
  rm -rf dl
fi
V=$(ls kernel/lib/modules)
depmod -b "$VMDIR/kernel" "$V"
grep -q '^CONFIG_BLK_DEV_UBLK=m' "kernel/boot/config-$V" || skip "kernel $V has no ublk module"
grep -q '^CONFIG_BLK_DEV_NBD=m' "kernel/boot/config-$V" || skip "kernel $V has no nbd module"
bash "$HERE/mkinitrd.sh" "$VMDIR/kernel" "$VMDIR/initrd.img"
touch ready
echo "vm: ready in $VMDIR (kernel $V)"
