#!/usr/bin/env bash
# down.sh: ends the cluster up.sh brought up and removes what it made (processes, the guest, the
# tap device, the state directory). Safe to run twice, or after a failed up.sh.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$HERE/lib.sh"
[ -d "$STATE" ] || exit 0
if [ -f "$STATE/guest.pid" ]; then
  # The node stops its pods, kubelet and containerd, then powers off.
  touch "$STATE/ctl/stop"
  for _ in $(seq 90); do kill -0 "$(cat "$STATE/guest.pid")" 2>/dev/null || break; sleep 1; done
fi
for f in "$STATE"/*.pid; do
  [ -f "$f" ] || continue
  kill -TERM -- "-$(cat "$f")" 2>/dev/null
done
sleep 1
for f in "$STATE"/*.pid; do [ -f "$f" ] && kill -KILL -- "-$(cat "$f")" 2>/dev/null; done
ip link del "$TAP" 2>/dev/null
rm -f "$STATE/up" "$STATE"/*.pid
[ -n "${KEEP:-}" ] || rm -rf "$STATE"
exit 0
