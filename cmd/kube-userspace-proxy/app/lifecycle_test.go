//go:build linux

package app

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/echo"
)

// TestSignalContext sends real signals to the test process: the first cancels the context, the
// second calls exit.
func TestSignalContext(t *testing.T) {
	tests := []struct {
		name     string
		signals  []syscall.Signal
		wantExit bool
	}{
		{name: "one SIGTERM: graceful", signals: []syscall.Signal{syscall.SIGTERM}},
		{name: "one SIGINT: graceful", signals: []syscall.Signal{syscall.SIGINT}},
		{name: "SIGTERM then SIGINT: exit", signals: []syscall.Signal{syscall.SIGTERM, syscall.SIGINT}, wantExit: true},
		{name: "two SIGTERM: exit", signals: []syscall.Signal{syscall.SIGTERM, syscall.SIGTERM}, wantExit: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			exited := make(chan int, 1)
			ctx, stop := signalContext(context.Background(), zerolog.Nop(), func(code int) { exited <- code })
			defer stop()
			for i, s := range tt.signals {
				if err := syscall.Kill(os.Getpid(), s); err != nil {
					t.Fatal(err)
				}
				if i == 0 {
					<-ctx.Done() // the first signal must cancel; a hang here fails by the test timeout
				}
			}
			if tt.wantExit {
				if code := <-exited; code != ExitSecondSignal {
					t.Errorf("exit code %d, want %d", code, ExitSecondSignal)
				}
				return
			}
			stop() // waits for the watcher: nothing may call exit after this
			select {
			case code := <-exited:
				t.Errorf("exit(%d) after a single signal", code)
			default:
			}
		})
	}
}

func TestSetOOMScoreAdj(t *testing.T) {
	path := filepath.Join(t.TempDir(), "oom_score_adj")
	if err := os.WriteFile(path, []byte("0"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := setOOMScoreAdj(path, -999); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(path); string(b) != "-999" {
		t.Errorf("wrote %q", b)
	}
	if err := setOOMScoreAdj(filepath.Join(t.TempDir(), "missing", "x"), 5); err == nil {
		t.Error("no error for a path that cannot be opened")
	}
	// The real file: we are root here, so lowering works; read it back.
	if err := setOOMScoreAdj(oomScoreAdjPath, 0); err != nil {
		t.Fatalf("real %s: %v", oomScoreAdjPath, err)
	}
}

// proxyProcess is the kube-userspace-proxy binary serving one manifests service whose only
// endpoint is a local echo server, with the proxy listener on a known loopback port.
type proxyProcess struct {
	cmd    *exec.Cmd
	port   int
	stderr *syncBuffer
	done   chan error
}

// syncBuffer is a bytes.Buffer safe for the process's writer and the test's reader.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

var (
	buildOnce sync.Once
	buildPath string
	buildErr  error
)

// proxyBinary builds the command once per test binary.
func proxyBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "kup-lifecycle-bin-")
		if err != nil {
			buildErr = err
			return
		}
		buildPath = filepath.Join(dir, "kube-userspace-proxy")
		out, err := exec.Command("go", "build", "-o", buildPath, "github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy").CombinedOutput()
		if err != nil {
			buildErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return buildPath
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func startProxy(t *testing.T, grace time.Duration) *proxyProcess {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	backend := echo.ServeTCP(ln, "backend")
	t.Cleanup(func() { _ = backend.Close() })
	bport := ln.Addr().(*net.TCPAddr).Port

	dir := t.TempDir()
	manifest := fmt.Sprintf(`apiVersion: v1
kind: Service
metadata: {name: svc, namespace: default}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: tcp, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: svc-1
  namespace: default
  labels: {kubernetes.io/service-name: svc}
addressType: IPv4
ports: [{name: tcp, port: %d, protocol: TCP}]
endpoints: [{addresses: ["127.0.0.1"], conditions: {ready: true}}]
`, bport)
	if err := os.WriteFile(filepath.Join(dir, "svc.yaml"), []byte(manifest), 0o600); err != nil {
		t.Fatal(err)
	}
	p := &proxyProcess{port: freePort(t), stderr: &syncBuffer{}, done: make(chan error, 1)}
	p.cmd = exec.Command(proxyBinary(t), "--manifests", dir, "--portal-mode", "none",
		"--proxy-port-range", strconv.Itoa(p.port), "--hostname-override", "node",
		"--healthz-bind-address", "", "--metrics-bind-address", "",
		"--shutdown-grace-period", grace.String(), "--log-level", "debug")
	p.cmd.Stderr = p.stderr
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill()
		<-p.done
		if t.Failed() {
			t.Logf("proxy log:\n%s", p.stderr.String())
		}
	})
	return p
}

// connect dials the proxy listener until it is up (the proxy is starting) and completes one
// exchange through it.
func (p *proxyProcess) connect(t *testing.T) (net.Conn, *bufio.Reader) {
	t.Helper()
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(p.port))
	for {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			r := bufio.NewReader(c)
			if line, err := r.ReadString('\n'); err == nil && strings.HasPrefix(line, "backend") {
				return c, r
			}
			c.Close()
		}
		select {
		case err := <-p.done:
			t.Fatalf("proxy exited while starting: %v", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func exitCode(err error) int {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	if err != nil {
		return -1
	}
	return 0
}

// TestShutdownSignals runs the binary: after SIGTERM/SIGINT it stops accepting, established
// connections go on until they end (then exit 0); a second signal exits at once with
// ExitSecondSignal although a connection is still open and the grace period is long. With the
// API server unreachable (client-go backing off), SIGTERM still stops the proxy first and exits.
func TestShutdownSignals(t *testing.T) {
	tests := []struct {
		name     string
		signals  []syscall.Signal
		wantCode int
		// apiServerDown runs against an API server address where nothing listens.
		apiServerDown bool
	}{
		{name: "SIGTERM drains", signals: []syscall.Signal{syscall.SIGTERM}, wantCode: 0},
		{name: "SIGINT drains", signals: []syscall.Signal{syscall.SIGINT}, wantCode: 0},
		{name: "second signal exits at once", signals: []syscall.Signal{syscall.SIGTERM, syscall.SIGTERM}, wantCode: ExitSecondSignal},
		{name: "SIGTERM during an API server outage", signals: []syscall.Signal{syscall.SIGTERM}, wantCode: 0, apiServerDown: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.apiServerDown {
				shutdownDuringOutage(t, tt.signals[0])
				return
			}
			p := startProxy(t, time.Hour)
			c, r := p.connect(t)
			defer c.Close()

			if err := p.cmd.Process.Signal(tt.signals[0]); err != nil {
				t.Fatal(err)
			}
			// Stop accepting: wait until the listener is gone (dial refused).
			addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(p.port))
			for {
				nc, err := net.Dial("tcp", addr)
				if err != nil {
					break
				}
				nc.Close()
				time.Sleep(20 * time.Millisecond)
			}
			// The established connection still works.
			if _, err := fmt.Fprintf(c, "still here\n"); err != nil {
				t.Fatal(err)
			}
			if line, err := r.ReadString('\n'); err != nil || line != "still here\n" {
				t.Fatalf("established connection after the signal: %q, %v", line, err)
			}
			select {
			case err := <-p.done:
				t.Fatalf("exited (%v) with a connection open and an hour of grace", err)
			default:
			}
			if len(tt.signals) > 1 {
				if err := p.cmd.Process.Signal(tt.signals[1]); err != nil {
					t.Fatal(err)
				}
			} else {
				c.Close() // the last connection ends: the drain is over
			}
			if code := exitCode(<-p.done); code != tt.wantCode {
				t.Fatalf("exit code %d, want %d", code, tt.wantCode)
			}
			p.done <- nil // for the cleanup
		})
	}
}

// exitBound is the generous bound on "exits promptly" after a signal.
const exitBound = 10 * time.Second

// shutdownDuringOutage runs the binary against an API server address with nothing behind it,
// waits until client-go is retrying with back-off, signals, and requires exit 0 within exitBound,
// with the proxy stopped (listeners closed, portals removed) before the source is waited for.
func shutdownDuringOutage(t *testing.T, sig syscall.Signal) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close() // nothing listens there any more: connection refused, client-go backs off

	stderr := &syncBuffer{}
	cmd := exec.Command(proxyBinary(t), "--master", "http://"+closed, "--portal-mode", "none",
		"--hostname-override", "node", "--healthz-bind-address", "", "--metrics-bind-address", "",
		"--shutdown-grace-period", "1h", "--log-level", "debug")
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-done
		if t.Failed() {
			t.Logf("proxy log:\n%s", stderr.String())
		}
		done <- nil
	})
	// Both informers have failed once: their reflectors are in a back-off sleep.
	for !backingOff(stderr.String(), "services") || !backingOff(stderr.String(), "endpointslices") {
		select {
		case err := <-done:
			done <- err
			t.Fatalf("proxy exited while starting: %v", err)
		case <-time.After(50 * time.Millisecond):
		}
	}
	if err := cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		done <- err
		if code := exitCode(err); code != 0 {
			t.Fatalf("exit code %d, want 0", code)
		}
	case <-time.After(exitBound):
		t.Fatalf("still running %v after %v", exitBound, sig)
	}
	log := stderr.String()
	stopped := strings.Index(log, "stopped accepting")
	source := strings.Index(log, "source stopped")
	if source < 0 {
		source = strings.Index(log, "the source has not stopped")
	}
	if stopped < 0 || source < 0 || stopped > source {
		t.Errorf("want \"stopped accepting\" logged before the source is waited for (at %d, source at %d)", stopped, source)
	}
}

// backingOff reports whether log has the API server source's warning that client-go retries
// resource with back-off.
func backingOff(log, resource string) bool {
	for _, line := range strings.Split(log, "\n") {
		if strings.Contains(line, "client-go retries with back-off") && strings.Contains(line, "resource="+resource+" ") {
			return true
		}
	}
	return false
}

// TestWaitSource: the source's error is returned when it stops in time; a source that does not
// stop is given up on after the timeout.
func TestWaitSource(t *testing.T) {
	done := make(chan error, 1)
	done <- errors.New("boom")
	if err := waitSource(done, time.Hour, zerolog.Nop()); err == nil || err.Error() != "boom" {
		t.Errorf("waitSource = %v, want boom", err)
	}
	var buf bytes.Buffer
	if err := waitSource(make(chan error), time.Millisecond, zerolog.New(&buf)); err != nil {
		t.Errorf("waitSource of a stuck source = %v, want nil", err)
	}
	if !strings.Contains(buf.String(), "has not stopped") {
		t.Errorf("no warning about the abandoned source: %q", buf.String())
	}
}
