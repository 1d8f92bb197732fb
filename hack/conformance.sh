#!/usr/bin/env bash
# conformance.sh: Kubernetes' own end-to-end suite (e2e.test of the pinned release), sig-network,
# against the local cluster (hack/cluster.sh, KUP_CLUSTER_NAME/KUP_CLUSTER_PORT) with one service
# proxy as its DaemonSet, run from the cluster's client namespace, as kube-proxy's own CI runs it
# on kind. Writes the run into the report (hack/conformance/report): docs/conformance.json and
# docs/conformance.md, and the JUnit files trimmed to the focus under docs/conformance/PROXY/.
#
#   hack/conformance.sh [--proxy NAME] [--conformance] [--procs N] [--out DIR] [--check]
#
#   --proxy NAME     kube-userspace-proxy (default), kube-proxy-iptables or kube-proxy-nftables:
#                    the cluster's proxy is switched to it first (hack/cluster.sh proxy NAME)
#   --conformance    only the [Conformance] specs of sig-network (what `make test` runs)
#   --procs N        parallel ginkgo processes for the specs not marked [Serial] (default 6);
#                    the [Serial] ones run after them, one at a time
#   --out DIR        where the report goes (default docs/ of this checkout); the raw JUnit files
#                    and ginkgo's output stay in the cluster's state directory
#   --check          exit non-zero when a spec failed (make test)
#
# KUP_CONFORMANCE_TIMEOUT bounds each ginkgo invocation (default 3h; ginkgo reports the specs cut short).
# The cluster must be up (make cluster); its images are imported (hack/conformance/images.sh)
# and the binaries built (make e2e-bins) by this script if missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
proxy=kube-userspace-proxy
subset=
procs=6
out=$root/docs
check=
while [ $# -gt 0 ]; do
	case $1 in
	--proxy) proxy=${2:?--proxy NAME}; shift 2 ;;
	--conformance) subset=1; shift ;;
	--procs) procs=${2:?--procs N}; shift 2 ;;
	--out) out=${2:?--out DIR}; shift 2 ;;
	--check) check=1; shift ;;
	*) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
	esac
done
case $proxy in
kube-userspace-proxy) run=kube-userspace-proxy ;;
kube-proxy-iptables) run=iptables ;;
kube-proxy-nftables) run=nftables ;;
*) echo "conformance.sh: --proxy: kube-userspace-proxy, kube-proxy-iptables or kube-proxy-nftables, not $proxy" >&2; exit 2 ;;
esac
GO=${GO:-go}
t0=$(date +%s)
step() { echo "-- conformance [$(($(date +%s) - t0))s] $*"; }
die() { echo "conformance.sh: $*" >&2; exit 1; }

k8sversion=$(sed -n 's/^KUP_K8S_VERSION *:= *//p' "$root/test/cluster.mk")
etcdversion=$(sed -n 's/^KUP_ETCD_VERSION *:= *//p' "$root/test/cluster.mk")
bin=${KUP_K8S_BIN:-${XDG_CACHE_HOME:-$HOME/.cache}/kube-userspace-proxy/bin/k8s-$k8sversion-etcd-$etcdversion}
export KUP_K8S_BIN=$bin

# The focus and skip. The skip is the list kube-proxy's own kind job uses, then what cannot exist
# on this cluster (hack/conformance/skips.txt, each with its reason).
focus='\[sig-network\]'
[ -z "$subset" ] || focus='\[sig-network\].*\[Conformance\]'
skip='Alpha|Beta|LoadBalancer|Disruptive|Flaky|Networking-IPv6|IPv6DualStack|LocalhostNodePorts'
while IFS=$'\t' read -r expr _; do
	case $expr in '' | '#'*) continue ;; esac
	skip="$skip|$expr"
done <"$root/hack/conformance/skips.txt"

kubeconfig=$("$root/hack/cluster.sh" kubeconfig) || die "the cluster is not up: make cluster"
state=$(dirname "$kubeconfig")
# The admin's kubeconfig that names the API server at its own address, which the client
# namespace reaches (the machine's kubeconfig names a loopback forwarder).
e2ekubeconfig=$state/admin.kubeconfig
[ -s "$e2ekubeconfig" ] || die "$e2ekubeconfig not found"

step "binaries (make e2e-bins)"
GO="$GO" "$root/test/e2ebin/build.sh" "$bin" "$k8sversion" | tail -n 1
[ -x "$bin/kubectl" ] || die "$bin/kubectl not found: make test-bins builds it"

step "images (hack/conformance/images.sh)"
GO="$GO" "$root/hack/conformance/images.sh" | tail -n 1

step "service proxy: $proxy"
"$root/hack/cluster.sh" proxy "$proxy"

raw=$state/conformance/$run
rm -rf "$raw"
mkdir -p "$raw"
started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
# e2e FLAGS...: ginkgo running e2e.test from the client namespace.
e2e() {
	local prefix=$1
	shift
	"$root/hack/cluster.sh" client env KUBERNETES_CONFORMANCE_TEST=y HOME="$raw" \
		"$bin/ginkgo" --no-color --timeout="${KUP_CONFORMANCE_TIMEOUT:-3h}" "$@" "$bin/e2e.test" -- \
		--provider=skeleton --kubeconfig="$e2ekubeconfig" --kubectl-path="$bin/kubectl" \
		--dns-domain=cluster.local --num-nodes=3 --disable-log-dump=true \
		--report-dir="$raw" --report-prefix="$prefix"
}
rc=0
step "specs not marked [Serial], $procs at a time (log: $raw/parallel.log)"
e2e parallel_ --procs="$procs" --focus="$focus" --skip="\\[Serial\\]|$skip" >"$raw/parallel.log" 2>&1 || rc=$?
tail -n 5 "$raw/parallel.log"
step "specs marked [Serial], one at a time (log: $raw/serial.log)"
e2e serial_ --focus="$focus" --skip="$skip" --label-filter=Serial >"$raw/serial.log" 2>&1 || rc=$?
tail -n 5 "$raw/serial.log"
ls "$raw"/junit_*.xml >/dev/null 2>&1 || die "no JUnit files in $raw (ginkgo exited $rc; see its logs)"

step "report"
(cd "$root" && "$GO" run ./hack/conformance/report -run "$run" -started "$started" \
	-kubernetes "$k8sversion" -focus "$focus" -skip "$skip" \
	-skips hack/conformance/skips.txt -exceptions hack/conformance/exceptions.txt \
	-json "$out/conformance.json" -md "$out/conformance.md" \
	-trim "$out/conformance/$run" ${check:+-check} "$raw"/junit_*.xml)
step "done"
