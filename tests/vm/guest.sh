# Everything that needs kernel block devices, in one guest boot per kernel (booting under TCG is
# the slow part). On every kernel: the ublk lifecycle and the CSI node lifecycle on ublk (6.17
# adds ublk's QUIESCE and UPDATE_SIZE), and a power cut replayed at the pool's flush points on
# dm-log-writes (the pool on the raw device on 6.12, as a file on ext4 on newer kernels; both in
# the long mode). On 6.12, what most users run, the kernel NBD client too, which newer kernels
# do not change for us: with ublk_drv unloaded (the fallback `ferrite attach` takes without
# ublk) the NBD lifecycle and the CSI node lifecycle again, and another node's volume relayed
# over TLS to that client, following its primary in a failover.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
echo "guest kernel $(uname -r)"
rm -f .vm-ferrite-next  # made again from this build when a test first replaces a daemon
# Each part's time, so a slow machine shows where its budget went.
part() { local t=$SECONDS; bash "$HERE/$1" "${@:2}"; echo "guest: $1 ${*:2} took $((SECONDS - t)) s (at $SECONDS s)"; }
part ublk_lifecycle.sh
part csi_node.sh
case $(uname -r) in
  6.12.*)
    modprobe -r ublk_drv
    [ ! -e /dev/ublk-control ]
    part nbd_lifecycle.sh
    part remote_nbd.sh
    part relay_failover.sh
    part csi_node.sh
    layouts=raw ;;
  *) layouts=file ;;
esac
[ ! -f .vm-long ] || layouts=raw,file
part power_cut.sh "$layouts"
echo "GUEST_SUITE_OK"
