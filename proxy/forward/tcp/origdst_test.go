//go:build linux

package tcp

import (
	"net"
	"net/netip"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// TestOriginalDestination checks SO_ORIGINAL_DST against real NAT: in a network namespace of its
// own (forwardtest.RunNATCases) it makes TCP connections to a "service" address that iptables
// DNATs or REDIRECTs to the proxy. The Chooser must see the service address; connections made
// to the proxy port directly must report none.
func TestOriginalDestination(t *testing.T) {
	forwardtest.RunNATCases(t, "tcp", 80, func(t *testing.T, listen netip.AddrPort, chooser *forwardtest.Chooser) uint16 {
		checkNoLeaks(t)
		chooser.Set(forwardtest.StartTCPEcho(t, forwardtest.Loopback("4")))
		ln, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(listen))
		if err != nil {
			t.Fatal(err)
		}
		p := &Proxy{Listener: ln, Chooser: chooser, Log: new(forwardtest.Logger(t)), Loops: newTestLoops(t, 2)}
		done := make(chan error, 1)
		go func() { done <- p.Serve() }()
		t.Cleanup(func() {
			p.Close()
			<-done
		})
		return forwardtest.ListenerAddr(ln).Port()
	}, func(t *testing.T, target netip.AddrPort) {
		c := forwardtest.DialTCP(t, target)
		if got, err := forwardtest.RoundTrip(c, []byte("hello")); err != nil || string(got) != "hello" {
			t.Fatalf("round trip: %q, %v", got, err)
		}
	})
}
