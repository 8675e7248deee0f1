# Everything that needs kernel block devices, in one guest boot (booting under TCG is the slow
# part): the ublk lifecycle, then the kernel NBD lifecycle with ublk_drv unloaded, which is the
# fallback `ferrite attach` takes on kernels without ublk.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
echo "guest kernel $(uname -r)"
bash "$HERE/ublk_lifecycle.sh"
modprobe -r ublk_drv
[ ! -e /dev/ublk-control ]
bash "$HERE/nbd_lifecycle.sh"
echo "GUEST_SUITE_OK"
