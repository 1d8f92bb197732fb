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
// ExitSecondSignal although a connection is still open and the grace period is long.
func TestShutdownSignals(t *testing.T) {
	tests := []struct {
		name     string
		signals  []syscall.Signal
		wantCode int
	}{
		{name: "SIGTERM drains", signals: []syscall.Signal{syscall.SIGTERM}, wantCode: 0},
		{name: "SIGINT drains", signals: []syscall.Signal{syscall.SIGINT}, wantCode: 0},
		{name: "second signal exits at once", signals: []syscall.Signal{syscall.SIGTERM, syscall.SIGTERM}, wantCode: ExitSecondSignal},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
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
