#!/usr/bin/env bash
# node.sh: the cluster's node, in the QEMU guest. tests/vm/run.sh runs it as root with up.sh's
# state directory as its working directory (shared read-write with the host; node.env says
# where everything is). It makes the node as a distribution would: its network (the tap's other
# end, the pods' bridge, the kubernetes Service's address), its disk (/var/lib on a virtio disk),
# cgroup v2, containerd with runc and the CNI plugins, the kubelet; then it runs what the host
# drops into ctl/ (on_node in lib.sh) until ctl/stop appears, and stops.
set -euo pipefail
. ./node.env
export PATH=$NODE_BIN:$PATH
LOGS=$STATE/logs
say() { echo "node: $* (at $SECONDS s)"; }

say "kernel $(uname -r)"
hostname "$NODE"
# loop: the kubelet holds each raw block volume published to a pod open through a loop device.
for m in virtio_net virtio_blk bridge veth overlay br_netfilter nf_conntrack nf_nat xt_MASQUERADE xt_comment \
  xt_mark xt_conntrack xt_addrtype iptable_nat iptable_filter ublk_drv nbd loop; do
  modprobe "$m"
done

# The link to the host (the control plane and the registry are there) and the kubernetes
# Service's address, which a kube-proxy would route: there is none, so one DNAT rule stands in.
sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1
ip link set eth0 up
ip addr add "$GUEST_IP/24" dev eth0
ip route add default via "$HOST_IP"
echo "$GUEST_IP $NODE" >> /etc/hosts # the guest's /etc is its own (an overlay of the host's)
for chain in OUTPUT PREROUTING; do
  iptables -t nat -A "$chain" -d 10.0.0.1/32 -p tcp --dport 443 -j DNAT --to-destination "$HOST_IP:$API_PORT"
done

# /var/lib and /var/log on the node's disk (the guest's root is a tmpfs overlay: overlayfs, which
# containerd stacks image layers with, cannot have another overlay as its upper layer).
mkfs.ext4 -q -F /dev/vda
mkdir -p /node
mount -o discard /dev/vda /node
for d in lib/containerd lib/kubelet lib/ferrite lib/cni log; do
  mkdir -p "/node/$d" "/var/$d"
  mount --bind "/node/$d" "/var/$d"
done
# Bidirectional propagation (the CSI node plugin's mounts reach the kubelet and the pods).
mount --make-rshared /

mount -t cgroup2 none /sys/fs/cgroup
echo "+cpuset +cpu +io +memory +pids" > /sys/fs/cgroup/cgroup.subtree_control

mkdir -p /etc/cni/net.d "/etc/containerd/certs.d/$REGISTRY" /etc/kubernetes
cat > /etc/cni/net.d/10-pods.conflist <<EOF
{"cniVersion": "1.0.0", "name": "pods", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOF
cat > "/etc/containerd/certs.d/$REGISTRY/hosts.toml" <<EOF
server = "https://$REGISTRY"
[host."https://$REGISTRY"]
  capabilities = ["pull", "resolve"]
  ca = "$STATE/certs.d/ca.crt"
EOF
cat > /etc/containerd/config.toml <<EOF
version = 3
root = "/var/lib/containerd"
state = "/run/containerd"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "$PAUSE"
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = "/etc/containerd/certs.d"
[plugins.'io.containerd.cri.v1.runtime']
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      BinaryName = "$NODE_BIN/runc"
      SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["$NODE_BIN/cni"]
    conf_dir = "/etc/cni/net.d"
EOF
cat > /etc/kubernetes/kubelet.yaml <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $STATE/pki/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $STATE/pki/kubelet-serving.crt
tlsPrivateKeyFile: $STATE/pki/kubelet-serving.key
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
failSwapOn: false
serializeImagePulls: false
# A small node: the pods' images and volumes share its one disk.
evictionHard: {memory.available: 100Mi, nodefs.available: 5%, imagefs.available: 5%}
EOF
# How the node's services start (again: a scenario restarts the kubelet through ctl/).
mkdir -p /run/node
cat > /run/node/containerd <<EOF
#!/bin/sh
exec setsid containerd --config /etc/containerd/config.toml >> $LOGS/containerd.log 2>&1 < /dev/null
EOF
cat > /run/node/kubelet <<EOF
#!/bin/sh
exec setsid kubelet --config=/etc/kubernetes/kubelet.yaml --kubeconfig=$STATE/kubelet.kubeconfig \
  --node-ip=$GUEST_IP --hostname-override=$NODE --v=2 >> $LOGS/kubelet.log 2>&1 < /dev/null
EOF
chmod +x /run/node/*
/run/node/containerd &
for _ in $(seq 120); do [ -S /run/containerd/containerd.sock ] && break; sleep 1; done
say "containerd $(containerd --version | awk '{print $3}') up"
/run/node/kubelet &
say "kubelet started"

# Commands from the host, one at a time, until it asks the node to stop.
cd "$STATE/ctl"
while [ ! -e stop ]; do
  for s in *.sh; do
    [ -e "$s" ] || continue
    id=${s%.sh}
    mv "$s" "$id.run"
    bash "$id.run" > "$id.out" 2>&1 && rc=0 || rc=$?
    echo "$rc" > "$id.rc.tmp" && mv "$id.rc.tmp" "$id.rc"
  done
  sleep 0.5
done
say "stopping"
pkill -x kubelet || true
sleep 2
pkill -x containerd || true
