//go:build linux

// Package harness is what the end-to-end tests of kube-userspace-proxy share: it builds the
// proxy and the kup-echo backend once per test binary, runs them inside network namespaces (see
// package test/netns), creates Services and EndpointSlices on a real API server (see package
// test/cluster), and sends single requests from any namespace, reporting which backend answered,
// the peer address it saw, or how the request failed (refused, reset, timeout, closed).
//
// Typical use, in a package's TestMain and tests:
//
//	func TestMain(m *testing.M) { os.Exit(harness.Main(m)) }
//
//	n := netns.NewNetwork(t, "e2e")
//	c := cluster.Start(t, cluster.Options{Network: n})
//	node := n.AddNode(t, "node")
//	pod := n.AddPod(t, node, "pod")
//	harness.StartEcho(t, pod.NS, "pod-a", 8080)
//	px := harness.StartProxy(t, node.NS, harness.ProxyConfig{NodeName: "node", Kubeconfig: c.Kubeconfig})
//	svc := harness.CreateService(ctx, t, c.Client, harness.ClusterIPService("web", harness.TCPPort("http", 80, 8080)))
//	harness.ApplySlice(ctx, t, c.Client, harness.Slice(svc, harness.Endpoint{IP: pod.IP, Node: "node", Name: "pod-a"}))
//	harness.WaitFor(t, 30*time.Second, func() error { _, err := harness.Ask(ctx, node.NS, "tcp", addr); return err })
//
// Everything it starts is stopped in the test's cleanup, also when the test fails. Without root
// or the tools, Main runs none of the package's tests (make test, with KUP_TEST_ALL=1, fails
// instead); missing binaries of `make test-bins` fail the test.
package harness

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/internal/testenv"
)

// Names of the binaries Build produces.
const (
	proxyCmd = "kube-userspace-proxy"
	echoCmd  = "kup-echo"
)

// builder builds the binaries once per process into a temporary directory that Main removes.
var builder struct {
	once sync.Once
	dir  string
	err  error
}

// Main runs the tests of m and then removes the binaries built for them; use it from TestMain:
//
//	func TestMain(m *testing.M) { os.Exit(harness.Main(m)) }
//
// It returns m.Run's exit code. Without root, iproute2 and iptables it runs no test and
// returns 0, saying why (under KUP_TEST_ALL=1 it returns 1: see package internal/testenv).
func Main(m *testing.M) int {
	code := testenv.Main(m, testenv.Root(),
		testenv.Tools("Debian packages iproute2 and iptables (make deps)", "ip", "iptables", "ip6tables"))
	if builder.dir != "" {
		_ = os.RemoveAll(builder.dir)
	}
	return code
}

// ProxyBinary returns the path of kube-userspace-proxy built from this module (once per test
// binary). It fails the test if the build fails.
func ProxyBinary(t testing.TB) string {
	t.Helper()
	return filepath.Join(buildAll(t), proxyCmd)
}

// EchoBinary returns the path of kup-echo built from this module (once per test binary). It fails
// the test if the build fails.
func EchoBinary(t testing.TB) string {
	t.Helper()
	return filepath.Join(buildAll(t), echoCmd)
}

// buildAll builds both commands with one `go build` and returns their directory.
func buildAll(t testing.TB) string {
	t.Helper()
	builder.once.Do(func() {
		root, err := moduleRoot()
		if err != nil {
			builder.err = err
			return
		}
		dir, err := os.MkdirTemp("", "kup-e2e-bin-")
		if err != nil {
			builder.err = fmt.Errorf("build: temporary directory: %w", err)
			return
		}
		builder.dir = dir
		start := time.Now()
		// The Makefile's runtime flag (see LDFLAGS there): no allocation sampling.
		cmd := exec.Command("go", "build", "-ldflags=-X=runtime.godebugDefault=memprofilerate=0", "-o", dir+string(filepath.Separator), "./cmd/"+proxyCmd, "./cmd/"+echoCmd)
		cmd.Dir = root
		if out, err := cmd.CombinedOutput(); err != nil {
			builder.err = fmt.Errorf("go build ./cmd/%s ./cmd/%s in %s: %w: %s", proxyCmd, echoCmd, root, err, strings.TrimSpace(string(out)))
			return
		}
		t.Logf("harness: built %s and %s in %v", proxyCmd, echoCmd, time.Since(start).Round(time.Millisecond))
	})
	if builder.err != nil {
		t.Fatalf("harness: %v", builder.err)
	}
	return builder.dir
}

// moduleRoot returns the directory of the main module the tests run in.
func moduleRoot() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("build: go env GOMOD (is the go command installed?): %w", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", fmt.Errorf("build: not inside a Go module (go env GOMOD = %q)", gomod)
	}
	return filepath.Dir(gomod), nil
}
