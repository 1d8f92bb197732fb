# Kubernetes' own end-to-end suite, sig-network, against the local cluster (docs/conformance.md,
# docs/cluster.md). Included by the top-level Makefile after test/cluster.mk.
#
#   make e2e-bins           build e2e.test (k8s.io/kubernetes/test/e2e), the ginkgo CLI, agnhost
#                           and regression-issue-74839 of the pinned Kubernetes into
#                           $(KUP_K8S_BIN); skips those already built (~25 min cold for
#                           e2e.test on 2 busy cores, ~1 s cached)
#   make conformance        the sig-network specs with PROXY (kube-userspace-proxy, the default;
#                           kube-proxy-iptables; kube-proxy-nftables) as the cluster's service
#                           proxy, written into docs/conformance.{md,json} and docs/conformance/
#                           (hack/conformance.sh); brings the cluster up if it is not, and down
#                           again if it brought it up (KUP_CLUSTER_KEEP=1 keeps it).
#                           CONFORMANCE_ARGS adds arguments (--conformance, --procs N)
#   make test-conformance   the [Conformance] specs of sig-network against kube-userspace-proxy,
#                           failing on any failed spec; the report goes to a temporary directory
#                           (make test runs it after test-cluster)
#   make test-on-cluster    test-cluster, then test-conformance, on one bring-up of the cluster
#                           (what make test runs); down again if it brought it up
#
# The pin: test/e2ebin/pin.sh $(KUP_K8S_VERSION) rewrites test/e2ebin/go.mod.
.PHONY: e2e-bins conformance test-conformance test-on-cluster

PROXY ?= kube-userspace-proxy
CONFORMANCE_ARGS ?=
KUP_CONFORMANCE_SH := $(KUP_TEST_MK_DIR)/../hack/conformance.sh

e2e-bins:
	GO="$(GO)" $(KUP_TEST_MK_DIR)/e2ebin/build.sh "$(KUP_K8S_BIN)" $(KUP_K8S_VERSION)

# conformance-run ARGS: hack/conformance.sh ARGS on the cluster, under the cluster's lock (as
# test-cluster), bringing it up and down as test-cluster does.
conformance-run = set -e; mkdir -p "$$(dirname "$(KUP_CLUSTER_LOCK)")"; exec 9>"$(KUP_CLUSTER_LOCK)"; flock 9; was_up=; \
	$(KUP_CLUSTER_SH) kubeconfig >/dev/null 2>&1 && was_up=1; \
	GO="$(GO)" $(KUP_CLUSTER_SH) up; rc=0; \
	GO="$(GO)" $(KUP_CONFORMANCE_SH) $(1) || rc=$$?; \
	if [ -z "$$was_up" ] && [ -z "$(KUP_CLUSTER_KEEP)" ]; then $(KUP_CLUSTER_SH) down || rc=1; fi; \
	exit $$rc

conformance: test-bins e2e-bins
	@$(call conformance-run,--proxy $(PROXY) $(CONFORMANCE_ARGS))

test-conformance: test-bins e2e-bins
	@out=$$(mktemp -d); trap 'rm -rf "$$out"' EXIT; $(call conformance-run,--proxy kube-userspace-proxy --conformance --check --out $$out)

# Both run even when the first fails (each failure is reported); the cluster comes up once.
test-on-cluster: test-bins e2e-bins
	@was_up=; $(KUP_CLUSTER_SH) kubeconfig >/dev/null 2>&1 && was_up=1; rc=0; \
	$(MAKE) --no-print-directory KUP_CLUSTER_KEEP=1 test-cluster || rc=$$?; \
	$(MAKE) --no-print-directory KUP_CLUSTER_KEEP=1 test-conformance || rc=$$?; \
	if [ -z "$$was_up" ] && [ -z "$(KUP_CLUSTER_KEEP)" ]; then $(KUP_CLUSTER_SH) down || rc=1; fi; \
	exit $$rc
