package tcp

import (
	"context"
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// proxyMarkers name the functions of this package's proxies in goroutine stacks.
var proxyMarkers = []string{"tcp.(*Proxy)", "tcp.(*loop)", "tcp.(*tcpRelay)"}

// checkNoLeaks fails the test if goroutines of this package's proxies remain once its cleanups
// have run (forwardtest.CheckNoLeaks). Call it first in a test, so its cleanup runs last.
func checkNoLeaks(t *testing.T) { forwardtest.CheckNoLeaks(t, proxyMarkers...) }

// proxyGoroutines returns the stacks of goroutines running this package's proxies.
func proxyGoroutines() string { return forwardtest.Goroutines(proxyMarkers...) }

// loopForTest puts p on two event loops of its own (Proxy.Loops) unless the test gave it
// some: a listener is on two loops, each accepting for itself, as the proxier places it. Call
// it before the proxy serves, and before registering the cleanup that shuts it down (the loops
// are closed after).
func loopForTest(t testing.TB, p *Proxy) {
	t.Helper()
	if p.Loops == nil {
		p.Loops = newTestLoops(t, 2)
	}
}

// newTestLoops starts n event loops, closed when the test ends (after the cleanups registered
// later, such as a proxy's shutdown).
func newTestLoops(t testing.TB, n int) *Loops {
	t.Helper()
	ls, err := NewLoops(n)
	if err != nil {
		t.Fatalf("event loops: %v", err)
	}
	t.Cleanup(func() { ls.Close() })
	return ls
}

// proxyRun is a Proxy serving in the background of a test.
type proxyRun struct {
	*Proxy
	addr   netip.AddrPort
	served chan error
}

// startTCPProxy serves a Proxy on a loopback listener; configure adjusts its fields. The
// test's cleanup shuts it down, cutting what is left, and checks that Serve returned nil.
func startTCPProxy(t testing.TB, family string, chooser forward.Chooser, configure func(*Proxy)) *proxyRun {
	t.Helper()
	ln, err := Listen("tcp", net.TCPAddrFromAddrPort(netip.AddrPortFrom(forwardtest.Loopback(family), 0)))
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	p := &Proxy{Listener: ln, Chooser: chooser, Log: new(forwardtest.Logger(t))}
	if configure != nil {
		configure(p)
	}
	loopForTest(t, p)
	r := &proxyRun{Proxy: p, addr: forwardtest.ListenerAddr(p.Listener), served: make(chan error, 1)}
	go func() { r.served <- p.Serve() }()
	t.Cleanup(func() {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		p.Shutdown(ctx)
		if err := <-r.served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return r
}

// TestLeakCheckSeesProxies makes sure checkNoLeaks can fail: a serving proxy's goroutines are
// found, and none once it is closed.
func TestLeakCheckSeesProxies(t *testing.T) {
	loops, err := NewLoops(1)
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{Listener: forwardtest.ListenTCP(t, forwardtest.Loopback("4")), Chooser: &forwardtest.Chooser{}, Loops: loops}
	served := make(chan error, 1)
	go func() { served <- p.Serve() }()
	forwardtest.Eventually(t, "Serve and the loop to show in goroutine stacks", func() bool {
		g := proxyGoroutines()
		return strings.Contains(g, "tcp.(*Proxy)") && strings.Contains(g, "tcp.(*loop)")
	})
	p.Close()
	<-served
	loops.Close()
	if g := proxyGoroutines(); g != "" {
		t.Errorf("goroutines after Close:\n%s", g)
	}
}

// budgetPipes returns the pool of idle splice pipes of the proxies sharing b.
func budgetPipes(b *forward.Budget) *pipePool { return (&Proxy{Budget: b}).pipePool() }
