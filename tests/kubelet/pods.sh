#!/usr/bin/env bash
# pods.sh: Ferrite volumes in pods, through the kubelet of the cluster up.sh brought up. Filesystem
# claims (ext4, xfs) written by one pod and read back by the next; a raw block claim; fsGroup; a
# snapshot restored and a clone; online expansion seen in the pod; and, under a pod writing and
# checking what it wrote, the kubelet restarted, the node plugin's pod deleted and the daemon's
# pod replaced (as an upgrade does); at the end no device and no mount of ours left on the node.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$HERE/lib.sh"
. "$STATE/node.env"
export KUBECONFIG=$STATE/admin.kubeconfig
IMAGE=$REGISTRY/$BUSYBOX_IMAGE
NS=pods
k() { kubectl -n "$NS" "$@"; }
# inpod POD COMMAND: runs COMMAND (sh) in POD's container.
inpod() { k exec "$1" -- sh -c "$2"; }
fail() { echo "pods: $*" >&2; k get pods,pvc -o wide >&2 || true; exit 1; }

# claim NAME CLASS SIZE [Block] [DATASOURCE-KIND DATASOURCE-NAME]
claim() {
  local source=""
  [ -z "${5:-}" ] || source="dataSource: {kind: $5, name: $6${7:+, apiGroup: $7}}"
  k apply -f - > /dev/null <<EOF
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: $1}
spec:
  storageClassName: $2
  accessModes: [ReadWriteOnce]
  volumeMode: ${4:-Filesystem}
  resources: {requests: {storage: $3}}
  $source
EOF
}

# pod NAME CLAIM [block] [SECURITY-CONTEXT] [COMMAND]: a busybox pod with CLAIM at /data (or as
# the device /dev/xvda), running COMMAND (default: sleep); waits until it is Ready.
pod() {
  local volume="volumeMounts: [{name: v, mountPath: /data}]"
  [ "${3:-}" != block ] || volume="volumeDevices: [{name: v, devicePath: /dev/xvda}]"
  k apply -f - > /dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $1}
spec:
  terminationGracePeriodSeconds: 5
  securityContext: {${4:-}}
  containers:
    - name: c
      image: $IMAGE
      command: [sh, -c, '${5:-exec sleep 100000}']
      $volume
  volumes: [{name: v, persistentVolumeClaim: {claimName: $2}}]
EOF
  k wait --for=condition=Ready "pod/$1" --timeout=600s > /dev/null || fail "pod $1 is not Ready"
}

gone() { k delete pod "$@" --wait --timeout=300s > /dev/null; }
sums() { inpod "$1" 'cd /data && sha256sum -c blob.sum' > /dev/null || fail "$1: the data read back differs"; }

kubectl create namespace "$NS" > /dev/null

for fs in ext4 xfs; do
  step "$fs: a pod writes, is deleted; the next pod reads the data back"
  claim "$fs" "ferrite-$fs" 1Gi
  pod "w-$fs" "$fs"
  inpod "w-$fs" 'head -c 16777216 /dev/urandom > /data/blob && cd /data && sha256sum blob > blob.sum && sync'
  [ "$(inpod "w-$fs" "grep ' /data ' /proc/mounts | cut -d' ' -f3")" = "$fs" ] || fail "/data is not $fs"
  gone "w-$fs"
  pod "r-$fs" "$fs"
  sums "r-$fs"
done

step "block: a raw device in the pod, written and read back"
claim raw ferrite-block 256Mi Block
pod raw raw block
inpod raw 'head -c 8388608 /dev/urandom > /tmp/x && dd if=/tmp/x of=/dev/xvda bs=1M conv=fsync 2>/dev/null &&
  [ "$(dd if=/dev/xvda bs=1M count=8 2>/dev/null | sha256sum)" = "$(sha256sum < /tmp/x)" ]' || fail "the block device read back differs"
[ "$(inpod raw 'test -b /dev/xvda && echo block')" = block ] || fail "/dev/xvda is not a block device"

step "fsGroup: the volume's group, writable by the pod's user"
claim grouped ferrite-ext4 256Mi
pod grouped grouped "" "runAsUser: 1000, runAsGroup: 1000, fsGroup: 2000"
[ "$(inpod grouped 'stat -c %g /data')" = 2000 ] || fail "the volume's root is not in the fsGroup"
inpod grouped 'touch /data/mine && [ "$(stat -c %u:%g /data/mine)" = 1000:2000 ]' || fail "the pod's user cannot write with its fsGroup"

step "snapshot: restored into a new claim and mounted"
k apply -f - > /dev/null <<EOF
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata: {name: snap}
spec: {volumeSnapshotClassName: ferrite, source: {persistentVolumeClaimName: ext4}}
EOF
k wait --for=jsonpath='{.status.readyToUse}'=true volumesnapshot/snap --timeout=300s > /dev/null || fail "the snapshot is not ready"
claim restored ferrite-ext4 1Gi Filesystem VolumeSnapshot snap snapshot.storage.k8s.io
pod restored restored
sums restored

step "clone: a claim from a claim"
claim cloned ferrite-xfs 1Gi Filesystem PersistentVolumeClaim xfs
pod cloned cloned
sums cloned

step "expansion: online where the node's kernel grows a ublk device (6.16+), else at the next staging"
size() { inpod "$1" "df -k /data | awk 'NR==2 {print \$2}'"; }
before=$(size r-ext4)
k patch pvc ext4 -p '{"spec": {"resources": {"requests": {"storage": "2Gi"}}}}' > /dev/null
kernel=$(on_node 'uname -r')
if [ "$(printf '%s\n' 6.16 "$kernel" | sort -V | head -1)" != 6.16 ]; then
  # The node plugin says why, and the kubelet finishes the resize when the volume is staged again.
  until_ok 300 "the node plugin's refusal to grow online on $kernel" sh -c \
    "kubectl -n $NS get pvc ext4 -o jsonpath='{.status.conditions}' | grep -q 'cannot grow it online'"
  gone r-ext4
  pod r-ext4 ext4
fi
end=$((SECONDS + 300))
until [ "$(size r-ext4)" -gt $((before + 900000)) ]; do
  [ $SECONDS -lt $end ] || fail "the pod's filesystem did not grow (before: $before KiB, kernel $kernel)"
  sleep 2
done
sums r-ext4

# A pod that appends a counter and syncs it: an I/O error ends it (restarts > 0), and a line lost
# or repeated shows in the file.
step "under a writing pod: the kubelet restarted"
claim busy ferrite-ext4 512Mi
pod busy busy "" "" 'i=0; while :; do i=$((i+1)); echo $i >> /data/count && sync /data/count || exit 1; sleep 0.2; done'
lines() { inpod busy 'wc -l < /data/count'; }
grows() { # WHAT
  local a; a=$(lines); sleep 3
  [ "$(lines)" -gt "$a" ] || fail "the writing pod stopped writing ($1)"
}
grows "before"
on_node 'pkill -x kubelet; while pgrep -x kubelet > /dev/null; do sleep 0.2; done; /run/node/kubelet &' > /dev/null
until_ok 300 "exec through the restarted kubelet" inpod busy true
grows "the kubelet restarted"

step "under a writing pod: the node plugin's pod deleted and made again"
kubectl -n ferrite delete pod -l app.kubernetes.io/name=ferrite-node-plugin --wait --timeout=300s > /dev/null
ready ferrite ferrite-node-plugin 600
grows "the node plugin replaced"

step "under a writing pod: the daemon's pod replaced, as an upgrade does"
# (OnDelete: a new daemon image takes effect when its pod is deleted; docs/kubernetes.md, "Upgrade")
kubectl -n ferrite delete pod -l app.kubernetes.io/name=ferrite-daemon --wait --timeout=300s > /dev/null
ready ferrite ferrite-daemon 900
grows "the daemon replaced"
[ "$(k get pod busy -o jsonpath='{.status.containerStatuses[0].restartCount}')" = 0 ] || fail "the writing pod saw an I/O error"
# (one copy read: the pod keeps appending)
inpod busy 'cp /data/count /tmp/count && seq "$(wc -l < /tmp/count)" | cmp -s - /tmp/count' ||
  fail "the counter file lost or repeated a line"

step "pods deleted: no device and no mount of ours left on the node"
k delete pod --all --wait --timeout=600s > /dev/null
# A pod is gone once unpublished; the kubelet unstages after, and then lists no volume in use.
until_ok 300 "the kubelet to unstage every volume" \
  sh -c "[ -z \"\$(kubectl get node $NODE -o jsonpath='{.status.volumesInUse}')\" ]"
left=$(on_node 'ls /dev/ublkb* 2>/dev/null; grep -E "csi.ferrite.dev|/dev/ublkb|/dev/nbd" /proc/mounts' || true)
[ -z "$left" ] || fail "left on the node after its pods were deleted: $left"
k delete volumesnapshot --all --wait --timeout=300s > /dev/null
k delete pvc --all --wait --timeout=300s > /dev/null
until_ok 300 "every volume deleted (their PersistentVolumes gone)" sh -c "[ -z \"\$(kubectl get pv -o name)\" ]"
kubectl delete namespace "$NS" --wait --timeout=300s > /dev/null
step "pods: every scenario passed"
