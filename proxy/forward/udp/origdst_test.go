//go:build linux

package udp

import (
	"bytes"
	"net"
	"net/netip"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// TestOriginalDestination checks the ctnetlink lookup of the original destination against real
// NAT: in a network namespace of its own (forwardtest.InNATNetns) it sends UDP datagrams to a
// "service" address that iptables DNATs or REDIRECTs to the proxy. The Chooser must see the
// service address; datagrams sent to the proxy port directly must report none; replies must
// reach a client connected to the service address (conntrack un-NATs them).
func TestOriginalDestination(t *testing.T) {
	forwardtest.InNATNetns(t, func(t *testing.T) {
		for _, tc := range forwardtest.NATCases("udp", 53) {
			t.Run(tc.Name, func(t *testing.T) {
				checkNoLeaks(t)
				chooser := &fakeChooser{}
				chooser.Set(forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), ""))
				conn, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.MustParseAddrPort(tc.Listen)))
				if err != nil {
					t.Fatal(err)
				}
				p := &Proxy{Conn: conn, Chooser: chooser, Log: new(forwardtest.Logger(t))}
				done := make(chan error, 1)
				go func() { done <- p.Serve() }()
				t.Cleanup(func() {
					p.Close()
					<-done
				})
				target, service := tc.Dest(t, "udp", conn.LocalAddr().(*net.UDPAddr).AddrPort().Port())

				c := forwardtest.DialUDP(t, target)
				// The socket is connected to the service address: only a reply whose
				// source conntrack rewrote back to it is delivered.
				if got, err := forwardtest.UDPExchange(c, []byte("hello"), 1, forwardtest.WaitTimeout); err != nil || !bytes.Equal(got, []byte("hello")) {
					t.Fatalf("exchange: %q, %v", got, err)
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
