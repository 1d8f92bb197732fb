package conntrack

import (
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables/netnstest"
)

// A UDP flow DNATed to a closed port stays in conntrack while its client keeps sending;
// DeleteUDP removes exactly the flows to the given destination and port.
func TestDeleteUDP(t *testing.T) {
	netnstest.RequireTools(t, "Debian package conntrack", "conntrack", "iptables")
	ns := netnstest.New(t)
	ns.IP(t, "link", "set", "lo", "up")
	ns.IP(t, "route", "add", "default", "dev", "lo")
	ns.MustExec(t, "iptables", "-t", "nat", "-A", "OUTPUT", "-p", "udp", "-d", "10.96.0.10", "--dport", "53", "-j", "DNAT", "--to-destination", "127.0.0.1:5353")
	send := func(dst string) {
		ns.Do(t, func() {
			c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(netip.MustParseAddrPort(dst)))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if _, err := c.Write([]byte("q")); err != nil {
				t.Fatal(err)
			}
		})
	}
	send("10.96.0.10:53")
	send("10.96.0.20:53") // another service: must survive
	flows := func() string { out, _ := ns.Exec("conntrack", "-L", "-p", "udp"); return out }
	if got := flows(); !strings.Contains(got, "dst=10.96.0.10") || !strings.Contains(got, "dst=10.96.0.20") {
		t.Fatalf("flows before: %s", got)
	}
	var n int
	var err error
	ns.Do(t, func() { n, err = Tool{}.DeleteUDP(netip.MustParseAddr("10.96.0.10"), 53) })
	if err != nil || n != 1 {
		t.Fatalf("DeleteUDP = %d, %v; want 1 deleted", n, err)
	}
	if got := flows(); strings.Contains(got, "dst=10.96.0.10") || !strings.Contains(got, "dst=10.96.0.20") {
		t.Errorf("flows after: %s; want 10.96.0.10's gone, 10.96.0.20's kept", got)
	}
	// Nothing left to delete is no error; a NodePort-style delete matches any destination.
	ns.Do(t, func() { n, err = Tool{}.DeleteUDP(netip.MustParseAddr("10.96.0.10"), 53) })
	if err != nil || n != 0 {
		t.Errorf("second DeleteUDP = %d, %v; want 0, nil", n, err)
	}
	ns.Do(t, func() { n, err = Tool{}.DeleteUDP(netip.IPv4Unspecified(), 53) })
	if err != nil || n != 1 {
		t.Errorf("DeleteUDP(any, 53) = %d, %v; want 1", n, err)
	}
	// A missing binary is an error.
	if _, err := (Tool{Path: "/nonexistent/conntrack"}).DeleteUDP(netip.MustParseAddr("10.96.0.10"), 53); err == nil {
		t.Error("DeleteUDP with a missing binary: no error")
	}
}
