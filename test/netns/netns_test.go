//go:build linux

package netns_test

import (
	"context"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/internal/testenv"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/echo"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// netnsExists reports whether `ip netns list` shows name.
func netnsExists(t *testing.T, name string) bool {
	t.Helper()
	_, err := os.Stat("/run/netns/" + name)
	if err == nil {
		return true
	}
	if !os.IsNotExist(err) {
		t.Fatalf("stat netns %s: %v", name, err)
	}
	return false
}

// selfNetns returns the identity of the calling thread's network namespace.
func selfNetns(t *testing.T) string {
	t.Helper()
	l, err := os.Readlink("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func TestNamespaceLifecycle(t *testing.T) {
	testenv.Privileged(t) // its checks after the subtests need the namespaces they made
	var name, logPath string
	var proc *netns.Process
	t.Run("use", func(t *testing.T) {
		ns := netns.New(t, "life")
		name = ns.Name()
		if !strings.HasPrefix(name, "kup-life-") {
			t.Errorf("Name() = %q, want prefix kup-life-", name)
		}
		if !netnsExists(t, name) {
			t.Fatalf("namespace %s does not exist after New", name)
		}
		out := ns.Run(t, "ip", "-o", "link", "show", "lo")
		if !strings.Contains(out, "UP") {
			t.Errorf("loopback is not up in %s: %s", name, out)
		}
		// A namespace starts with nothing but loopback: no route to anywhere else.
		if out := ns.Run(t, "ip", "route", "show"); strings.TrimSpace(out) != "" {
			t.Errorf("fresh namespace has routes: %q", out)
		}
		proc = ns.Start(t, "sleep", "3600")
		logPath = proc.LogPath()
		// A stray, not started through Start: cleanup must kill it too.
		ns.Run(t, "sh", "-c", "setsid sleep 3600 >/dev/null 2>&1 &")
		if out := ns.Run(t, "sh", "-c", "echo hi; echo err >&2"); out != "hi\nerr\n" {
			t.Errorf("Exec output = %q, want %q", out, "hi\nerr\n")
		}
		if _, err := ns.Exec(context.Background(), "false"); err == nil {
			t.Error("Exec(false) returned no error")
		}
	})
	if name == "" {
		t.Fatal("subtest did not create a namespace")
	}
	if netnsExists(t, name) {
		t.Errorf("namespace %s still exists after cleanup", name)
	}
	select {
	case <-proc.Done():
	default:
		t.Errorf("process %v still running after cleanup", proc)
	}
	if _, err := os.Stat(logPath); !os.IsNotExist(err) {
		t.Errorf("log %s of a passing test not removed with the temp dir: %v", logPath, err)
	}
}

func TestDo(t *testing.T) {
	ns := netns.New(t, "do")
	before := selfNetns(t)
	var inside string
	if err := ns.Do(func() error {
		l, err := os.Readlink("/proc/thread-self/ns/net")
		inside = l
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if inside == before {
		t.Errorf("Do ran in the test's own namespace %s", inside)
	}
	if after := selfNetns(t); after != before {
		t.Errorf("namespace changed from %s to %s after Do", before, after)
	}
	want := "boom"
	if err := ns.Do(func() error { return &net.AddrError{Err: want} }); err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("Do did not return fn's error: %v", err)
	}

	// SetSysctl writes the namespace's value, not the machine's.
	host, err := os.ReadFile("/proc/sys/net/ipv4/conf/all/accept_local")
	if err != nil {
		t.Fatal(err)
	}
	flip := "1"
	if strings.TrimSpace(string(host)) == "1" {
		flip = "0"
	}
	if err := ns.SetSysctl("net.ipv4.conf.all.accept_local", flip); err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(ns.Run(t, "cat", "/proc/sys/net/ipv4/conf/all/accept_local")); got != flip {
		t.Errorf("accept_local in namespace = %s, want %s", got, flip)
	}
	if after, err := os.ReadFile("/proc/sys/net/ipv4/conf/all/accept_local"); err != nil || string(after) != string(host) {
		t.Errorf("host accept_local changed from %q to %q (%v)", host, after, err)
	}
	if err := ns.SetSysctl("kernel.pid_max", "1"); err == nil {
		t.Error("SetSysctl accepted a sysctl that is not per namespace")
	}
}

func TestListenAndDialStayInNamespace(t *testing.T) {
	a := netns.New(t, "sock-a")
	b := netns.New(t, "sock-b")
	tests := []struct {
		name    string
		network string
	}{
		{name: "tcp", network: "tcp"},
		{name: "udp", network: "udp"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var srv *echo.Server
			if tc.network == "tcp" {
				ln, err := a.Listen("tcp4", "127.0.0.1:7000")
				if err != nil {
					t.Fatal(err)
				}
				srv = echo.ServeTCP(ln, "in-a")
			} else {
				pc, err := a.ListenPacket("udp4", "127.0.0.1:7000")
				if err != nil {
					t.Fatal(err)
				}
				srv = echo.ServeUDP(pc, "in-a")
			}
			t.Cleanup(func() { _ = srv.Close() })
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			banner, err := echo.Check(ctx, a.DialContext, tc.network, "127.0.0.1:7000", "hello")
			if err != nil {
				t.Fatalf("from the same namespace: %v", err)
			}
			if banner != "in-a" {
				t.Errorf("banner = %q, want in-a", banner)
			}
			// The same loopback address in another namespace is another host: nothing listens.
			short, cancelShort := context.WithTimeout(context.Background(), time.Second)
			defer cancelShort()
			if _, err := echo.Check(short, b.DialContext, tc.network, "127.0.0.1:7000", "hello"); err == nil {
				t.Error("reached the server from another namespace")
			}
		})
	}
}
