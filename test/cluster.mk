# Real Kubernetes components for the end-to-end tests (included by the top-level Makefile).
#
#   make test-bins          build kube-apiserver, kube-proxy, kubelet, kube-controller-manager,
#                           kube-scheduler, kubectl and etcd of the pinned versions into
#                           $(KUP_K8S_BIN); skips those already built (minutes cold, ~1 s cached)
#   make test-harness       run the harness's own tests (test/...), which need test-bins
#   make cluster            a real three-node cluster on this machine (hack/cluster.sh up,
#                           docs/cluster.md): dependencies checked first, then binaries, images,
#                           the cluster, its service proxy and CoreDNS, each phase timed;
#                           PROXY=kube-userspace-proxy (default), kube-proxy-iptables or
#                           kube-proxy-nftables picks the service proxy; MONITORING=1 starts
#                           Prometheus too (hack/cluster.sh monitoring)
#   make cluster-down       remove it (every process, mount, namespace and file)
#   make test-cluster       the end-to-end tests on that cluster (test/kcluster, build tag
#                           cluster): brings it up if it is not, and down again if it brought it
#                           up (KUP_CLUSTER_KEEP=1 keeps it); Prometheus too (hack/cluster.sh
#                           monitoring), for TestMonitoring
#   make test-monitoring    the monitoring and Events tests alone, with the alerts' (build tag
#                           clustermon: a node stopped, the DaemonSet deleted)
#   make test-bins-clean    delete $(KUP_K8S_BIN)
#   make test-netns-list    list leftover kup-* network namespaces (deletes nothing: other
#                           engineers' tests may be running)
#
# The pins: change them with test/k8sbin/pin.sh, then here and in test/cluster/bins.go
# (TestPinsAgree in test/cluster checks that all three agree).
KUP_K8S_VERSION  := v1.36.3
KUP_ETCD_VERSION := v3.6.8

GO ?= go
# Where the binaries go; test/cluster looks in the same place (it reads KUP_K8S_BIN, else the
# same default).
KUP_K8S_BIN ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kube-userspace-proxy/bin/k8s-$(KUP_K8S_VERSION)-etcd-$(KUP_ETCD_VERSION)
export KUP_K8S_BIN

KUP_TEST_MK_DIR := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))

.PHONY: test-bins test-harness test-bins-clean test-netns-list cluster cluster-down test-cluster test-monitoring
comma := ,

test-bins:
	GO="$(GO)" $(KUP_TEST_MK_DIR)/k8sbin/build.sh "$(KUP_K8S_BIN)" $(KUP_K8S_VERSION) $(KUP_ETCD_VERSION)

test-harness: test-bins
	$(GO) test -race -count=1 -timeout 10m ./$(KUP_TEST_MK_DIR)/...

KUP_CLUSTER_SH := $(KUP_TEST_MK_DIR)/../hack/cluster.sh
KUP_CLUSTER_TEST_TIMEOUT ?= 25m

# Not after test-bins: up checks the dependencies before it builds anything, then builds.
PROXY ?= kube-userspace-proxy
MONITORING ?=
cluster:
	GO="$(GO)" KUP_CLUSTER_PROXY="$(PROXY)" KUP_CLUSTER_MONITORING="$(MONITORING)" $(KUP_CLUSTER_SH) up

cluster-down:
	$(KUP_CLUSTER_SH) down

# One test-cluster at a time per cluster name (a second waits): they share the cluster's names.
# KUP_CLUSTER_NAME=NAME KUP_CLUSTER_PORT=PORT runs a cluster beside the default one.
KUP_CLUSTER_LOCK ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kube-userspace-proxy/cluster$(if $(KUP_CLUSTER_NAME),-$(KUP_CLUSTER_NAME)).lock

# kcluster-run TAGS,GO-TEST-ARGS: the cluster up (and its Prometheus, hack/cluster.sh monitoring:
# built on first use, outside the tests' time bound), go test of test/kcluster, the cluster down
# again if this brought it up.
define kcluster-run
	@set -e; mkdir -p "$$(dirname "$(KUP_CLUSTER_LOCK)")"; exec 9>"$(KUP_CLUSTER_LOCK)"; flock 9; was_up=; $(KUP_CLUSTER_SH) kubeconfig >/dev/null 2>&1 && was_up=1; \
	GO="$(GO)" KUP_CLUSTER_PROXY=kube-userspace-proxy KUP_CLUSTER_MONITORING=1 $(KUP_CLUSTER_SH) up; rc=0; \
	$(GO) test -race -count=1 -v -tags $(1) $(2) ./$(KUP_TEST_MK_DIR)/kcluster/ || rc=$$?; \
	if [ -z "$$was_up" ] && [ -z "$(KUP_CLUSTER_KEEP)" ]; then $(KUP_CLUSTER_SH) down || rc=1; fi; \
	exit $$rc
endef

test-cluster: test-bins
	$(call kcluster-run,cluster,-timeout $(KUP_CLUSTER_TEST_TIMEOUT))

# The monitoring tests alone, with the alerts' (build tag clustermon: a node stopped, the
# DaemonSet deleted, a few minutes): test/kcluster's TestMonitoring, TestMonitoringAlerts and
# TestEventsAsKubeProxy.
test-monitoring: test-bins
	$(call kcluster-run,cluster$(comma)clustermon,-timeout 20m -run '^(TestMonitoring|TestMonitoringAlerts|TestEventsAsKubeProxy)$$')

test-bins-clean:
	rm -rf "$(KUP_K8S_BIN)"

test-netns-list:
	@ip netns list | grep '^kup-' || echo "no kup-* network namespaces"
