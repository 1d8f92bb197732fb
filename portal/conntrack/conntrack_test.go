//go:build linux

package conntrack

import (
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables/netnstest"
)

var ap = netip.MustParseAddrPort

// flowNS is a namespace whose traffic to any address leaves through lo (and so is tracked),
// with a UDP ClusterIP-style DNAT so that one flow is NATed as the proxy's would be.
func flowNS(t *testing.T) *netnstest.NS {
	t.Helper()
	netnstest.RequireTools(t, "Debian package conntrack", "conntrack", "iptables")
	ns := netnstest.New(t)
	ns.IP(t, "route", "add", "default", "dev", "lo")
	ns.IP(t, "-6", "route", "add", "default", "dev", "lo")
	ns.IP(t, "addr", "add", "10.200.0.1/32", "dev", "lo") // the node's address
	ns.IP(t, "addr", "add", "fd00:200::1/128", "dev", "lo", "nodad")
	ns.IP(t, "addr", "add", "fd00:200::2/128", "dev", "lo", "nodad") // not the NodePort's address
	// NAT rules also turn connection tracking on in the namespace, per family.
	ns.MustExec(t, "iptables", "-t", "nat", "-A", "OUTPUT", "-p", "udp", "-d", "10.96.0.10", "--dport", "53", "-j", "DNAT", "--to-destination", "127.0.0.1:5353")
	ns.MustExec(t, "ip6tables", "-t", "nat", "-A", "OUTPUT", "-p", "udp", "-d", "fd00:96::10", "--dport", "53", "-j", "DNAT", "--to-destination", "[::1]:5353")
	return ns
}

// send sends one datagram from inside ns to dst; with network "tcp" it listens on dst (a local
// address) and connects to it instead, and keeps the connection open until the test ends.
func send(t *testing.T, ns *netnstest.NS, network string, dst netip.AddrPort) {
	t.Helper()
	ns.Do(t, func() {
		if network == "tcp" {
			l, err := net.Listen("tcp", dst.String())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { l.Close() })
			c, err := net.Dial("tcp", dst.String())
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			return
		}
		c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(dst))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := c.Write([]byte("q")); err != nil {
			t.Fatal(err)
		}
	})
}

// flows returns `conntrack -L` of both families in ns.
func flows(t *testing.T, ns *netnstest.NS) string {
	t.Helper()
	v4, err4 := ns.Exec("conntrack", "-L", "-f", "ipv4")
	v6, err6 := ns.Exec("conntrack", "-L", "-f", "ipv6")
	if err4 != nil || err6 != nil {
		t.Fatalf("conntrack -L: %v %v", err4, err6)
	}
	return v4 + v6
}

// hasFlow reports whether the listing has a flow of proto whose original destination is dst.
func hasFlow(list, proto string, dst netip.AddrPort) bool {
	for _, l := range strings.Split(list, "\n") {
		f := strings.Fields(l)
		if len(f) == 0 || f[0] != proto {
			continue
		}
		// The first dst= and dport= are the original direction's.
		var d, p string
		for _, x := range f {
			if v, ok := strings.CutPrefix(x, "dst="); ok && d == "" {
				d = v
			}
			if v, ok := strings.CutPrefix(x, "dport="); ok && p == "" {
				p = v
			}
		}
		if d == dst.Addr().String() && p == strconv.Itoa(int(dst.Port())) {
			return true
		}
	}
	return false
}

// counting returns a conntrack wrapper script that appends a line to a file per run, and the
// file. fake, when not empty, is shell code run first (it may exit).
func counting(t *testing.T, fake string) (script, runs string) {
	t.Helper()
	dir := t.TempDir()
	runs = filepath.Join(dir, "runs")
	real, err := exec.LookPath("conntrack")
	if err != nil {
		t.Fatal(err)
	}
	script = filepath.Join(dir, "conntrack")
	body := "#!/bin/sh\necho \"$*\" >> " + runs + "\n" + fake + "\nexec " + real + " \"$@\"\n"
	if err := os.WriteFile(script, []byte(body), 0o755); err != nil {
		t.Fatal(err)
	}
	return script, runs
}

func runCount(t *testing.T, runs string) int {
	t.Helper()
	b, err := os.ReadFile(runs)
	if os.IsNotExist(err) {
		return 0
	}
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(b), "\n")
}

// DeleteUDP deletes exactly the UDP flows to the given addresses and ports, in one run of the
// tool: flows to another address on the same port (another service, a remote host), to another
// port, and of another protocol survive.
func TestDeleteUDP(t *testing.T) {
	for _, tc := range []struct {
		name     string
		fake     string // shell code the wrapper runs first
		wantRuns int    // runs of the wrapper for the first call, for the second
		again    int
	}{
		{name: "batched", wantRuns: 1, again: 1},
		{name: "a tool without -R: one run per filter, -R not retried",
			fake:     `case "$1" in -R) echo "conntrack v1.4.6 (conntrack-tools): unknown option \` + "`" + `-R'" >&2; exit 2;; esac`,
			wantRuns: 1 + 4, again: 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ns := flowNS(t)
			gone := []netip.AddrPort{ap("10.96.0.10:53"), ap("10.200.0.1:30053"), ap("[fd00:200::1]:30053"), ap("[fd00:96::10]:53")}
			kept := []netip.AddrPort{ap("10.96.0.20:53"), ap("10.200.0.9:30053"), ap("10.200.0.1:30054"), ap("[fd00:200::2]:30053")}
			for _, d := range append(append([]netip.AddrPort(nil), gone...), kept...) {
				send(t, ns, "udp", d)
			}
			tcp := ap("10.200.0.1:30053")
			send(t, ns, "tcp", tcp)
			before := flows(t, ns)
			for _, d := range append(append([]netip.AddrPort(nil), gone...), kept...) {
				if !hasFlow(before, "udp", d) {
					t.Fatalf("no udp flow to %v before:\n%s", d, before)
				}
			}
			if !hasFlow(before, "tcp", tcp) {
				t.Fatalf("no tcp flow to %v before:\n%s", tcp, before)
			}

			script, runs := counting(t, tc.fake)
			tool := &Tool{Path: script}
			var err error
			ns.Do(t, func() { err = tool.DeleteUDP(gone) })
			if err != nil {
				t.Fatalf("DeleteUDP: %v", err)
			}
			after := flows(t, ns)
			for _, d := range gone {
				if hasFlow(after, "udp", d) {
					t.Errorf("udp flow to %v still there:\n%s", d, after)
				}
			}
			for _, d := range kept {
				if !hasFlow(after, "udp", d) {
					t.Errorf("unrelated udp flow to %v deleted:\n%s", d, after)
				}
			}
			if !hasFlow(after, "tcp", tcp) {
				t.Errorf("tcp flow to %v deleted:\n%s", tcp, after)
			}
			if n := runCount(t, runs); n != tc.wantRuns {
				t.Errorf("%d runs of conntrack, want %d", n, tc.wantRuns)
			}
			// Nothing left to delete is no error.
			ns.Do(t, func() { err = tool.DeleteUDP(gone) })
			if err != nil {
				t.Errorf("second DeleteUDP: %v", err)
			}
			if n := runCount(t, runs); n != tc.wantRuns+tc.again {
				t.Errorf("%d runs of conntrack after the second call, want %d", n, tc.wantRuns+tc.again)
			}
		})
	}
}

func TestDeleteUDPErrors(t *testing.T) {
	if err := (&Tool{Path: "/nonexistent/conntrack"}).DeleteUDP([]netip.AddrPort{ap("10.96.0.10:53")}); err == nil {
		t.Error("DeleteUDP with a missing binary: no error")
	}
	for _, bad := range []netip.AddrPort{ap("0.0.0.0:53"), ap("10.96.0.10:0"), {}} {
		if err := (&Tool{Path: "/bin/true"}).DeleteUDP([]netip.AddrPort{bad}); err == nil {
			t.Errorf("DeleteUDP(%v): no error; want a refusal (it would match more than one destination)", bad)
		}
	}
	if err := (&Tool{Path: "/nonexistent/conntrack"}).DeleteUDP(nil); err != nil {
		t.Errorf("DeleteUDP(nil) = %v: nothing to do is no error", err)
	}
}

// A conntrack run that hangs is killed after Timeout, also when a child of it keeps its output
// open, and the call reports it; the child is killed too.
func TestDeleteUDPTimeout(t *testing.T) {
	dir := t.TempDir()
	script := filepath.Join(dir, "conntrack")
	pidFile := filepath.Join(dir, "child.pid")
	if err := os.WriteFile(script, []byte("#!/bin/sh\nsleep 3600 &\necho $! > "+pidFile+"\nwait\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tool := range []*Tool{{Path: script, Timeout: 100 * time.Millisecond}, {Path: script, Timeout: 100 * time.Millisecond, noBatch: true}} {
		err := tool.DeleteUDP([]netip.AddrPort{ap("10.96.0.10:53"), ap("10.96.0.11:53")})
		if err == nil || !strings.Contains(err.Error(), "timed out") {
			t.Errorf("DeleteUDP with a hung conntrack (batch %v) = %v, want a timeout", !tool.noBatch, err)
		}
		b, err := os.ReadFile(pidFile)
		if err != nil {
			t.Fatal(err)
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil {
			t.Fatal(err)
		}
		// Killed at once with its group; reaped by init soon after.
		deadline := time.Now().Add(10 * time.Second)
		for syscall.Kill(pid, 0) == nil {
			if time.Now().After(deadline) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
				t.Fatalf("the hung tool's child %d outlived the timed-out run", pid)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}
