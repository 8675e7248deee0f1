#!/usr/bin/env bash
# run.sh SCRIPT: boots the guest (see setup.sh), runs `bash SCRIPT` as root in it
# (cwd = $PWD, which is mounted read-write at the same path), prints the guest's console and
# exits with the script's exit code (124: timeout, 255: the guest died before finishing).
# If the harness is not set up and cannot be, prints "SKIPPED: ..." and exits 0.
# Env: VM_TIMEOUT (600 s), VM_MEM (3G: the power-cut test keeps device images in memory), VM_CPUS (2), FERRITE_VM_KERNEL (6.12 or 6.17),
# VM_NET: a virtio NIC, on QEMU's user network (`user`: the guest takes 10.0.2.15 and reaches the host's
# loopback at 10.0.2.2) or on a tap device the caller made (`tap:NAME`); VM_DISK=FILE: a virtio disk.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# The kernel (FERRITE_VM_KERNEL) and its directory: as setup.sh picks them.
case ${FERRITE_VM_KERNEL:-6.12} in
  6.12) VMDIR=${FERRITE_VM_DIR:-$HOME/.cache/ferrite/vm} ;;
  *) VMDIR=${FERRITE_VM_DIR:-$HOME/.cache/ferrite/vm-$FERRITE_VM_KERNEL} ;;
esac
SCRIPT=$(readlink -f "${1:?usage: run.sh SCRIPT}")
out=$(bash "$HERE/setup.sh" 2>&1 | tail -1)
case $out in SKIPPED:*) echo "$out"; exit 0;; esac
[ -f "$VMDIR/ready" ] || { echo "SKIPPED: VM harness setup did not finish: $out"; exit 0; }
KROOT=$VMDIR/kernel; V=$(ls "$KROOT/lib/modules")
case ${VM_NET:-} in
  '') net=() ;;
  user) net=(-netdev user,id=net0,ipv6=off -device virtio-net-pci,netdev=net0) ;;
  tap:*) net=(-netdev "tap,id=net0,ifname=${VM_NET#tap:},script=no,downscript=no" -device virtio-net-pci,netdev=net0) ;;
  *) echo "VM_NET: user or tap:NAME, not $VM_NET" >&2; exit 2 ;;
esac
LOG=$(mktemp); trap 'rm -f "$LOG"' EXIT
# Line by line all the way (sed -u, grep --line-buffered): a long guest test's progress shows as it goes.
echo "vm: booting (TCG) to run $(basename "$SCRIPT")..." >&2
timeout --foreground -k 5 "${VM_TIMEOUT:-600}" qemu-system-x86_64 \
  -machine pc -accel tcg,thread=multi -cpu max -smp "${VM_CPUS:-2}" -m "${VM_MEM:-3G}" \
  -nodefaults -no-user-config -display none -no-reboot -serial stdio \
  -kernel "$KROOT/boot/vmlinuz-$V" -initrd "$VMDIR/initrd.img" \
  -append "console=ttyS0 quiet loglevel=1 panic=-1 vmtest.script=$SCRIPT vmtest.cwd=$PWD vmtest.rw=$PWD vmtest.mods=$KROOT/lib/modules/$V" \
  -fsdev local,id=hr,path=/,security_model=none,readonly=on,multidevs=remap \
  -device virtio-9p-pci,fsdev=hr,mount_tag=hostroot \
  -fsdev local,id=hw,path="$PWD",security_model=none,multidevs=remap \
  -device virtio-9p-pci,fsdev=hw,mount_tag=hostrw \
  "${net[@]}" ${VM_DISK:+-drive file=$VM_DISK,if=virtio,format=raw,cache=unsafe,discard=unmap} </dev/null \
  | sed -u 's/\r//g' | grep --line-buffered -vE '\] (sysrq: Power Off|reboot: Power down)$' | tee "$LOG"
qrc=${PIPESTATUS[0]}
rc=$(sed -n 's/.*@@VMTEST_EXIT=\([0-9]*\)@@.*/\1/p' "$LOG" | tail -1)
[ "$qrc" = 124 ] && [ -z "$rc" ] && { echo "vm: timed out after ${VM_TIMEOUT:-600} s" >&2; exit 124; }
exit "${rc:-255}"
