package forward

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/proxyproto"
)

// The portable relays (relay_tcp.go, relay_udp.go) are the engines of other operating systems;
// these tests run them on any OS, on loopback.

// startRelayTCP serves a TCPProxy with the portable relay until the test ends.
func startRelayTCP(t *testing.T, chooser Chooser, configure func(*TCPProxy)) (netip.AddrPort, *TCPProxy) {
	t.Helper()
	ln := listenTCP(t, loopback("4"))
	p := &TCPProxy{Listener: ln, Chooser: chooser, Log: new(testLogger(t)), Metrics: &fakeMetrics{}}
	if configure != nil {
		configure(p)
	}
	r := newTCPRelay(p)
	served := make(chan error, 1)
	go func() { served <- r.serve() }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		if err := r.shutdown(ctx); err != nil {
			t.Errorf("shutdown: %v", err)
		}
		if err := <-served; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return listenerAddr(ln), p
}

// answerTCP returns a handler that writes tag and closes.
func answerTCP(tag string) func(*net.TCPConn) {
	return func(c *net.TCPConn) { _, _ = io.WriteString(c, tag) }
}

func TestRelayTCPRoundRobin(t *testing.T) {
	checkNoLeaks(t)
	a := startTCPServer(t, loopback("4"), answerTCP("a"))
	b := startTCPServer(t, loopback("4"), answerTCP("b"))
	ch := &fakeChooser{}
	ch.set(a, b)
	addr, p := startRelayTCP(t, ch, nil)
	var got []string
	for range 4 {
		c := dialTCPTest(t, addr)
		data, err := io.ReadAll(c)
		if err != nil {
			t.Fatalf("read: %v", err)
		}
		got = append(got, string(data))
		c.Close()
	}
	if strings.Join(got, "") != "abab" {
		t.Errorf("answers %q, want a, b, a, b", got)
	}
	for _, call := range ch.recorded() {
		if call.reset || call.dst.IsValid() || call.client.Addr() != loopback("4") {
			t.Errorf("Choose(%v, %v, %v): want the client's loopback address, no destination, no reset", call.client, call.dst, call.reset)
		}
	}
	m := p.Metrics.(*fakeMetrics)
	eventually(t, "four connections closed", func() bool { s := m.snapshot(); return s.accepted == 4 && s.closed == 4 })
	if s := m.snapshot(); s.fromEndpoint != 4 || s.failed != 0 {
		t.Errorf("metrics %+v: want 4 bytes from endpoints, no failure", s)
	}
}

func TestRelayTCPFailover(t *testing.T) {
	checkNoLeaks(t)
	closed := closedTCPPort(t, loopback("4"))
	echo := startTCPEcho(t, loopback("4"))
	ch := &fakeChooser{}
	ch.set(closed, echo)
	addr, p := startRelayTCP(t, ch, nil)
	c := dialTCPTest(t, addr)
	if got, err := roundTrip(c, []byte("ping")); err != nil || string(got) != "ping" {
		t.Fatalf("round trip: %q, %v", got, err)
	}
	if got := fmt.Sprint(ch.resets()); got != "[false true]" {
		t.Errorf("Choose resets %s, want [false true]", got)
	}
	if s := p.Metrics.(*fakeMetrics).snapshot(); len(s.dialFailed) != 1 || s.dialFailed[0] != closed {
		t.Errorf("DialFailed %v, want [%v]", s.dialFailed, closed)
	}
}

func TestRelayTCPNoEndpointReached(t *testing.T) {
	checkNoLeaks(t)
	closed := closedTCPPort(t, loopback("4"))
	ch := &fakeChooser{}
	ch.set(closed)
	addr, p := startRelayTCP(t, ch, func(p *TCPProxy) { p.DialTimeouts = []time.Duration{time.Second, time.Second} })
	if err := dialAndRead(addr); !isConnReset(err) {
		t.Errorf("connection: %v, want a reset", err)
	}
	if got := fmt.Sprint(ch.resets()); got != "[false true]" {
		t.Errorf("Choose resets %s, want one attempt per dial timeout: [false true]", got)
	}
	m := p.Metrics.(*fakeMetrics)
	eventually(t, "the connection failed", func() bool { return m.snapshot().failed == 1 })
}

func TestRelayTCPHalfClose(t *testing.T) {
	checkNoLeaks(t)
	echo := startTCPEcho(t, loopback("4"))
	ch := &fakeChooser{}
	ch.set(echo)
	addr, _ := startRelayTCP(t, ch, nil)
	c := dialTCPTest(t, addr)
	if _, err := c.Write([]byte("half")); err != nil {
		t.Fatal(err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	// The echo answers only what came before the EOF and half-closes after it: the relay must
	// pass the client's EOF on and keep the other direction open until the endpoint's.
	got, err := io.ReadAll(c)
	if err != nil || string(got) != "half" {
		t.Errorf("after half-close read %q, %v; want \"half\" then EOF", got, err)
	}
}

func TestRelayTCPProxyHeader(t *testing.T) {
	checkNoLeaks(t)
	lines := make(chan string, 1)
	srv := startTCPServer(t, loopback("4"), func(c *net.TCPConn) {
		line, _ := bufio.NewReader(c).ReadString('\n')
		lines <- line
	})
	ch := &fakeChooser{proxyProtocol: proxyproto.V1}
	ch.set(srv)
	addr, _ := startRelayTCP(t, ch, nil)
	c := dialTCPTest(t, addr)
	client := tcpAddrPort(c.LocalAddr())
	want := fmt.Sprintf("PROXY TCP4 %s %s %d %d\r\n", client.Addr(), addr.Addr(), client.Port(), addr.Port())
	if got := <-lines; got != want {
		t.Errorf("header %q, want %q", got, want)
	}
}

func TestRelayTCPMaxConns(t *testing.T) {
	checkNoLeaks(t)
	echo := startTCPEcho(t, loopback("4"))
	ch := &fakeChooser{}
	ch.set(echo)
	addr, p := startRelayTCP(t, ch, func(p *TCPProxy) { p.MaxConns = 1 })
	first := dialTCPTest(t, addr)
	if _, err := roundTrip(first, []byte("1")); err != nil {
		t.Fatal(err)
	}
	if err := dialAndRead(addr); !isConnReset(err) {
		t.Errorf("second connection: %v, want a reset", err)
	}
	if s := p.Metrics.(*fakeMetrics).snapshot(); s.refused != 1 || s.accepted != 1 {
		t.Errorf("metrics %+v: want 1 accepted, 1 refused", s)
	}
	first.Close()
	m := p.Metrics.(*fakeMetrics)
	eventually(t, "the first connection ended", func() bool { return m.snapshot().closed == 1 })
	third := dialTCPTest(t, addr)
	if _, err := roundTrip(third, []byte("3")); err != nil {
		t.Errorf("a connection after the first ended: %v", err)
	}
}

func TestRelayTCPIdleTimeout(t *testing.T) {
	checkNoLeaks(t)
	echo := startTCPEcho(t, loopback("4"))
	ch := &fakeChooser{}
	ch.set(echo)
	addr, _ := startRelayTCP(t, ch, func(p *TCPProxy) { p.IdleTimeout = 50 * time.Millisecond })
	c := dialTCPTest(t, addr)
	if _, err := roundTrip(c, []byte("x")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Read(make([]byte, 1)); !isConnReset(err) {
		t.Errorf("idle connection read: %v, want a reset", err)
	}
}

// dialAndRead connects to addr and reads a byte; it returns the error of either, as the reset of
// a connection refused at once may come before the dial has seen its connect succeed.
func dialAndRead(addr netip.AddrPort) error {
	c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(addr))
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(waitTimeout))
	_, err = c.Read(make([]byte, 1))
	return err
}

// isConnReset reports whether err is a connection reset (not a FIN's EOF).
func isConnReset(err error) bool {
	return err != nil && strings.Contains(err.Error(), "reset")
}

// startRelayUDP serves a UDPProxy with the portable relay until the test ends.
func startRelayUDP(t *testing.T, chooser Chooser, configure func(*UDPProxy)) (netip.AddrPort, *udpRelay, *fakeMetrics) {
	t.Helper()
	conn, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(loopback("4"), 0)))
	if err != nil {
		t.Fatal(err)
	}
	m := &fakeMetrics{}
	p := &UDPProxy{Conn: conn, Chooser: chooser, Log: new(testLogger(t)), Metrics: m}
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
	a := startUDPEcho(t, loopback("4"), "a:")
	b := startUDPEcho(t, loopback("4"), "b:")
	ch := &fakeChooser{}
	ch.set(a, b)
	addr, _, m := startRelayUDP(t, ch, func(p *UDPProxy) { p.Timeout = 50 * time.Millisecond })
	c1, c2 := dialUDPTest(t, addr), dialUDPTest(t, addr)
	var got []string
	for _, c := range []*net.UDPConn{c1, c2, c1, c2} {
		reply, err := udpExchange(c, []byte("hi"), 3, time.Second)
		if err != nil {
			t.Fatalf("exchange: %v", err)
		}
		got = append(got, string(reply))
	}
	if want := "[a:hi b:hi a:hi b:hi]"; fmt.Sprint(got) != want {
		t.Errorf("replies %v, want %s: a session per client, each staying on its endpoint", got, want)
	}
	if n := len(ch.recorded()); n != 2 {
		t.Errorf("Choose called %d times, want once per client", n)
	}
	// Idle for the timeout, both sessions end; a new datagram opens a new session.
	eventually(t, "both sessions idle out", func() bool { return m.snapshot().sessionsClosed == 2 })
	if _, err := udpExchange(c1, []byte("again"), 3, time.Second); err != nil {
		t.Fatalf("exchange after the timeout: %v", err)
	}
	if s := m.snapshot(); s.sessionsOpened != 3 || len(ch.recorded()) != 3 {
		t.Errorf("after the timeout: %d sessions opened, %d choices; want 3 and 3", s.sessionsOpened, len(ch.recorded()))
	}
}

func TestRelayUDPRefusedEndpoint(t *testing.T) {
	checkNoLeaks(t)
	dead, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(loopback("4"), 0)))
	if err != nil {
		t.Fatal(err)
	}
	deadAddr := dead.LocalAddr().(*net.UDPAddr).AddrPort()
	dead.Close() // nothing listens: the kernel answers with ICMP port unreachable
	echo := startUDPEcho(t, loopback("4"), "e:")
	ch := &fakeChooser{}
	ch.set(deadAddr, echo)
	addr, _, m := startRelayUDP(t, ch, nil)
	c := dialUDPTest(t, addr)
	reply, err := udpExchange(c, []byte("x"), 5, 200*time.Millisecond)
	if err != nil || string(reply) != "e:x" {
		t.Fatalf("exchange: %q, %v; want the second endpoint's answer", reply, err)
	}
	if got := fmt.Sprint(ch.resets()); got != "[false true]" {
		t.Errorf("Choose resets %s, want [false true]", got)
	}
	if s := m.snapshot(); len(s.dialFailed) != 1 || s.dialFailed[0] != deadAddr {
		t.Errorf("DialFailed %v, want [%v]", s.dialFailed, deadAddr)
	}
}

func TestRelayUDPMaxSessionsEvicts(t *testing.T) {
	checkNoLeaks(t)
	echo := startUDPEcho(t, loopback("4"), "e:")
	ch := &fakeChooser{}
	ch.set(echo)
	addr, r, m := startRelayUDP(t, ch, func(p *UDPProxy) { p.MaxSessions = 1 })
	c1, c2 := dialUDPTest(t, addr), dialUDPTest(t, addr)
	for _, c := range []*net.UDPConn{c1, c2} {
		if _, err := udpExchange(c, []byte("x"), 3, time.Second); err != nil {
			t.Fatal(err)
		}
	}
	if s := m.snapshot(); s.evicted != 1 {
		t.Errorf("%d sessions evicted, want 1", s.evicted)
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
	a := startUDPEcho(t, loopback("4"), "a:")
	b := startUDPEcho(t, loopback("4"), "b:")
	ch := &fakeChooser{}
	ch.set(a, b)
	addr, r, m := startRelayUDP(t, ch, nil)
	c1, c2 := dialUDPTest(t, addr), dialUDPTest(t, addr)
	for _, c := range []*net.UDPConn{c1, c2} {
		if _, err := udpExchange(c, []byte("x"), 3, time.Second); err != nil {
			t.Fatal(err)
		}
	}
	if n := r.dropSessions(func(ep netip.AddrPort) bool { return ep != a }); n != 1 {
		t.Errorf("dropSessions ended %d sessions, want 1 (the one on %v)", n, a)
	}
	eventually(t, "the dropped session closed", func() bool { return m.snapshot().sessionsClosed == 1 })
	// c1's next datagram opens a new session, chosen again.
	ch.set(b)
	if reply, err := udpExchange(c1, []byte("y"), 3, time.Second); err != nil || string(reply) != "b:y" {
		t.Errorf("after the drop: %q, %v; want a new session on b", reply, err)
	}
}
