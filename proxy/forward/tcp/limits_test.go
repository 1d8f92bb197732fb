//go:build linux

package tcp

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// refusedAtOnce connects to addr and reports whether the proxy reset the connection without
// serving it (on loopback the reset may even reach the connect). A served connection is kept
// open until the test ends.
func refusedAtOnce(t *testing.T, addr netip.AddrPort) bool {
	t.Helper()
	c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(addr))
	if err != nil {
		if errors.Is(err, syscall.ECONNRESET) {
			return true
		}
		t.Fatalf("dial %s: %v", addr, err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(forwardtest.WaitTimeout))
	got, err := forwardtest.RoundTrip(c, []byte("x"))
	if err != nil && !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, io.EOF) && !errors.Is(err, syscall.EPIPE) {
		t.Fatalf("connection to %s: %v", addr, err)
	}
	return err != nil || string(got) != "x"
}

// TestTCPMaxConns: a port at its connection limit resets new connections at once and counts
// them; once one ends, a new one is served; the budget is whole again when all are gone.
func TestTCPMaxConns(t *testing.T) {
	checkNoLeaks(t)
	backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	metrics := &forwardtest.Metrics{}
	budget := forward.NewBudget(1000)
	p := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.MaxConns, p.Budget, p.Metrics = 3, budget, metrics
	})
	var open []*net.TCPConn
	for i := range 3 {
		c := forwardtest.DialTCP(t, p.addr)
		if got, err := forwardtest.RoundTrip(c, []byte("a")); err != nil || string(got) != "a" {
			t.Fatalf("connection %d within the limit: %q, %v", i, got, err)
		}
		open = append(open, c)
	}
	if !refusedAtOnce(t, p.addr) {
		t.Errorf("a fourth connection was served beyond MaxConns 3")
	}
	if m := metrics.Snapshot(); m.Refused != 1 || m.Accepted != 3 {
		t.Errorf("metrics %+v, want 3 accepted and 1 refused", m)
	}
	open[0].Close()
	forwardtest.Eventually(t, "the closed connection to free its slot", func() bool {
		return liveConns(p.Proxy) == 2
	})
	c := forwardtest.DialTCP(t, p.addr)
	if got, err := forwardtest.RoundTrip(c, []byte("b")); err != nil || string(got) != "b" {
		t.Errorf("a connection after one ended: %q, %v", got, err)
	}
	for _, c := range append(open[1:], c) {
		c.Close()
	}
	forwardtest.Eventually(t, "the connections' descriptors back in the budget", func() bool {
		budgetPipes(budget).DropIdle() // idle pipes hold descriptors of the budget too
		return budget.InUse() == 0
	})
}

// TestTCPFloodOnOnePortSparesAnother: two ports share a budget; a flood of connections to one,
// held open, stops at that port's limit, and the other port is still served.
func TestTCPFloodOnOnePortSparesAnother(t *testing.T) {
	checkNoLeaks(t)
	backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	budget := forward.NewBudget(12 * tcpConnFDs)
	flooded := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.MaxConns, p.Budget = 6, budget
	})
	other := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.MaxConns, p.Budget = 6, budget
	})
	served := 0
	for range 20 {
		if !refusedAtOnce(t, flooded.addr) {
			served++ // held open: the flood keeps its connections
		}
	}
	if served != 6 {
		t.Errorf("the flooded port served %d connections, want its limit 6", served)
	}
	c := forwardtest.DialTCP(t, other.addr)
	if got, err := forwardtest.RoundTrip(c, []byte("ok")); err != nil || string(got) != "ok" {
		t.Errorf("the other port during the flood: %q, %v", got, err)
	}
}

// TestTCPBudgetSpentRefuses: with the budget spent, a port with no limit of its own resets new
// connections, and connections go on without splice pipes when the budget has no room for one.
func TestTCPBudgetSpentRefuses(t *testing.T) {
	checkNoLeaks(t)
	backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	budget := forward.NewBudget(2 * tcpConnFDs) // two connections, no pipe
	metrics := &forwardtest.Metrics{}
	p := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.Budget, p.Metrics = budget, metrics
	})
	for i := range 2 {
		c := forwardtest.DialTCP(t, p.addr)
		if got, err := forwardtest.RoundTrip(c, []byte("copied without a pipe")); err != nil || string(got) != "copied without a pipe" {
			t.Fatalf("connection %d within the budget: %q, %v", i, got, err)
		}
		// The first connection alone leaves room for a pipe, which its direction may still hold
		// for a moment after the echo came back; a pipe back in the pool is dropped when a
		// connection needs the room.
		forwardtest.Eventually(t, "every pipe back in the pool", func() bool {
			budgetPipes(budget).mu.Lock()
			idle := len(budgetPipes(budget).free)
			budgetPipes(budget).mu.Unlock()
			return budget.InUse() == (i+1)*tcpConnFDs+idle*pipeFDs
		})
	}
	if !refusedAtOnce(t, p.addr) {
		t.Errorf("a connection beyond the budget was served")
	}
	if m := metrics.Snapshot(); m.Refused != 1 {
		t.Errorf("refused %d, want 1", m.Refused)
	}
}

// TestTCPIdleTimeout: a connection that moves nothing either way for IdleTimeout is reset; one
// that keeps moving data in one direction only lives on.
func TestTCPIdleTimeout(t *testing.T) {
	checkNoLeaks(t)
	backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	const idle = time.Second // well above a loaded machine's scheduling stalls
	p := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.IdleTimeout = idle
	})
	quiet, busy := forwardtest.DialTCP(t, p.addr), forwardtest.DialTCP(t, p.addr)
	for _, c := range []*net.TCPConn{quiet, busy} {
		if _, err := forwardtest.RoundTrip(c, []byte("hi")); err != nil {
			t.Fatal(err)
		}
	}
	// busy sends a byte every idle/5 for 3 × idle (the echo keeps the other direction busy
	// too; its replies are left unread until the end, which is activity all the same).
	start := time.Now()
	for time.Since(start) < 3*idle {
		if _, err := busy.Write([]byte("b")); err != nil {
			t.Fatalf("the busy connection failed after %v: %v", time.Since(start), err)
		}
		time.Sleep(idle / 5)
	}
	_ = quiet.SetReadDeadline(time.Now().Add(forwardtest.WaitTimeout))
	if n, err := quiet.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("the idle connection: read %d bytes, %v; want it ended by the proxy", n, err)
	}
	if got, err := forwardtest.RoundTrip(busy, []byte("!")); err != nil || len(got) != 1 {
		t.Errorf("the busy connection after 3 idle timeouts: %q, %v", got, err)
	}
}
