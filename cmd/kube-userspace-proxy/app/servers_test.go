//go:build linux

package app

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/healthcheck"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/httpserve"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/httpserve/httpservetest"
)

// childEnv names the environment variable that turns the test binary into a helper process
// (see TestMain); its value picks the helper.
const childEnv = "KUP_APP_CHILD"

// childNoFile is the RLIMIT_NOFILE of the healthz helper process.
const childNoFile = 256

func TestMain(m *testing.M) {
	switch helper := os.Getenv(childEnv); helper {
	case "":
		os.Exit(m.Run())
	case "healthz":
		os.Exit(healthzChild())
	default:
		fmt.Fprintf(os.Stderr, "unknown %s=%q\n", childEnv, helper)
		os.Exit(2)
	}
}

// newLoopbackServers builds the servers with /healthz and /metrics on loopback and opens their
// listeners, as Run does.
func newLoopbackServers(t *testing.T, set ...func(*Options)) *servers {
	t.Helper()
	opts := NewOptions()
	for _, f := range set {
		f(opts)
	}
	opts.HealthzBindAddress, opts.MetricsBindAddress = "127.0.0.1:0", "127.0.0.1:0"
	s, err := newServers(opts, &Validated{}, healthcheck.ProxyHealthOptions{}, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	if err := s.listen(nil); err != nil {
		t.Fatal(err)
	}
	return s
}

// startServers runs the /healthz and /metrics servers on loopback as Run does, until the end of
// the test, and returns their addresses.
func startServers(t *testing.T, set ...func(*Options)) (healthz, metrics string) {
	t.Helper()
	s := newLoopbackServers(t, set...)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return s.healthzLn.Addr().String(), s.metricsLn.Addr().String()
}

// setServerLimits sets serverLimits for the test.
func setServerLimits(t *testing.T, l httpserve.Limits) {
	old := serverLimits
	serverLimits = l
	t.Cleanup(func() { serverLimits = old })
}

// --profiling serves Go's profiles on the metrics server, and only there; without it there are
// none.
func TestServersProfiling(t *testing.T) {
	get := func(addr, path string) (int, string) {
		t.Helper()
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	healthz, metrics := startServers(t, func(o *Options) { o.Profiling = true })
	if code, body := get(metrics, "/debug/pprof/goroutine?debug=1"); code != http.StatusOK || !strings.Contains(body, "goroutine profile:") {
		t.Errorf("metrics server /debug/pprof/goroutine: %d %.200q", code, body)
	}
	if code, body := get(metrics, "/debug/pprof/profile?seconds=1"); code != http.StatusOK || len(body) == 0 {
		t.Errorf("metrics server /debug/pprof/profile: %d, %d bytes", code, len(body))
	}
	if code, _ := get(healthz, "/debug/pprof/"); code != http.StatusNotFound {
		t.Errorf("healthz server /debug/pprof/: %d, want 404", code)
	}
	_, metrics = startServers(t)
	if code, _ := get(metrics, "/debug/pprof/"); code != http.StatusNotFound {
		t.Errorf("metrics server without --profiling /debug/pprof/: %d, want 404", code)
	}
}

// A flood of idle connections (some never sent a request, some kept open after one) does not
// stop /healthz or /metrics from answering, and each server holds no more than its cap
// (the defaults).
func TestServersFlood(t *testing.T) {
	healthz, metrics := startServers(t)
	for _, tc := range []struct{ addr, path string }{{healthz, "/healthz"}, {metrics, "/proxyMode"}} {
		t.Run(tc.path, func(t *testing.T) {
			httpservetest.Flood(t, tc.addr, 2000)
			if code := httpservetest.Get(t, "http://"+tc.addr+tc.path); code != 200 {
				t.Errorf("status %d during the flood, want 200", code)
			}
			port := httpservetest.Port(t, tc.addr)
			httpservetest.Eventually(t, func() bool { return httpservetest.ServerConns(t, port) <= httpserve.DefaultMaxConns }, func() string {
				return fmt.Sprintf("the server holds %d connections, cap %d", httpservetest.ServerConns(t, port), httpserve.DefaultMaxConns)
			})
		})
	}
}

// A connection that sends half a request header and stalls, sends nothing, or keeps the
// connection open after its request, is closed by the server.
func TestServersTimeouts(t *testing.T) {
	setServerLimits(t, httpserve.Limits{ReadHeaderTimeout: 100 * time.Millisecond, IdleTimeout: 100 * time.Millisecond})
	healthz, metrics := startServers(t)
	for _, addr := range []string{healthz, metrics} {
		httpservetest.ClosedByServer(t, addr, "GET /healthz HTTP/1.1\r\nHost: te")
		httpservetest.ClosedByServer(t, addr, "")
		httpservetest.ClosedByServer(t, addr, "GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
	}
}

// Once run returns, no connection is open and no goroutine of the servers is left.
func TestServersRunLeavesNoGoroutine(t *testing.T) {
	check := httpservetest.CheckGoroutines(t)
	s := newLoopbackServers(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.run(ctx); close(done) }()
	addrs := []string{s.healthzLn.Addr().String(), s.metricsLn.Addr().String()}
	for _, addr := range addrs {
		httpservetest.Flood(t, addr, 100)
		if code := httpservetest.Get(t, "http://"+addr+"/healthz"); code != 200 && code != 404 {
			t.Fatalf("status %d", code)
		}
	}
	cancel()
	<-done
	for _, addr := range addrs {
		if n := httpservetest.ServerConns(t, httpservetest.Port(t, addr)); n != 0 {
			t.Errorf("%s: %d connections open after run returned", addr, n)
		}
	}
	check()
}

// healthzChild is the helper process of TestHealthzUnderFileLimit: with RLIMIT_NOFILE lowered
// to childNoFile it serves /healthz as Run does, prints "ADDR <address>", and stops when its
// standard input closes.
func healthzChild() int {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		fmt.Fprintln(os.Stderr, "getrlimit:", err)
		return 2
	}
	lim.Cur = childNoFile
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		fmt.Fprintln(os.Stderr, "setrlimit:", err)
		return 2
	}
	opts := NewOptions()
	opts.HealthzBindAddress, opts.MetricsBindAddress = "127.0.0.1:0", ""
	s, err := newServers(opts, &Validated{}, healthcheck.ProxyHealthOptions{}, zerolog.New(os.Stderr))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if err := s.listen(nil); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.run(ctx); close(done) }()
	fmt.Printf("ADDR %s\n", s.healthzLn.Addr())
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n') // until EOF
	cancel()
	<-done
	return 0
}

// TestHealthzUnderFileLimit floods the /healthz server of a process whose RLIMIT_NOFILE is low
// with many more idle connections than it has descriptors: /healthz still answers (the cap keeps
// the descriptors the server holds below the limit, so accept never fails with EMFILE).
func TestHealthzUnderFileLimit(t *testing.T) {
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), childEnv+"=healthz")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waited := false
	t.Cleanup(func() {
		if !waited {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	addr, ok := strings.CutPrefix(strings.TrimSpace(line), "ADDR ")
	if err != nil || !ok {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		waited = true
		t.Fatalf("helper said %q (%v); stderr:\n%s", line, err, stderr.String())
	}
	httpservetest.Flood(t, addr, 4*childNoFile)
	if code := httpservetest.Get(t, "http://"+addr+"/healthz"); code != 200 {
		t.Errorf("status %d, want 200", code)
	}
	stdin.Close()
	waited = true
	if err := cmd.Wait(); err != nil {
		t.Errorf("helper: %v; stderr:\n%s", err, stderr.String())
	}
}
