#!/usr/bin/env bash
# up.sh: a one-node Kubernetes cluster with Ferrite installed, left running for tests and tools.
#
# The control plane runs on this machine (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, the snapshot-controller), beside a registry; the node is a QEMU guest (the
# only place here with ublk and kernel NBD) on a tap device: containerd, runc, the CNI bridge and
# the kubelet (node.sh). Ferrite's images (deploy/images.py) and the sidecars', pause's, busybox's
# and agnhost's (static_images.py) are pushed to the registry and pulled by containerd by digest;
# Ferrite is installed by `kubectl apply -k` of deploy/kubernetes under an overlay that only
# names the registry and the digests.
#
# The last lines printed are KUBECONFIG=<path> and KUBE_TEST_REPO_LIST=<path>. down.sh ends it.
# Env: FERRITE_KUBELET_DIR (state, default /tmp/ferrite-kubelet), FERRITE (the ferrite binary, default
# $CARGO_TARGET_DIR/debug/ferrite), FERRITE_K8S_BIN and FERRITE_NODE_BIN (build.sh's and
# build-node.sh's bin directories; built from ../shared/k8s when unset), NODE_MEM (6G).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
. "$HERE/lib.sh"

[ "$(id -u)" = 0 ] || die "needs root (a tap device, a QEMU guest)"
[ ! -e "$STATE/up" ] || die "a cluster is up already ($STATE): tests/kubelet/down.sh first"
rm -rf "$STATE"; mkdir -p "$STATE"/{pki,logs,images,ctl}; chmod 700 "$STATE"
FERRITE=${FERRITE:-${CARGO_TARGET_DIR:-$REPO/target}/debug/ferrite}
[ -x "$FERRITE" ] || die "no ferrite binary at $FERRITE (cargo build --bin ferrite)"
# A failed start leaves nothing running; its logs stay in $STATE/logs.
trap 'rc=$?; [ $rc = 0 ] || { echo "up.sh failed ($rc): logs in $STATE/logs" >&2; KEEP=1 bash "$HERE/down.sh"; }' EXIT

step "Kubernetes binaries"
SHARED=${FERRITE_K8S:-$REPO/../shared/k8s}
K8S_BIN=${FERRITE_K8S_BIN:-$(bash "$SHARED/build.sh" | tail -1)}
NODE_BIN=${FERRITE_NODE_BIN:-$(bash "$SHARED/build-node.sh" | tail -1)}
for b in mini-etcd kube-apiserver kube-controller-manager snapshot-controller; do [ -x "$K8S_BIN/$b" ] || die "no $K8S_BIN/$b"; done
for b in kubelet kube-scheduler containerd containerd-shim-runc-v2 runc pause agnhost cni/bridge; do
  [ -x "$NODE_BIN/$b" ] || die "no $NODE_BIN/$b (build-node.sh)"
done
CRDS=$SHARED/crds/external-snapshotter RBAC=$SHARED/rbac

step "network: tap $TAP"
# A /24 no interface here holds: the node's link; the next /24 its pods.
for i in $(seq 201 250); do
  ip -o -4 addr show | grep -q " 10\.$i\.[01]\." || { NET=10.$i; break; }
done
[ -n "${NET:-}" ] || die "no free 10.x.0.0/23 for the node"
HOST_IP=$NET.0.1 GUEST_IP=$NET.0.2 POD_CIDR=$NET.1.0/24
ip tuntap add dev "$TAP" mode tap
ip addr add "$HOST_IP/24" dev "$TAP"
ip link set "$TAP" up
ip route add "$POD_CIDR" via "$GUEST_IP" dev "$TAP" onlink
touch "$STATE/up"

step "certificates"
P=$STATE/pki
openssl req -x509 -newkey rsa:2048 -nodes -keyout "$P/ca.key" -out "$P/ca.crt" -subj /CN=ferrite-kubelet-ca -days 7 2>/dev/null
issue() { # NAME SUBJECT [SANS]
  openssl req -newkey rsa:2048 -nodes -keyout "$P/$1.key" -subj "$2" -out "$P/$1.csr" 2>/dev/null
  printf '%s\n' "${3:+subjectAltName=$3}" > "$P/$1.ext"
  openssl x509 -req -in "$P/$1.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial -days 7 \
    -extfile "$P/$1.ext" -out "$P/$1.crt" 2>/dev/null
}
issue apiserver /CN=kube-apiserver "IP:$HOST_IP,IP:127.0.0.1,IP:10.0.0.1,DNS:kubernetes.default.svc,DNS:kubernetes.default,DNS:kubernetes,DNS:localhost"
issue admin /O=system:masters/CN=admin
issue kcm /CN=system:kube-controller-manager
issue scheduler /CN=system:kube-scheduler
issue apiserver-kubelet /O=system:masters/CN=kube-apiserver-kubelet-client
issue kubelet "/O=system:nodes/CN=system:node:$NODE"
issue kubelet-serving "/CN=$NODE" "IP:$GUEST_IP,DNS:$NODE"
openssl genrsa -out "$P/sa.key" 2048 2>/dev/null
openssl rsa -in "$P/sa.key" -pubout -out "$P/sa.pub" 2>/dev/null
"$FERRITE" certs "$P/registry" registry "$HOST_IP" >/dev/null
SERVER=https://$HOST_IP:6443
kubeconfig() { # NAME (client certificate NAME.crt)
  cat > "$STATE/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: ferrite, cluster: {server: "$SERVER", certificate-authority: "$P/ca.crt"}}]
users: [{name: $1, user: {client-certificate: "$P/$1.crt", client-key: "$P/$1.key"}}]
contexts: [{name: ferrite, context: {cluster: ferrite, user: $1}}]
current-context: ferrite
EOF
}
for k in admin kcm scheduler kubelet; do kubeconfig $k; done
export KUBECONFIG=$STATE/admin.kubeconfig

step "control plane on $HOST_IP"
spawn etcd "$K8S_BIN/mini-etcd" -data-dir "$STATE/etcd" -listen-client-urls http://127.0.0.1:$ETCD_PORT \
  -listen-peer-urls http://127.0.0.1:$((ETCD_PORT + 1))
spawn apiserver "$K8S_BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:$ETCD_PORT \
  --bind-address="$HOST_IP" --advertise-address="$HOST_IP" --secure-port=6443 \
  --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" --client-ca-file="$P/ca.crt" \
  --kubelet-client-certificate="$P/apiserver-kubelet.crt" --kubelet-client-key="$P/apiserver-kubelet.key" \
  --kubelet-certificate-authority="$P/ca.crt" --kubelet-preferred-address-types=InternalIP \
  --service-account-key-file="$P/sa.pub" --service-account-signing-key-file="$P/sa.key" \
  --service-account-issuer=https://kubernetes.default.svc --allow-privileged=true \
  --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
  --service-cluster-ip-range=10.0.0.0/24 --enable-aggregator-routing=true --cert-dir="$STATE/apiserver-certs"
until_ok 120 "the API server" kubectl get --raw /readyz
spawn controller-manager "$K8S_BIN/kube-controller-manager" --kubeconfig="$STATE/kcm.kubeconfig" \
  --authentication-kubeconfig="$STATE/kcm.kubeconfig" --authorization-kubeconfig="$STATE/kcm.kubeconfig" \
  --leader-elect=false --service-account-private-key-file="$P/sa.key" --root-ca-file="$P/ca.crt" \
  --use-service-account-credentials=true --bind-address=127.0.0.1 --secure-port=$((ETCD_PORT + 2)) \
  --cluster-signing-cert-file="$P/ca.crt" --cluster-signing-key-file="$P/ca.key"
spawn scheduler "$NODE_BIN/kube-scheduler" --kubeconfig="$STATE/scheduler.kubeconfig" \
  --authentication-kubeconfig="$STATE/scheduler.kubeconfig" --authorization-kubeconfig="$STATE/scheduler.kubeconfig" \
  --leader-elect=false --bind-address=127.0.0.1 --secure-port=$((ETCD_PORT + 3))
kubectl apply --server-side -f "$CRDS" >/dev/null
kubectl wait --for condition=established crd --all --timeout=60s >/dev/null
until_ok 60 "the default ServiceAccount" kubectl get sa default
kubectl apply -n kube-system -f "$RBAC/snapshot-controller.yaml" >/dev/null
cat > "$STATE/snapshot-controller.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: ferrite, cluster: {server: "$SERVER", certificate-authority: "$P/ca.crt"}}]
users: [{name: snapshot-controller, user: {token: "$(kubectl create token snapshot-controller -n kube-system --duration=48h)"}}]
contexts: [{name: ferrite, context: {cluster: ferrite, user: snapshot-controller}}]
current-context: ferrite
EOF
spawn snapshot-controller "$K8S_BIN/snapshot-controller" --kubeconfig="$STATE/snapshot-controller.kubeconfig" \
  --leader-election=false

step "registry on $HOST_IP:$REGISTRY_PORT, images"
REGISTRY=$HOST_IP:$REGISTRY_PORT
cat > "$STATE/registry.yml" <<EOF
version: 0.1
log: {level: warn}
storage: {filesystem: {rootdirectory: $STATE/registry}}
http:
  addr: $REGISTRY
  secret: ferrite-kubelet
  tls: {certificate: $P/registry/registry.pem, key: $P/registry/registry-key.pem}
EOF
spawn registry docker-registry serve "$STATE/registry.yml"
mkdir -p "$STATE/certs.d"; cp "$P/registry/ca.pem" "$STATE/certs.d/ca.crt"
until_ok 30 "the registry" curl -sf --cacert "$P/registry/ca.pem" "https://$REGISTRY/v2/"
# Ferrite's images from the binary without its debug sections (what a release ships is smaller still).
objcopy --strip-debug "$FERRITE" "$STATE/ferrite"
python3 "$REPO/deploy/images.py" --binary "$STATE/ferrite" --out "$STATE/images" >/dev/null
rm "$STATE/ferrite"
declare -A DIGEST
push() { # LAYOUT REPO:TAG (each layout holds one image)
  skopeo copy -q --dest-cert-dir "$STATE/certs.d" "oci:$1" "docker://$REGISTRY/$2" >/dev/null
  DIGEST[$2]=$(cat "$1/digest")
}
tag=$("$FERRITE" --version | awk '{print $NF}')
push "$STATE/images/ferrite" "ferrite:$tag"
push "$STATE/images/ferrite-controller" "ferrite-controller:$tag"
# The sidecars as the manifests name them, each from build.sh's binary of that name.
statics=()
for image in $(kubectl kustomize "$REPO/deploy/kubernetes" | sed -n 's/^ *image: ferrite-registry.invalid\///p' | sort -u); do
  case $image in ferrite:* | ferrite-controller:*) continue ;; esac
  name=${image%%:*}; name=${name##*/}
  [ -x "$K8S_BIN/$name" ] || die "no binary for the image $image in $K8S_BIN"
  statics+=("$image=$K8S_BIN/$name")
done
# The node's sandbox and what test pods run (the e2e suite's names and tags: KUBE_TEST_REPO_LIST).
statics+=("$PAUSE_IMAGE=$NODE_BIN/pause" "$BUSYBOX_IMAGE=/bin/busybox:/usr/bin/busybox+sh" "$AGNHOST_IMAGE=$NODE_BIN/agnhost+sh"
  "$NGINX_IMAGE=/bin/busybox:/usr/bin/busybox+sh")
specs=(); for s in "${statics[@]}"; do specs+=("$(echo "${s%%=*}" | tr '/:' '__')=${s#*=}"); done
python3 "$HERE/static_images.py" "$STATE/images" "${specs[@]}" >/dev/null
for s in "${statics[@]}"; do push "$STATE/images/$(echo "${s%%=*}" | tr '/:' '__')" "${s%%=*}"; done

step "the node: a QEMU guest on $TAP ($GUEST_IP), NODE_MEM=${NODE_MEM:-6G}"
truncate -s 40G "$STATE/node.img"
cat > "$STATE/node.env" <<EOF
NODE=$NODE
NODE_BIN=$NODE_BIN
HOST_IP=$HOST_IP
GUEST_IP=$GUEST_IP
POD_CIDR=$POD_CIDR
API_PORT=6443
REGISTRY=$REGISTRY
PAUSE=$REGISTRY/$PAUSE_IMAGE
STATE=$STATE
EOF
(cd "$STATE" && VM_NET=tap:$TAP VM_DISK=$STATE/node.img VM_MEM=${NODE_MEM:-6G} VM_TIMEOUT=${NODE_LIFETIME:-86400} \
  setsid bash "$REPO/tests/vm/run.sh" "$HERE/node.sh" > "$STATE/logs/guest.log" 2>&1 < /dev/null & echo $! > "$STATE/guest.pid")
until_ok 600 "the node to register" kubectl get node "$NODE"
kubectl label node "$NODE" storage.ferrite.dev/node=true >/dev/null
kubectl wait --for=condition=Ready "node/$NODE" --timeout=600s >/dev/null

step "Ferrite, by kubectl apply -k (the images by digest)"
O=$STATE/overlay
mkdir -p "$O"
{
  echo "apiVersion: kustomize.config.k8s.io/v1beta1"
  echo "kind: Kustomization"
  echo "resources: [$(realpath --relative-to="$O" "$REPO/deploy/kubernetes")]" # kustomize takes no absolute path
  echo "images:"
  for image in "${!DIGEST[@]}"; do
    echo "  - {name: ferrite-registry.invalid/${image%%:*}, newName: $REGISTRY/${image%%:*}, digest: ${DIGEST[$image]}}"
  done
} > "$O/kustomization.yaml"
kubectl apply -k "$O" > "$STATE/logs/apply.log"
for app in ferrite-controller ferrite-daemon ferrite-node-plugin; do ready ferrite $app 900; done

# The e2e suite's image registries, mapped to this one.
cat > "$STATE/repo-list.yaml" <<EOF
promoterE2eRegistry: $REGISTRY/e2e-test-images
buildImageRegistry: $REGISTRY/build-image
gcEtcdRegistry: $REGISTRY
gcRegistry: $REGISTRY
sigStorageRegistry: $REGISTRY/sig-storage
privateRegistry: $REGISTRY/k8s-authenticated-test
dockerLibraryRegistry: $REGISTRY/library
cloudProviderGcpRegistry: $REGISTRY/cloud-provider-gcp
invalidRegistry: invalid.registry.k8s.io/invalid
EOF
step "up in $SECONDS s"
echo "KUBECONFIG=$STATE/admin.kubeconfig"
echo "KUBE_TEST_REPO_LIST=$STATE/repo-list.yaml"
