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
// NAT: in a network namespace of its own (forwardtest.RunNATCases) it sends UDP datagrams to a
// "service" address that iptables DNATs or REDIRECTs to the proxy. The Chooser must see the
// service address; datagrams sent to the proxy port directly must report none; replies must
// reach a client connected to the service address (conntrack un-NATs them).
func TestOriginalDestination(t *testing.T) {
	forwardtest.RunNATCases(t, "udp", 53, func(t *testing.T, listen netip.AddrPort, chooser *forwardtest.Chooser) uint16 {
		checkNoLeaks(t)
		chooser.Set(forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), ""))
		conn, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(listen))
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
		return conn.LocalAddr().(*net.UDPAddr).AddrPort().Port()
	}, func(t *testing.T, target netip.AddrPort) {
		c := forwardtest.DialUDP(t, target)
		// The socket is connected to the service address: only a reply whose source conntrack
		// rewrote back to it is delivered.
		if got, err := forwardtest.UDPExchange(c, []byte("hello"), 1, forwardtest.WaitTimeout); err != nil || !bytes.Equal(got, []byte("hello")) {
			t.Fatalf("exchange: %q, %v", got, err)
		}
	})
}
