# Everything that needs kernel block devices, in one guest boot (booting under TCG is the slow
# part): the ublk lifecycle and the CSI node lifecycle on ublk, then both again on the kernel
# NBD client with ublk_drv unloaded, which is the fallback `ferrite attach` takes without ublk,
# and another node's volume relayed over TLS to that client, following its primary in a failover;
# last, a power cut replayed at the pool's flush points on dm-log-writes.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
echo "guest kernel $(uname -r)"
rm -f .vm-ferrite-next  # made again from this build when a test first replaces a daemon
bash "$HERE/ublk_lifecycle.sh"
bash "$HERE/csi_node.sh"
modprobe -r ublk_drv
[ ! -e /dev/ublk-control ]
bash "$HERE/nbd_lifecycle.sh"
bash "$HERE/remote_nbd.sh"
bash "$HERE/relay_failover.sh"
bash "$HERE/csi_node.sh"
bash "$HERE/power_cut.sh"
echo "GUEST_SUITE_OK"
