package udp

import (
	"net"
	"net/netip"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// proxyMarkers name the functions of this package's proxies in goroutine stacks.
var proxyMarkers = []string{"udp.(*Poller)", "udp.(*Proxy)", "udp.(*udpSession)", "udp.(*udpRelay)"}

// checkNoLeaks fails the test if goroutines of this package's proxies remain once its cleanups
// have run (forwardtest.CheckNoLeaks). Call it first in a test, so its cleanup runs last.
func checkNoLeaks(t *testing.T) { forwardtest.CheckNoLeaks(t, proxyMarkers...) }

// udpRun is a Proxy serving in the background of a test.
type udpRun struct {
	*Proxy
	addr   netip.AddrPort
	served chan error
}

func startUDPProxy(t testing.TB, family string, chooser forward.Chooser, configure func(*Proxy)) *udpRun {
	t.Helper()
	conn, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(forwardtest.Loopback(family), 0)))
	if err != nil {
		t.Fatalf("listen UDP: %v", err)
	}
	p := &Proxy{Conn: conn, Chooser: chooser, Log: new(forwardtest.Logger(t))}
	if configure != nil {
		configure(p)
	}
	r := &udpRun{Proxy: p, addr: conn.LocalAddr().(*net.UDPAddr).AddrPort(), served: make(chan error, 1)}
	go func() { r.served <- p.Serve() }()
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if err := <-r.served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return r
}
