//go:build linux

package tcp

import (
	"net"
	"net/netip"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// TestOriginalDestination checks SO_ORIGINAL_DST against real NAT: in a network namespace of its
// own (forwardtest.InNATNetns) it makes TCP connections to a "service" address that iptables
// DNATs or REDIRECTs to the proxy. The Chooser must see the service address; connections made
// to the proxy port directly must report none.
func TestOriginalDestination(t *testing.T) {
	forwardtest.InNATNetns(t, func(t *testing.T) {
		for _, tc := range forwardtest.NATCases("tcp", 80) {
			t.Run(tc.Name, func(t *testing.T) {
				checkNoLeaks(t)
				chooser := &fakeChooser{}
				chooser.Set(forwardtest.StartTCPEcho(t, forwardtest.Loopback("4")))
				ln, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(netip.MustParseAddrPort(tc.Listen)))
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
				target, service := tc.Dest(t, "tcp", forwardtest.ListenerAddr(ln).Port())

				c := forwardtest.DialTCP(t, target)
				if got, err := forwardtest.RoundTrip(c, []byte("hello")); err != nil || string(got) != "hello" {
					t.Fatalf("round trip: %q, %v", got, err)
				}
				calls := chooser.Recorded()
				if len(calls) != 1 || calls[0].Dst != service {
					t.Fatalf("Choose calls %+v, want one with dst %v", calls, service)
				}
				t.Logf("client %v, dst %v", calls[0].Client, calls[0].Dst)
			})
		}
	})
}
