package udp

import (
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// The portable UDP relay (relay.go) is the UDP engine of other operating systems; these tests run
// it on any OS, on loopback.

// startRelayUDP serves a Proxy with the portable relay until the test ends.
func startRelayUDP(t *testing.T, chooser forward.Chooser, configure func(*Proxy)) (netip.AddrPort, *udpRelay, *forwardtest.Metrics) {
	t.Helper()
	conn, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(forwardtest.Loopback("4"), 0)))
	if err != nil {
		t.Fatal(err)
	}
	m := &forwardtest.Metrics{}
	p := &Proxy{Conn: conn, Chooser: chooser, Log: new(forwardtest.Logger(t)), Metrics: m}
	if configure != nil {
		configure(p)
	}
	r := newUDPRelay(p)
	served := make(chan error, 1)
	go func() { served <- r.serve() }()
	t.Cleanup(func() {
		if err := r.close(); err != nil {
			t.Errorf("close: %v", err)
		}
		if err := <-served; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return conn.LocalAddr().(*net.UDPAddr).AddrPort(), r, m
}

func TestRelayUDPSessions(t *testing.T) {
	checkNoLeaks(t)
	a := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "a:")
	b := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "b:")
	// The session timeout is short so that the idle-out below comes soon; the exchanges before it
	// must all fall within it. On a loaded machine they may not: then the scenario runs again
	// with a longer timeout (a session that idled out early is seen in the metrics, not guessed).
	for timeout := 50 * time.Millisecond; ; timeout *= 4 {
		if relayUDPSessions(t, a, b, timeout) {
			return
		}
		if timeout > 5*time.Second {
			t.Fatalf("a session idled out between exchanges even with a %v timeout", timeout)
		}
		t.Logf("a session idled out between exchanges with a %v timeout: again with a longer one", timeout)
	}
}

// relayUDPSessions runs TestRelayUDPSessions' scenario on a relay of its own with the given
// session timeout. It reports false, having checked nothing, when a session idled out before the
// scenario meant it to.
func relayUDPSessions(t *testing.T, a, b netip.AddrPort, timeout time.Duration) bool {
	ch := &forwardtest.Chooser{}
	ch.Set(a, b)
	addr, _, m := startRelayUDP(t, ch, func(p *Proxy) { p.Timeout = timeout })
	c1, c2 := forwardtest.DialUDP(t, addr), forwardtest.DialUDP(t, addr)
	var got []string
	for _, c := range []*net.UDPConn{c1, c2, c1, c2} {
		reply, err := forwardtest.UDPExchange(c, []byte("hi"), 3, time.Second)
		if err != nil {
			t.Fatalf("exchange: %v", err)
		}
		got = append(got, string(reply))
	}
	if m.Snapshot().SessionsClosed != 0 {
		return false
	}
	if want := "[a:hi b:hi a:hi b:hi]"; fmt.Sprint(got) != want {
		t.Errorf("replies %v, want %s: a session per client, each staying on its endpoint", got, want)
	}
	if n := len(ch.Recorded()); n != 2 {
		t.Errorf("Choose called %d times, want once per client", n)
	}
	// Idle for the timeout, both sessions end; a new datagram opens a new session.
	forwardtest.Eventually(t, "both sessions idle out", func() bool { return m.Snapshot().SessionsClosed == 2 })
	if _, err := forwardtest.UDPExchange(c1, []byte("again"), 3, time.Second); err != nil {
		t.Fatalf("exchange after the timeout: %v", err)
	}
	if s := m.Snapshot(); s.SessionsOpened != 3 || len(ch.Recorded()) != 3 {
		t.Errorf("after the timeout: %d sessions opened, %d choices; want 3 and 3", s.SessionsOpened, len(ch.Recorded()))
	}
	return true
}

func TestRelayUDPRefusedEndpoint(t *testing.T) {
	checkNoLeaks(t)
	dead, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(forwardtest.Loopback("4"), 0)))
	if err != nil {
		t.Fatal(err)
	}
	deadAddr := dead.LocalAddr().(*net.UDPAddr).AddrPort()
	dead.Close() // nothing listens: the kernel answers with ICMP port unreachable
	echo := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "e:")
	ch := &forwardtest.Chooser{}
	ch.Set(deadAddr, echo)
	addr, _, m := startRelayUDP(t, ch, nil)
	c := forwardtest.DialUDP(t, addr)
	reply, err := forwardtest.UDPExchange(c, []byte("x"), 5, 200*time.Millisecond)
	if err != nil || string(reply) != "e:x" {
		t.Fatalf("exchange: %q, %v; want the second endpoint's answer", reply, err)
	}
	if got := fmt.Sprint(ch.Resets()); got != "[false true]" {
		t.Errorf("Choose resets %s, want [false true]", got)
	}
	if s := m.Snapshot(); len(s.DialFailed) != 1 || s.DialFailed[0] != deadAddr {
		t.Errorf("DialFailed %v, want [%v]", s.DialFailed, deadAddr)
	}
	if got := ch.Unreachables(); len(got) != 1 || got[0] != deadAddr {
		t.Errorf("Unreachable reported %v, want [%v]", got, deadAddr)
	}
}

func TestRelayUDPMaxSessionsEvicts(t *testing.T) {
	checkNoLeaks(t)
	echo := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "e:")
	ch := &forwardtest.Chooser{}
	ch.Set(echo)
	addr, r, m := startRelayUDP(t, ch, func(p *Proxy) { p.MaxSessions = 1 })
	c1, c2 := forwardtest.DialUDP(t, addr), forwardtest.DialUDP(t, addr)
	for _, c := range []*net.UDPConn{c1, c2} {
		if _, err := forwardtest.UDPExchange(c, []byte("x"), 3, time.Second); err != nil {
			t.Fatal(err)
		}
	}
	if s := m.Snapshot(); s.Evicted != 1 {
		t.Errorf("%d sessions evicted, want 1", s.Evicted)
	}
	r.mu.Lock()
	n := len(r.sessions)
	r.mu.Unlock()
	if n != 1 {
		t.Errorf("%d sessions, want MaxSessions (1)", n)
	}
}

func TestRelayUDPDropSessions(t *testing.T) {
	checkNoLeaks(t)
	a := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "a:")
	b := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "b:")
	ch := &forwardtest.Chooser{}
	ch.Set(a, b)
	addr, r, m := startRelayUDP(t, ch, nil)
	c1, c2 := forwardtest.DialUDP(t, addr), forwardtest.DialUDP(t, addr)
	for _, c := range []*net.UDPConn{c1, c2} {
		if _, err := forwardtest.UDPExchange(c, []byte("x"), 3, time.Second); err != nil {
			t.Fatal(err)
		}
	}
	if n := r.dropSessions(func(ep netip.AddrPort) bool { return ep != a }); n != 1 {
		t.Errorf("dropSessions ended %d sessions, want 1 (the one on %v)", n, a)
	}
	forwardtest.Eventually(t, "the dropped session closed", func() bool { return m.Snapshot().SessionsClosed == 1 })
	// c1's next datagram opens a new session, chosen again.
	ch.Set(b)
	if reply, err := forwardtest.UDPExchange(c1, []byte("y"), 3, time.Second); err != nil || string(reply) != "b:y" {
		t.Errorf("after the drop: %q, %v; want a new session on b", reply, err)
	}
}
