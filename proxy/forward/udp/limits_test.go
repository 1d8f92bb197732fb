//go:build linux

package udp

import (
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// TestUDPMaxSessions: a port at its session limit ends its longest-idle session for a new
// client; the budget is whole again after Close.
func TestUDPMaxSessions(t *testing.T) {
	checkNoLeaks(t)
	backend := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "")
	metrics := &forwardtest.Metrics{}
	budget := forward.NewBudget(1000)
	p := startUDPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.MaxSessions, p.Budget, p.Metrics = 3, budget, metrics
	})
	var clients []*net.UDPConn
	for i := range 5 {
		c := forwardtest.DialUDP(t, p.addr)
		if _, err := forwardtest.UDPExchange(c, []byte{byte(i)}, 1, forwardtest.WaitTimeout); err != nil {
			t.Fatalf("client %d: %v", i, err)
		}
		clients = append(clients, c)
		time.Sleep(5 * time.Millisecond) // distinct activity stamps
	}
	if n := p.sessionCount(); n != 3 {
		t.Errorf("%d sessions, want the limit 3", n)
	}
	if m := metrics.Snapshot(); m.Evicted != 2 {
		t.Errorf("evicted %d sessions, want 2", m.Evicted)
	}
	// The newest clients kept their sessions: another exchange opens none.
	opened := metrics.Snapshot().SessionsOpened
	if _, err := forwardtest.UDPExchange(clients[4], []byte("again"), 1, forwardtest.WaitTimeout); err != nil {
		t.Fatal(err)
	}
	if m := metrics.Snapshot(); m.SessionsOpened != opened {
		t.Errorf("the newest client's session was evicted (sessions opened %d → %d)", opened, m.SessionsOpened)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if n := budget.InUse(); n != 0 {
		t.Errorf("%d descriptors still taken from the budget after Close", n)
	}
}

// TestUDPFloodOnOnePortSparesAnother: datagrams from many sources to one port fill only that
// port's sessions; another port sharing the budget still opens sessions.
func TestUDPFloodOnOnePortSparesAnother(t *testing.T) {
	checkNoLeaks(t)
	backend := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "")
	budget := forward.NewBudget(8)
	flooded := startUDPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.MaxSessions, p.Budget = 4, budget
	})
	other := startUDPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.MaxSessions, p.Budget = 4, budget
	})
	for i := range 30 {
		c := forwardtest.DialUDP(t, flooded.addr)
		if _, err := c.Write([]byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
	}
	forwardtest.Eventually(t, "the flooded port at its limit", func() bool { return flooded.sessionCount() == 4 })
	if _, err := forwardtest.UDPExchange(forwardtest.DialUDP(t, other.addr), []byte("ok"), 1, forwardtest.WaitTimeout); err != nil {
		t.Errorf("the other port during the flood: %v", err)
	}
	if n := flooded.sessionCount(); n > 4 {
		t.Errorf("the flooded port holds %d sessions, above its limit 4", n)
	}
}
