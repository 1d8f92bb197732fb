//go:build linux

// Package netnstest gives tests throw-away network namespaces: create one per test with New, wire
// namespaces together with Connect, and run code inside one with Do. Everything it creates is
// removed in t.Cleanup, also when the test fails.
//
// Do runs a function on the calling goroutine's OS thread after moving that thread into the
// namespace, so sockets the function opens and processes it starts (a child inherits its parent
// thread's namespace) live in the namespace. Goroutines the function starts run on other threads
// and are NOT in the namespace; they may use sockets created inside it.
//
// It needs root and the `ip` tool (iproute2); without them the tests that use it are skipped
// (see package internal/testenv).
package netnstest

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/internal/testenv"
)

// NS is a network namespace made for a test.
type NS struct {
	// Name is the namespace's name under /run/netns ("kup-<pid>-<random>").
	Name string
}

// RequireTools skips the test, naming the tools and hint, when any of names is not on PATH;
// under KUP_TEST_ALL=1 (make test, CI) it fails it instead (see package internal/testenv).
func RequireTools(t testing.TB, hint string, names ...string) {
	t.Helper()
	testenv.Tool(t, hint, names...)
}

// New creates a network namespace with loopback up and deletes it when the test ends. Without
// root or iproute2 it skips the test (fails it under KUP_TEST_ALL=1).
func New(t testing.TB) *NS {
	t.Helper()
	testenv.Privileged(t)
	RequireTools(t, "Debian package iproute2", "ip")
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatalf("netnstest: random name: %v", err)
	}
	n := &NS{Name: fmt.Sprintf("kup-%d-%s", os.Getpid(), hex.EncodeToString(b[:]))}
	if out, err := exec.Command("ip", "netns", "add", n.Name).CombinedOutput(); err != nil {
		t.Fatalf("netnstest: ip netns add %s: %v: %s", n.Name, err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "netns", "del", n.Name).CombinedOutput(); err != nil {
			t.Errorf("netnstest: ip netns del %s: %v: %s", n.Name, err, out)
		}
	})
	n.IP(t, "link", "set", "lo", "up")
	return n
}

// Exec runs name with args inside the namespace (`ip netns exec`) and returns its combined output.
func (n *NS) Exec(name string, args ...string) (string, error) {
	cmd := exec.Command("ip", append([]string{"netns", "exec", n.Name, name}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("in netns %s: %s %s: %w: %s", n.Name, name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// MustExec is Exec that fails the test on error.
func (n *NS) MustExec(t testing.TB, name string, args ...string) string {
	t.Helper()
	out, err := n.Exec(name, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// IP runs `ip -n <ns> args...` and fails the test on error.
func (n *NS) IP(t testing.TB, args ...string) string {
	t.Helper()
	out, err := exec.Command("ip", append([]string{"-n", n.Name}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("netnstest: ip -n %s %s: %v: %s", n.Name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// Sysctl sets a sysctl inside the namespace, e.g. Sysctl(t, "net.ipv4.ip_forward", "1").
func (n *NS) Sysctl(t testing.TB, key, value string) {
	t.Helper()
	path := "/proc/sys/" + strings.ReplaceAll(key, ".", "/")
	n.MustExec(t, "sh", "-c", `echo "$1" > "$2"`, "sh", value, path)
}

// Do runs fn with the calling goroutine's thread inside the namespace and moves the thread back
// afterwards (also when fn calls t.Fatal). Calls may nest.
func (n *NS) Do(t testing.TB, fn func()) {
	t.Helper()
	runtime.LockOSThread()
	self := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
	orig, err := unix.Open(self, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		t.Fatalf("netnstest: open %s: %v", self, err)
	}
	defer unix.Close(orig)
	target, err := unix.Open("/run/netns/"+n.Name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		t.Fatalf("netnstest: open netns %s: %v", n.Name, err)
	}
	err = unix.Setns(target, unix.CLONE_NEWNET)
	unix.Close(target)
	if err != nil {
		runtime.UnlockOSThread()
		t.Fatalf("netnstest: enter netns %s: %v", n.Name, err)
	}
	defer func() {
		if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
			// Stay locked: the thread is in the wrong namespace and must not run other
			// goroutines; it ends when this goroutine does.
			t.Errorf("netnstest: leave netns %s: %v", n.Name, err)
			return
		}
		runtime.UnlockOSThread()
	}()
	fn()
}

// Connect joins a and b with a veth pair: interface aIf in a with addresses aAddrs, bIf in b with
// bAddrs, both up. IPv6 addresses skip duplicate address detection so they are usable at once.
func Connect(t testing.TB, a *NS, aIf string, aAddrs []netip.Prefix, b *NS, bIf string, bAddrs []netip.Prefix) {
	t.Helper()
	a.IP(t, "link", "add", aIf, "type", "veth", "peer", "name", bIf, "netns", b.Name)
	for _, side := range []struct {
		ns    *NS
		dev   string
		addrs []netip.Prefix
	}{{a, aIf, aAddrs}, {b, bIf, bAddrs}} {
		for _, p := range side.addrs {
			args := []string{"addr", "add", p.String(), "dev", side.dev}
			if p.Addr().Is6() {
				args = append(args, "nodad")
			}
			side.ns.IP(t, args...)
		}
		side.ns.IP(t, "link", "set", side.dev, "up")
	}
}
