#!/usr/bin/env bash
# e2e.sh: Kubernetes' external storage e2e suite (test/e2e/storage/external) against csi.ferrite.dev
# on the cluster up.sh brought up, driven by testdriver.yaml.
#
# Usage: e2e.sh [FOCUS [SKIP]] (ginkgo regular expressions over the spec names). Without FOCUS it
# runs a subset (SUBSET below; `FERRITE_KUBELET_E2E=1 scripts/test.sh` runs it too); FOCUS=all runs every spec that is not [Slow], [Serial],
# [Disruptive] or Windows-only (hours under TCG). Prints ginkgo's "Ran N of M Specs" and
# "N Passed | N Failed | N Pending | N Skipped" lines; the JUnit report is in $STATE/e2e/.
# Env: FERRITE_NODE_BIN (build-node.sh's bin directory, with e2e.test), E2E_TIMEOUT (ginkgo's suite
# timeout, 24h: the specs not run by then count as skipped).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$HERE/lib.sh"
[ -e "$STATE/up" ] || die "no cluster: tests/kubelet/up.sh first"
. "$STATE/node.env"
E2E=${FERRITE_NODE_BIN:-$NODE_BIN}/e2e.test
[ -x "$E2E" ] || die "no $E2E (build-node.sh with e2e.test in ONLY)"

# The subset: the capabilities pods.sh does not try (a clone of a raw block volume, a generic
# ephemeral volume, AllowedTopologies, CSIStorageCapacity), each a spec that provisions, attaches,
# mounts and deletes through the kubelet (~1.5 min each under TCG). FOCUS=all runs the rest too;
# its online expansion spec needs a 6.16+ node (up.sh with FERRITE_VM_KERNEL=6.17).
SUBSET=(
  'Dynamic PV \(block volmode\)\] provisioning should provision storage with pvc data source$'
  'Generic Ephemeral-volume \(default fs\) \(late-binding\)\] ephemeral should create read-only inline ephemeral volume'
  'Dynamic PV \(delayed binding\)\] topology should provision a volume and schedule a pod with AllowedTopologies'
  'Dynamic PV \(default fs\)\] capacity provides storage capacity information'
)
FOCUS=${1:-}
SKIP=${2:-'\[Slow\]|\[Serial\]|\[Disruptive\]|\[Feature:Windows\]'}
case $FOCUS in
  "") FOCUS="External.Storage.*($(IFS='|'; echo "${SUBSET[*]}"))" ;;
  all) FOCUS='External.Storage' ;;
esac

OUT=$STATE/e2e
rm -rf "$OUT"; mkdir -p "$OUT"
step "e2e.test: $FOCUS"
set +e
KUBE_TEST_REPO_LIST=$STATE/repo-list.yaml "$E2E" --provider=skeleton --kubeconfig="$STATE/admin.kubeconfig" \
  --storage.testdriver="$HERE/testdriver.yaml" --report-dir="$OUT" \
  --ginkgo.focus="$FOCUS" --ginkgo.skip="$SKIP" \
  --ginkgo.no-color --ginkgo.timeout="${E2E_TIMEOUT:-24h}" > "$OUT/e2e.log" 2>&1
rc=$?
set -e
grep -E '^Ran [0-9]+ of [0-9]+ Specs|Passed \| [0-9]+ Failed' "$OUT/e2e.log" >&2 || tail -40 "$OUT/e2e.log" >&2
# Failures by name, so CI's log says which without the report.
grep -E '^\s*\[FAIL\]' "$OUT/e2e.log" | sort -u >&2 || true
[ $rc = 0 ] || die "e2e.test failed ($rc): $OUT/e2e.log"
