//go:build linux

package app

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// TestReadyFileLifecycle: the file names this process from the first sync until a freeze,
// again after a failed hand-over (thaw), and never after stop; a file that is not its own
// (a successor's, written after the freeze) is left alone.
func TestReadyFileLifecycle(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ready")
	self, err := procIdentity("/proc", os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	r := newReadyFile(path, "/proc", zerolog.Nop())
	present := func(step string, want bool) {
		t.Helper()
		data, err := os.ReadFile(path)
		switch {
		case want && err != nil:
			t.Fatalf("%s: ready file absent: %v", step, err)
		case want && strings.TrimSpace(string(data)) != self:
			t.Fatalf("%s: ready file holds %q, want %q", step, data, self)
		case !want && err == nil && strings.TrimSpace(string(data)) == self:
			t.Fatalf("%s: ready file still names this process", step)
		}
	}
	present("before the first sync", false)
	r.markSynced()
	present("after the first sync", true)
	r.markSynced()
	present("after another sync", true)
	r.freeze()
	present("frozen for a hand-over", false)
	r.thaw()
	present("after a failed hand-over", true)
	r.freeze()
	present("frozen again", false)
	// The successor, sharing the path, writes its own; the stop must not remove it.
	if err := os.WriteFile(path, []byte("1 2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	r.stop()
	if data, err := os.ReadFile(path); err != nil || string(data) != "1 2\n" {
		t.Fatalf("the successor's ready file: %q, %v; want it untouched", data, err)
	}
	os.Remove(path)
	r.thaw()
	r.markSynced()
	present("after stop", false)

	// A readyFile that stops before its first sync never writes; a nil one does nothing.
	r = newReadyFile(path, "/proc", zerolog.Nop())
	r.stop()
	r.markSynced()
	present("stopped before the first sync", false)
	var none *readyFile
	none.markSynced()
	none.freeze()
	none.thaw()
	none.stop()
	if newReadyFile("", "/proc", zerolog.Nop()) != nil {
		t.Error("newReadyFile(\"\") is not nil")
	}
	if entries, _ := os.ReadDir(filepath.Dir(path)); len(entries) != 0 {
		t.Errorf("left in the directory: %v", entries)
	}
}

// TestProcIdentity reads a process's start time after a command name with spaces and
// parentheses, and fails on what is not a stat line.
func TestProcIdentity(t *testing.T) {
	root := t.TempDir()
	stat := func(pid int, line string) {
		dir := filepath.Join(root, strconv.Itoa(pid))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "stat"), []byte(line), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	rest := " S 0 1 1 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 9 0 424242 1000 10 18446744073709551615"
	stat(7, "7 (kube (userspace) proxy)"+rest+"\n")
	stat(8, "8 (short) S 0 1\n")
	stat(9, "no parentheses")
	if got, err := procIdentity(root, 7); err != nil || got != "7 424242" {
		t.Errorf("procIdentity(7) = %q, %v; want \"7 424242\"", got, err)
	}
	for _, pid := range []int{8, 9} {
		if got, err := procIdentity(root, pid); err == nil {
			t.Errorf("procIdentity(%d) = %q, want an error", pid, got)
		}
	}
	if _, err := procIdentity(root, 10); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("procIdentity of a missing process: %v, want ErrNotExist", err)
	}
	// This process: its start time is what the kernel reports.
	self, err := procIdentity("/proc", os.Getpid())
	if err != nil || !strings.HasPrefix(self, strconv.Itoa(os.Getpid())+" ") {
		t.Errorf("procIdentity(self) = %q, %v", self, err)
	}
}

// healthzServer serves /healthz on loopback with the given status; its address.
func healthzServer(t *testing.T, status int) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/healthz" {
			http.NotFound(w, r)
			return
		}
		w.WriteHeader(status)
		fmt.Fprintf(w, `{"nodeEligible": %v}`, status == http.StatusOK)
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// closedAddr is a loopback address nothing listens on.
func closedAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// TestReadyProbe: ready only when the file names a running process, the one it names (its
// start time), and /healthz answers 200.
func TestReadyProbe(t *testing.T) {
	self, err := procIdentity("/proc", os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	pid := strconv.Itoa(os.Getpid())
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	ok, unavailable, unreachable := healthzServer(t, http.StatusOK), healthzServer(t, http.StatusServiceUnavailable), closedAddr(t)
	tests := []struct {
		name    string
		file    string // "" for no file
		healthz string
		// want is "" for ready, else a part of the error.
		want       string
		notServing bool
	}{
		{name: "serving, healthz 200", file: self, healthz: ok},
		{name: "serving, no healthz server", file: self},
		{name: "no ready file", healthz: ok, want: "no ready file", notServing: true},
		{name: "serving, healthz 503", file: self, healthz: unavailable, want: `503 Service Unavailable: {"nodeEligible": false}`},
		{name: "serving, healthz unreachable", file: self, healthz: unreachable, want: "connection refused"},
		{name: "an earlier process with this pid", file: pid + " 1", healthz: ok, want: "a file of an earlier process", notServing: true},
		{name: "a process that is gone", file: strconv.Itoa(gone.Process.Pid) + " 1", healthz: ok, want: "which is gone", notServing: true},
		{name: "not a ready file", file: "ready", healthz: ok, want: "is not \"PID STARTTIME\""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "ready")
			if tt.file != "" {
				if err := os.WriteFile(path, []byte(tt.file+"\n"), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			err := readyProbe{File: path, Healthz: tt.healthz}.check(ctx)
			switch {
			case tt.want == "" && err != nil:
				t.Fatalf("check: %v, want ready", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Fatalf("check: %v, want an error with %q", err, tt.want)
			case errors.Is(err, errNotServing) != tt.notServing:
				t.Fatalf("check: %v: errNotServing %v, want %v", err, errors.Is(err, errNotServing), tt.notServing)
			}
		})
	}
}

func TestProbeHealthzAddr(t *testing.T) {
	for bind, want := range map[string]string{
		"0.0.0.0:10256":   "127.0.0.1:10256",
		"[::]:10256":      "[::1]:10256",
		"10.0.0.5:10256":  "10.0.0.5:10256",
		"127.0.0.1:20256": "127.0.0.1:20256",
		"":                "",
	} {
		if got, err := probeHealthzAddr(bind); err != nil || got != want {
			t.Errorf("probeHealthzAddr(%q) = %q, %v; want %q", bind, got, err, want)
		}
	}
	if got, err := probeHealthzAddr("10256"); err == nil {
		t.Errorf("probeHealthzAddr(\"10256\") = %q, want an error", got)
	}
}

// TestProbeReadyFlag runs --probe-ready through Main: exit 0 ready, 1 not ready (the reason on
// standard output), 2 without --ready-file.
func TestProbeReadyFlag(t *testing.T) {
	self, err := procIdentity("/proc", os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "ready")
	if err := os.WriteFile(path, []byte(self+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		args []string
		code int
		out  string
	}{
		{"ready", []string{"--ready-file", path, "--healthz-bind-address", healthzServer(t, http.StatusOK)}, 0, ""},
		{"healthz 503", []string{"--ready-file", path, "--healthz-bind-address", healthzServer(t, http.StatusServiceUnavailable)}, 1, "not ready: "},
		{"no ready file", []string{"--ready-file", path + ".absent", "--healthz-bind-address", healthzServer(t, http.StatusOK)}, 1, "not ready: " + errNotServing.Error()},
		{"without --ready-file", nil, 2, "--probe-ready needs --ready-file"},
		{"bad healthz address", []string{"--ready-file", path, "--healthz-bind-address", "10256"}, 2, "--healthz-bind-address"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			code := Main(append([]string{"--probe-ready"}, tt.args...), &stdout, &stderr)
			if code != tt.code || !strings.HasPrefix(stdout.String(), tt.out) {
				t.Fatalf("exit %d, stdout %q, stderr %q; want exit %d, stdout starting %q", code, stdout.String(), stderr.String(), tt.code, tt.out)
			}
		})
	}
}

// TestReadyFileOfTheBinary runs the proxy (manifests, no portals) with --ready-file: a probe
// run as the kubelet runs it (a second process of the same binary) fails while the proxy
// starts, passes once it serves, and fails again once it stops on SIGTERM; the file is gone
// after the exit.
func TestReadyFileOfTheBinary(t *testing.T) {
	bin := proxyBinary(t)
	dir := t.TempDir()
	ready := filepath.Join(dir, "ready")
	healthz := net.JoinHostPort("127.0.0.1", strconv.Itoa(freePort(t)))
	probe := func() (int, string) {
		out, err := exec.Command(bin, "--probe-ready", "--ready-file", ready, "--healthz-bind-address", healthz).CombinedOutput()
		return exitCode(err), string(out)
	}
	if code, out := probe(); code != 1 || !strings.Contains(out, "no ready file") {
		t.Fatalf("probe before the start: exit %d, %q; want 1, no ready file", code, out)
	}
	manifests := filepath.Join(dir, "manifests")
	if err := os.Mkdir(manifests, 0o755); err != nil {
		t.Fatal(err)
	}
	stderr := &syncBuffer{}
	cmd := exec.Command(bin, "--manifests", manifests, "--portal-mode", "none", "--hostname-override", "node",
		"--healthz-bind-address", healthz, "--metrics-bind-address", "", "--ready-file", ready,
		"--shutdown-grace-period", "1s", "--log-level", "debug")
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	defer func() {
		_ = cmd.Process.Kill()
		<-done
		if t.Failed() {
			t.Logf("proxy log:\n%s", stderr.String())
		}
	}()
	var code int
	var out string
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if code, out = probe(); code == 0 {
			break
		}
	}
	if code != 0 {
		t.Fatalf("probe of the running proxy: exit %d, %q; want 0", code, out)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		done <- err
		if err != nil {
			t.Fatalf("proxy exited with %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the proxy did not exit on SIGTERM")
	}
	if code, out := probe(); code != 1 || !strings.Contains(out, "no ready file") {
		t.Fatalf("probe after the exit: exit %d, %q; want 1, no ready file", code, out)
	}
}
