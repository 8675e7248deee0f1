# Everything that needs kernel block devices, in one guest boot (booting under TCG is the slow
# part): the ublk lifecycle and the CSI node lifecycle on ublk, then both again on the kernel
# NBD client with ublk_drv unloaded, which is the fallback `ferrite attach` takes without ublk,
# and another node's volume relayed over TLS to that client, following its primary in a failover;
# last, a power cut replayed at the pool's flush points on dm-log-writes.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
echo "guest kernel $(uname -r)"
rm -f .vm-ferrite-next  # made again from this build when a test first replaces a daemon
# Each part's time, so a slow machine shows where its budget went.
part() { local t=$SECONDS; bash "$HERE/$1" "${@:2}"; echo "guest: $1 ${*:2} took $((SECONDS - t)) s (at $SECONDS s)"; }
part ublk_lifecycle.sh
part csi_node.sh
modprobe -r ublk_drv
[ ! -e /dev/ublk-control ]
part nbd_lifecycle.sh
part remote_nbd.sh
part relay_failover.sh
part csi_node.sh
# The short sample gives each kernel the tier boots one layout (both fit no guest's budget on a
# slow machine); the long mode replays both.
layouts=raw,file
if [ ! -f .vm-long ]; then case $(uname -r) in 6.12.*) layouts=raw ;; *) layouts=file ;; esac; fi
part power_cut.sh "$layouts"
echo "GUEST_SUITE_OK"
