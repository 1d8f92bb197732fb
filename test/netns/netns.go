//go:build linux

// Package netns creates Linux network namespaces, and small topologies of them, for tests.
//
// Every namespace is named kup-<name>-<random> (so a leftover is easy to spot with
// `ip netns list`) and is deleted in the test's cleanup, with every process started in it, even
// when the test fails. Nothing here touches the machine's own network namespace: links are
// created directly inside the namespaces they belong to.
//
// A namespace is used from a test in three ways:
//
//   - run a command in it: [NS.Exec] (short-lived) or [NS.Start] (a server, killed in cleanup);
//   - open sockets in it from the test process itself: [NS.DialContext], [NS.Listen],
//     [NS.ListenPacket], or anything else through [NS.Do];
//   - build a small cluster network: [NewNetwork] makes a bridge in a "network" namespace, then
//     [Network.AddNode], [Network.AddPod] and [Network.AddHost] attach nodes, pods (a static-route
//     "CNI") and outside hosts to it. See [Network] for the addressing plan.
//
// Example:
//
//	n := netns.NewNetwork(t, "demo")
//	node := n.AddNode(t, "n1")
//	pod := n.AddPod(t, node, "p1")
//	ln, err := pod.Listen("tcp", ":8080") // a socket inside the pod namespace
//	...
//	conn, err := node.DialContext(ctx, "tcp", netip.AddrPortFrom(pod.IP, 8080).String())
//
// The package needs root and the ip(8) command (iproute2). Without either, New skips the test,
// saying which is missing; under KUP_TEST_ALL=1 (make test, CI) it fails it (see package
// internal/testenv).
package netns

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/internal/testenv"
)

// runDir is where `ip netns add` bind-mounts the namespaces it names.
const runDir = "/run/netns"

// cleanupTimeout bounds the commands run while deleting a namespace.
const cleanupTimeout = 30 * time.Second

// NS is a named network namespace owned by a test. Its methods may be called from several
// goroutines at once.
type NS struct {
	name string

	mu    sync.Mutex // guards following fields
	procs []*Process
	seq   int // numbers the log files of started processes
}

// New creates the network namespace kup-<name>-<random>, brings its loopback up and registers
// its deletion in t.Cleanup: processes started with [NS.Start] are killed first, then any other
// process still in the namespace, then the namespace is deleted. It fails the test if the
// namespace cannot be created. Without root or iproute2 it skips the test (fails it under
// KUP_TEST_ALL=1; see package internal/testenv).
func New(t testing.TB, name string) *NS {
	t.Helper()
	testenv.Privileged(t)
	testenv.Tool(t, "Debian package iproute2", "ip")
	suffix := make([]byte, 3)
	if _, err := rand.Read(suffix); err != nil {
		t.Fatalf("netns: random name suffix: %v", err)
	}
	ns := &NS{name: "kup-" + name + "-" + hex.EncodeToString(suffix)}
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	if out, err := exec.CommandContext(ctx, "ip", "netns", "add", ns.name).CombinedOutput(); err != nil {
		t.Fatalf("netns: create namespace %s (needs root and iproute2): %v: %s", ns.name, err, strings.TrimSpace(string(out)))
	}
	t.Cleanup(func() {
		if err := ns.delete(); err != nil {
			t.Errorf("netns: %v", err)
		}
	})
	if err := ipCmd(ctx, "-n", ns.name, "link", "set", "lo", "up"); err != nil {
		t.Fatalf("netns: %v", err)
	}
	return ns
}

// Name returns the namespace's name as `ip netns` knows it (kup-<name>-<random>).
func (ns *NS) Name() string { return ns.name }

// Path returns the namespace's bind mount, usable with setns(2) or `nsenter --net=`.
func (ns *NS) Path() string { return filepath.Join(runDir, ns.name) }

// String returns the namespace's name.
func (ns *NS) String() string { return ns.name }

// Exec runs a command inside the namespace (through `ip netns exec`) and returns its combined
// output. The error, if any, includes that output.
func (ns *NS) Exec(ctx context.Context, args ...string) (string, error) {
	if len(args) == 0 {
		return "", fmt.Errorf("exec in netns %s: no command", ns.name)
	}
	cmd := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", ns.name}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("exec %q in netns %s: %w: %s", args, ns.name, err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// Run is [NS.Exec] for test bodies: it fails the test (t.Fatal, so call it from the test's
// goroutine) when the command fails, and gives up after 30 seconds.
func (ns *NS) Run(t testing.TB, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	out, err := ns.Exec(ctx, args...)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// Do runs fn on an OS thread switched into the namespace and returns fn's error. Sockets fn
// creates belong to the namespace for their whole life, so they may be used from any goroutine
// afterwards. fn runs on a goroutine of its own (so it must not call t.FailNow); goroutines fn
// starts run in the test process's own namespace, not in this one. Names are resolved as the
// test process resolves them, so give sockets IP addresses.
func (ns *NS) Do(fn func() error) error {
	errc := make(chan error, 1)
	go func() { errc <- ns.doLocked(fn) }()
	return <-errc
}

// doLocked switches the calling goroutine's thread into the namespace, runs fn and switches
// back. If it cannot switch back the thread stays locked, so the runtime discards it when the
// goroutine exits instead of reusing a thread in the wrong namespace.
func (ns *NS) doLocked(fn func() error) error {
	runtime.LockOSThread()
	orig, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter netns %s: open current namespace: %w", ns.name, err)
	}
	defer orig.Close()
	target, err := os.Open(ns.Path())
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter netns %s: %w", ns.name, err)
	}
	defer target.Close()
	if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter netns %s: setns: %w", ns.name, err)
	}
	fnErr := fn()
	if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
		// Leave the thread locked: it dies with this goroutine.
		return errors.Join(fnErr, fmt.Errorf("leave netns %s: setns: %w", ns.name, err))
	}
	runtime.UnlockOSThread()
	return fnErr
}

// DialContext dials address with a socket created inside the namespace. It has the signature of
// net.Dialer.DialContext and of client-go's rest.Config.Dial.
func (ns *NS) DialContext(ctx context.Context, network, address string) (net.Conn, error) {
	var conn net.Conn
	err := ns.Do(func() error {
		var d net.Dialer
		var err error
		conn, err = d.DialContext(ctx, network, address)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("dial %s %s from netns %s: %w", network, address, ns.name, err)
	}
	return conn, nil
}

// Listen announces on a stream address inside the namespace (see net.Listen).
func (ns *NS) Listen(network, address string) (net.Listener, error) {
	var ln net.Listener
	err := ns.Do(func() error {
		var err error
		ln, err = net.Listen(network, address)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listen %s %s in netns %s: %w", network, address, ns.name, err)
	}
	return ln, nil
}

// ListenPacket announces on a packet address inside the namespace (see net.ListenPacket).
func (ns *NS) ListenPacket(network, address string) (net.PacketConn, error) {
	var pc net.PacketConn
	err := ns.Do(func() error {
		var err error
		pc, err = net.ListenPacket(network, address)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listen %s %s in netns %s: %w", network, address, ns.name, err)
	}
	return pc, nil
}

// SetSysctl writes a sysctl of the namespace, such as "net.ipv4.ip_forward". Only the
// net.* sysctls are per namespace; SetSysctl refuses any other, so that it never changes the
// machine.
func (ns *NS) SetSysctl(key, value string) error {
	if !strings.HasPrefix(key, "net.") {
		return fmt.Errorf("set sysctl %s in netns %s: not a per-namespace (net.*) sysctl", key, ns.name)
	}
	path := "/proc/sys/" + strings.ReplaceAll(key, ".", "/")
	err := ns.Do(func() error { return os.WriteFile(path, []byte(value), 0o644) })
	if err != nil {
		return fmt.Errorf("set sysctl %s=%s in netns %s: %w", key, value, ns.name, err)
	}
	return nil
}

// delete kills the namespace's processes and deletes it.
func (ns *NS) delete() error {
	ns.mu.Lock()
	procs := ns.procs
	ns.procs = nil
	ns.mu.Unlock()
	for _, p := range procs {
		p.Stop()
	}
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	var errs []error
	if err := ns.killStrays(ctx); err != nil {
		errs = append(errs, err)
	}
	if out, err := exec.CommandContext(ctx, "ip", "netns", "delete", ns.name).CombinedOutput(); err != nil {
		errs = append(errs, fmt.Errorf("delete namespace %s: %w: %s", ns.name, err, strings.TrimSpace(string(out))))
	}
	return errors.Join(errs...)
}

// killStrays kills every process left in the namespace (started by Exec callers, or forked by
// started processes into their own groups) and waits until none is left.
func (ns *NS) killStrays(ctx context.Context) error {
	for {
		out, err := exec.CommandContext(ctx, "ip", "netns", "pids", ns.name).Output()
		if err != nil {
			return fmt.Errorf("list processes in namespace %s: %w", ns.name, err)
		}
		pids := strings.Fields(string(out))
		if len(pids) == 0 {
			return nil
		}
		for _, s := range pids {
			if pid, err := strconv.Atoi(s); err == nil {
				_ = syscall.Kill(pid, syscall.SIGKILL) // gone already is fine
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kill processes %v in namespace %s: %w", pids, ns.name, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// ipCmd runs ip(8) with args in the test process's namespace (use "-n", name to act inside one).
func ipCmd(ctx context.Context, args ...string) error {
	out, err := exec.CommandContext(ctx, "ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}
