package tcp

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/proxyproto"
)

// The portable TCP relay (relay.go) is the TCP engine of other operating systems; these
// tests run it on any OS, on loopback.

// startRelayTCP serves a Proxy with the portable relay until the test ends.
func startRelayTCP(t *testing.T, chooser forward.Chooser, configure func(*Proxy)) (netip.AddrPort, *Proxy) {
	t.Helper()
	ln := forwardtest.ListenTCP(t, forwardtest.Loopback("4"))
	p := &Proxy{Listener: ln, Chooser: chooser, Log: new(forwardtest.Logger(t)), Metrics: &forwardtest.Metrics{}}
	if configure != nil {
		configure(p)
	}
	r := newTCPRelay(p)
	served := make(chan error, 1)
	go func() { served <- r.serve() }()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), forwardtest.WaitTimeout)
		defer cancel()
		if err := p.drain(ctx, r.close(), r.cut); err != nil { // what Shutdown does off Linux
			t.Errorf("shutdown: %v", err)
		}
		if err := <-served; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return forwardtest.ListenerAddr(ln), p
}

// answerTCP returns a handler that writes tag and closes.
func answerTCP(tag string) func(*net.TCPConn) {
	return func(c *net.TCPConn) { _, _ = io.WriteString(c, tag) }
}

func TestRelayTCPRoundRobin(t *testing.T) {
	checkNoLeaks(t)
	a := forwardtest.StartTCPServer(t, forwardtest.Loopback("4"), answerTCP("a"))
	b := forwardtest.StartTCPServer(t, forwardtest.Loopback("4"), answerTCP("b"))
	ch := &forwardtest.Chooser{}
	ch.Set(a, b)
	addr, p := startRelayTCP(t, ch, nil)
	var got []string
	for range 4 {
		c := forwardtest.DialTCP(t, addr)
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
	for _, call := range ch.Recorded() {
		if call.Reset || call.Dst.IsValid() || call.Client.Addr() != forwardtest.Loopback("4") {
			t.Errorf("Choose(%v, %v, %v): want the client's loopback address, no destination, no reset", call.Client, call.Dst, call.Reset)
		}
	}
	m := p.Metrics.(*forwardtest.Metrics)
	forwardtest.Eventually(t, "four connections closed", func() bool { s := m.Snapshot(); return s.Accepted == 4 && s.Closed == 4 })
	if s := m.Snapshot(); s.FromEndpoint != 4 || s.Failed != 0 {
		t.Errorf("metrics %+v: want 4 bytes from endpoints, no failure", s)
	}
}

// TestRelayTCPShutdown runs what Shutdown does off Linux (drain with the relay's close and
// cut): no new connection is accepted, an established one goes on until the grace period ends,
// and is then cut.
func TestRelayTCPShutdown(t *testing.T) {
	checkNoLeaks(t)
	echo := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	ch := &forwardtest.Chooser{}
	ch.Set(echo)
	ln := forwardtest.ListenTCP(t, forwardtest.Loopback("4"))
	addr := forwardtest.ListenerAddr(ln)
	p := &Proxy{Listener: ln, Chooser: ch, Log: new(forwardtest.Logger(t)), Metrics: &forwardtest.Metrics{}}
	r := newTCPRelay(p)
	served := make(chan error, 1)
	go func() { served <- r.serve() }()
	c := forwardtest.DialTCP(t, addr)
	if got, err := forwardtest.RoundTrip(c, []byte("before")); err != nil || string(got) != "before" {
		t.Fatalf("round trip before the shutdown: %q, %v", got, err)
	}

	grace, endGrace := context.WithCancel(context.Background())
	defer endGrace()
	shut := make(chan error, 1)
	go func() { shut <- p.drain(grace, r.close(), r.cut) }()
	if err := <-served; err != nil { // close returns once serve has
		t.Fatalf("serve: %v", err)
	}
	if c2, err := net.DialTimeout("tcp", addr.String(), forwardtest.WaitTimeout); err == nil {
		c2.Close()
		t.Error("a new connection was accepted after the shutdown began")
	}
	if got, err := forwardtest.RoundTrip(c, []byte("during")); err != nil || string(got) != "during" {
		t.Errorf("round trip while draining: %q, %v; want the connection served", got, err)
	}
	select {
	case err := <-shut:
		t.Fatalf("shutdown returned %v while a connection was open", err)
	default:
	}
	endGrace()
	if err := <-shut; !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "cut 1 connections") {
		t.Errorf("shutdown: %v; want the grace period's end, one connection cut", err)
	}
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Error("the cut connection still reads")
	}
}

func TestRelayTCPFailover(t *testing.T) {
	checkNoLeaks(t)
	closed := forwardtest.ClosedTCPPort(t, forwardtest.Loopback("4"))
	echo := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	ch := &forwardtest.Chooser{}
	ch.Set(closed, echo)
	addr, p := startRelayTCP(t, ch, nil)
	c := forwardtest.DialTCP(t, addr)
	if got, err := forwardtest.RoundTrip(c, []byte("ping")); err != nil || string(got) != "ping" {
		t.Fatalf("round trip: %q, %v", got, err)
	}
	if got := fmt.Sprint(ch.Resets()); got != "[false true]" {
		t.Errorf("Choose resets %s, want [false true]", got)
	}
	if s := p.Metrics.(*forwardtest.Metrics).Snapshot(); len(s.DialFailed) != 1 || s.DialFailed[0] != closed {
		t.Errorf("DialFailed %v, want [%v]", s.DialFailed, closed)
	}
}

func TestRelayTCPNoEndpointReached(t *testing.T) {
	checkNoLeaks(t)
	closed := forwardtest.ClosedTCPPort(t, forwardtest.Loopback("4"))
	ch := &forwardtest.Chooser{}
	ch.Set(closed)
	addr, p := startRelayTCP(t, ch, func(p *Proxy) { p.DialTimeouts = []time.Duration{time.Second, time.Second} })
	if err := dialAndRead(addr); !isConnReset(err) {
		t.Errorf("connection: %v, want a reset", err)
	}
	if got := fmt.Sprint(ch.Resets()); got != "[false true]" {
		t.Errorf("Choose resets %s, want one attempt per dial timeout: [false true]", got)
	}
	m := p.Metrics.(*forwardtest.Metrics)
	forwardtest.Eventually(t, "the connection failed", func() bool { return m.Snapshot().Failed == 1 })
}

func TestRelayTCPHalfClose(t *testing.T) {
	checkNoLeaks(t)
	echo := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	ch := &forwardtest.Chooser{}
	ch.Set(echo)
	addr, _ := startRelayTCP(t, ch, nil)
	c := forwardtest.DialTCP(t, addr)
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
	srv := forwardtest.StartTCPServer(t, forwardtest.Loopback("4"), func(c *net.TCPConn) {
		line, _ := bufio.NewReader(c).ReadString('\n')
		lines <- line
	})
	ch := &forwardtest.Chooser{ProxyProtocol: proxyproto.V1}
	ch.Set(srv)
	addr, _ := startRelayTCP(t, ch, nil)
	c := forwardtest.DialTCP(t, addr)
	client := forwardtest.TCPAddrPort(c.LocalAddr())
	want := fmt.Sprintf("PROXY TCP4 %s %s %d %d\r\n", client.Addr(), addr.Addr(), client.Port(), addr.Port())
	if got := <-lines; got != want {
		t.Errorf("header %q, want %q", got, want)
	}
}

func TestRelayTCPMaxConns(t *testing.T) {
	checkNoLeaks(t)
	echo := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	ch := &forwardtest.Chooser{}
	ch.Set(echo)
	addr, p := startRelayTCP(t, ch, func(p *Proxy) { p.MaxConns = 1 })
	first := forwardtest.DialTCP(t, addr)
	if _, err := forwardtest.RoundTrip(first, []byte("1")); err != nil {
		t.Fatal(err)
	}
	if err := dialAndRead(addr); !isConnReset(err) {
		t.Errorf("second connection: %v, want a reset", err)
	}
	if s := p.Metrics.(*forwardtest.Metrics).Snapshot(); s.Refused != 1 || s.Accepted != 1 {
		t.Errorf("metrics %+v: want 1 accepted, 1 refused", s)
	}
	first.Close()
	m := p.Metrics.(*forwardtest.Metrics)
	forwardtest.Eventually(t, "the first connection ended", func() bool { return m.Snapshot().Closed == 1 })
	third := forwardtest.DialTCP(t, addr)
	if _, err := forwardtest.RoundTrip(third, []byte("3")); err != nil {
		t.Errorf("a connection after the first ended: %v", err)
	}
}

func TestRelayTCPIdleTimeout(t *testing.T) {
	checkNoLeaks(t)
	echo := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	ch := &forwardtest.Chooser{}
	ch.Set(echo)
	addr, _ := startRelayTCP(t, ch, func(p *Proxy) { p.IdleTimeout = 50 * time.Millisecond })
	c := forwardtest.DialTCP(t, addr)
	if _, err := forwardtest.RoundTrip(c, []byte("x")); err != nil {
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
	_ = c.SetDeadline(time.Now().Add(forwardtest.WaitTimeout))
	_, err = c.Read(make([]byte, 1))
	return err
}

// isConnReset reports whether err is a connection reset (not a FIN's EOF).
func isConnReset(err error) bool {
	return err != nil && strings.Contains(err.Error(), "reset")
}
