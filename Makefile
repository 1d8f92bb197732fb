# kube-userspace-proxy — see README.md.
#   make example   run the bundled example (no cluster, no root)
#   make test      install what the tests need, then run every test (root; network namespaces)
#   go test ./...  the unit tier only, as any user (the other tiers skip, saying why)

GO        ?= go
BIN       ?= bin
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
COMMIT    ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
# runtime.godebugDefault=memprofilerate=0: no allocation sampling from the first allocation on
# (the runtime's 1.4 MiB table of sampled stacks is made at the first sample, before main can
# turn sampling off); --profiling turns it on. The test harness, the Dockerfile and the demo
# build with the same flag. (The go command sets runtime.godebugDefault itself only for a
# module whose go.mod asks for non-default GODEBUG settings; this one does not.)
LDFLAGS   := -X github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/app.Version=$(VERSION) \
             -X github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/app.Commit=$(COMMIT) \
             -X runtime.godebugDefault=memprofilerate=0
TEST_TIMEOUT ?= 45m

.PHONY: all build example deps test unit vet fmt-check bench-go clean demo

all: build

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/kube-userspace-proxy ./cmd/kube-userspace-proxy
	$(GO) build -o $(BIN)/kup-echo ./cmd/kup-echo

example: build
	BIN=$(BIN) ./examples/run.sh

deps:
	./hack/install-deps.sh

vet:
	$(GO) vet ./...

# Static checks (hack/lint.sh): gofmt, go vet (also with the benchmark's build tags), staticcheck
# and deadcode at the versions hack/tools/go.mod pins, built into $(BIN)/tools.
.PHONY: lint
lint:
	GO="$(GO)" BIN="$(BIN)" ./hack/lint.sh

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

# The whole suite: unit tests, loopback integration tests, and the end-to-end tests in network
# namespaces against a real kube-apiserver + etcd (built once by test-bins, then cached). Every
# tier runs: KUP_TEST_ALL=1 turns what would skip a test (no root, a missing tool or binary) into
# a failure, and hack/testcheck fails the run on any skipped test (plain `go test ./...` runs
# the unit tier alone; see internal/testenv). Then the local cluster's tests and the sig-network
# [Conformance] specs of Kubernetes' own end-to-end suite against this proxy (test/conformance.mk).
test: deps test-bins lint
	KUP_TEST_ALL=1 $(GO) test -json -race -count=1 -timeout $(TEST_TIMEOUT) ./... 2>&1 | $(GO) run ./hack/testcheck
	$(MAKE) test-on-cluster
	$(MAKE) fuzz

# Every fuzz target for a bounded number of inputs (their seed corpora also run in every `go test`),
# about 10 s each on a quiet 2-core machine. Counts, not times: with a -fuzztime duration, Go 1.26's
# fuzz coordinator can fail a clean run with "context deadline exceeded" when the deadline passes
# while a worker is busy (golang/go#75804, fixed in Go 1.27; CI hit it on FuzzProxyHeader), and a
# count has no deadline to race. Minimisation is bounded by count for the same reason.
# FUZZ_SCALE=10 make fuzz for a ten times longer look. A finding is written under testdata/fuzz/
# and fails.
FUZZ_SCALE ?= 1
FUZZ_MIN   ?= -fuzzminimizetime=200x
fuzz-one = $(GO) test -run='^$$' -fuzz='^$(1)$$' -fuzztime=$$(($(2) * $(FUZZ_SCALE)))x $(FUZZ_MIN) $(3)
.PHONY: fuzz
fuzz:
	$(call fuzz-one,FuzzDecode,20000,./proxy/source/manifests/)
	$(call fuzz-one,FuzzFromService,60000,./proxy/)
	$(call fuzz-one,FuzzEndpointsFromSlices,100000,./proxy/)
	$(call fuzz-one,FuzzProxyHeader,300000,./proxy/forward/proxyproto/)
	$(call fuzz-one,FuzzRender,150,./portal/)

# Unit and loopback tests only (no control plane).
unit:
	$(GO) test -race -count=1 $$(go list ./... | grep -v /test/)

bench-go:
	$(GO) test -run '^$$' -bench . -benchmem ./loadbalancer/ ./proxy/...

clean:
	rm -rf $(BIN)

# The docker-compose demo (demo/README.md): etcd, kube-apiserver, the proxy, two backends and a
# client; exits non-zero if the client saw a failed request. Cold: a few minutes (debootstrap of
# the base image, Go build); warm: about a minute.
demo: test-bins
	GO="$(GO)" ./demo/run.sh

-include test/cluster.mk
-include test/conformance.mk

# The benchmark against upstream kube-proxy's iptables mode, HAProxy and direct pod access
# (bench/README.md); results under bench/results/. BENCH_QUICK=1 runs a reduced version (< 1 min).
.PHONY: bench
bench: deps test-bins
	cd bench && $(GO) test -tags bench -run '^TestBench$$' -count=1 -v -timeout 60m .

# The scale figures from a manifests directory (test/e2e/scale_measure_test.go):
# KUP_SCALE_MEASURE=5000,10000,20000 (the default) service counts, one MEASURE line each, each
# measured KUP_SCALE_REPS=3 times; the medians go to bench/results/scale.{md,svg} (about 18 minutes).
.PHONY: scale-measure
scale-measure: deps test-bins
	KUP_SCALE_OUT=$${KUP_SCALE_OUT:-$(CURDIR)/bench/results} KUP_SCALE_REPS=$${KUP_SCALE_REPS:-3} $(GO) test -tags scalemeasure -run '^TestScaleMeasure$$' -count=1 -v -timeout 60m ./test/e2e/
