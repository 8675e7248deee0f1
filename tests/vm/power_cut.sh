# In the guest: the power-cut replay test (daemon/tests/data_path/power_cut.rs, `#[ignore]`d on hosts
# without dm-log-writes): the pool and its catalog on dm-log-writes, a workload through the
# daemon, then the device rebuilt at flush points (every one with FERRITE_LONG=1), each opened
# by a fresh daemon and checked. $1: the layouts (raw, file, or raw,file: the default).
set -euo pipefail
BIN=$(cat .vm-daemon-tests)
limit=900
if [ -f .vm-long ]; then export FERRITE_LONG=1; limit=9000; fi
export FERRITE_POWER_CUT_LAYOUTS=${1:-raw,file}
cd /tmp
timeout "$limit" "$BIN" --ignored --exact data_path::power_cut::power_cut_replayed_at_flush_points --nocapture --test-threads 1
