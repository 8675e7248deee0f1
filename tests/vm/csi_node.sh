# In the guest: the CSI Node lifecycle test (daemon/tests/kubernetes/csi_node.rs, `#[ignore]`d on hosts
# without kernel block devices) on whichever transport `auto` picks now: stage, publish, files,
# snapshot, clone, expand, unpublish/unstage, for ext4, xfs and raw block volumes.
set -euo pipefail
BIN=$(cat .vm-daemon-tests)
cd /tmp
timeout 900 "$BIN" --ignored --exact kubernetes::csi_node::node_lifecycle_on_block_devices --nocapture --test-threads 1
