package udp

import (
	"errors"
	"net"
	"net/netip"
	"sync"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/proxyproto"
)

// proxyMarkers name the functions of this package's proxies in goroutine stacks.
var proxyMarkers = []string{"udp.(*Poller)", "udp.(*Proxy)", "udp.(*udpSession)", "udp.(*udpRelay)"}

// checkNoLeaks fails the test if goroutines of this package's proxies remain once its cleanups
// have run (forwardtest.CheckNoLeaks). Call it first in a test, so its cleanup runs last.
func checkNoLeaks(t *testing.T) { forwardtest.CheckNoLeaks(t, proxyMarkers...) }

// chooseCall is one recorded forward.Chooser.Choose call.
type chooseCall struct {
	Client, Dst netip.AddrPort
	Reset       bool
}

// fakeChooser returns its endpoints in turn (round robin), or err, and records every call.
type fakeChooser struct {
	mu        sync.Mutex
	Endpoints []netip.AddrPort
	Err       error
	next      int
	calls     []chooseCall
	// Returned in every forward.Target.
	Transparent   bool
	ProxyProtocol proxyproto.Version
}

var _ forward.Chooser = (*fakeChooser)(nil)

func (c *fakeChooser) Choose(client, dst netip.AddrPort, reset bool) (forward.Target, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls = append(c.calls, chooseCall{Client: client, Dst: dst, Reset: reset})
	if c.Err != nil {
		return forward.Target{}, c.Err
	}
	if len(c.Endpoints) == 0 {
		return forward.Target{}, errors.New("no endpoints")
	}
	ep := c.Endpoints[c.next%len(c.Endpoints)]
	c.next++
	return forward.Target{Endpoint: ep, Transparent: c.Transparent, ProxyProtocol: c.ProxyProtocol}, nil
}

func (c *fakeChooser) Set(endpoints ...netip.AddrPort) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.Endpoints, c.next = endpoints, 0
}

func (c *fakeChooser) Recorded() []chooseCall {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]chooseCall(nil), c.calls...)
}

func (c *fakeChooser) Resets() []bool {
	var out []bool
	for _, call := range c.Recorded() {
		out = append(out, call.Reset)
	}
	return out
}

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
