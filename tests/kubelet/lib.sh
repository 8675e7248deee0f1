# Sourced by up.sh, down.sh and the scenarios: where the one-node cluster lives and how to reach it.
STATE=${FERRITE_KUBELET_DIR:-/tmp/ferrite-kubelet}
TAP=fkube0
NODE=ferrite-node
ETCD_PORT=23790 REGISTRY_PORT=5443
# The e2e suite's names and tags for them (test/utils/image/manifest.go of v1.36).
PAUSE_IMAGE=pause:3.10.2
BUSYBOX_IMAGE=e2e-test-images/busybox:1.37.0-1
AGNHOST_IMAGE=e2e-test-images/agnhost:2.63.0
# The e2e suite's "exec of files on the volume" specs run their own `sh -c` in this image: the
# static busybox serves under its name (no nginx is needed, nor built here).
NGINX_IMAGE=e2e-test-images/nginx:1.15-4

die() { echo "kubelet tier: $*" >&2; exit 1; }
step() { echo "== $* (at $SECONDS s)" >&2; }

# spawn NAME PROGRAM ARGS...: a control-plane process in the background, its log and pid in $STATE.
spawn() {
  local name=$1; shift
  setsid "$@" > "$STATE/logs/$name.log" 2>&1 < /dev/null &
  echo $! > "$STATE/$name.pid"
}

# until_ok SECONDS WHAT COMMAND...: runs COMMAND until it succeeds, or dies saying WHAT did not come.
until_ok() {
  local limit=$1 what=$2; shift 2
  local end=$((SECONDS + limit))
  until "$@" > /dev/null 2>&1; do
    [ $SECONDS -lt $end ] || die "no $what after $limit s"
    sleep 1
  done
}

# on_node SCRIPT: runs bash SCRIPT (text) on the node as root and prints its output; its exit code
# is the script's. The node polls $STATE/ctl (the directory it shares with this machine).
on_node() {
  local id; id=$(date +%s%N)
  printf '%s\n' "$1" > "$STATE/ctl/$id.sh.tmp" && mv "$STATE/ctl/$id.sh.tmp" "$STATE/ctl/$id.sh"
  local end=$((SECONDS + ${ON_NODE_TIMEOUT:-300}))
  until [ -f "$STATE/ctl/$id.rc" ]; do
    [ $SECONDS -lt $end ] || die "the node did not run: $1"
    sleep 0.5
  done
  cat "$STATE/ctl/$id.out"
  local rc; rc=$(cat "$STATE/ctl/$id.rc")
  rm -f "$STATE/ctl/$id".*
  return "$rc"
}

# ready NAMESPACE LABEL-VALUE SECONDS: waits until pods labelled app.kubernetes.io/name=VALUE exist and are Ready.
ready() {
  until_ok "$3" "pods $2" sh -c "kubectl -n $1 get pod -l app.kubernetes.io/name=$2 -o name | grep -q ."
  kubectl -n "$1" wait --for=condition=Ready pod -l "app.kubernetes.io/name=$2" --timeout="$3s" > /dev/null ||
    die "pods $2 are not Ready: $(kubectl -n "$1" get pod -l "app.kubernetes.io/name=$2" -o wide)"
}
