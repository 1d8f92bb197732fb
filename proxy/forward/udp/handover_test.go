//go:build linux

package udp

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// TestUDPHandOver freezes a UDP proxy with two sessions to two endpoints, has B adopt them
// through a Unix socket and releases A: each client's datagrams still reach its endpoint (B's
// Chooser would pick a third one), the replies still come from the proxy's address (the clients'
// sockets are connected to it and accept nothing else), a datagram sent during the freeze is
// served, a new client gets B's choice, and the sessions keep their idle clocks.
func TestUDPHandOver(t *testing.T) {
	forwardtest.CheckNoFDLeaks(t)
	checkNoLeaks(t)
	e1, e2, e3 := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "e1:"), forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "e2:"), forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "e3:")
	ma, mb := &forwardtest.Metrics{}, &forwardtest.Metrics{}
	a := startUDPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{e1, e2}}, func(p *Proxy) { p.Metrics = ma })
	c1, c2 := forwardtest.DialUDP(t, a.addr), forwardtest.DialUDP(t, a.addr)
	for _, x := range []struct {
		c    *net.UDPConn
		want string
	}{{c1, "e1:one"}, {c2, "e2:two"}} {
		if got, err := forwardtest.UDPExchange(x.c, []byte(x.want[3:]), 3, time.Second); err != nil || string(got) != x.want {
			t.Fatalf("before the freeze: %q, %v; want %q", got, err, x.want)
		}
	}

	st, err := a.Freeze(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := <-a.served; err != nil {
		t.Errorf("Serve of the frozen proxy: %v", err)
	}
	a.served <- nil
	if len(st.Sessions) != 2 {
		t.Fatalf("frozen state has %d sessions, want 2", len(st.Sessions))
	}
	for _, ss := range st.Sessions {
		if ss.ReplyFrom != forwardtest.Loopback("4") || ss.Refused || ss.Idle < 0 {
			t.Errorf("frozen session %+v: want replies from %v, not refused", ss, forwardtest.Loopback("4"))
		}
	}
	// Sent while nobody reads: it waits in the socket's buffer for B.
	if _, err := c1.Write([]byte("frozen")); err != nil {
		t.Fatal(err)
	}
	st = passUDPState(t, st)
	conn, err := ConnFromFile(st.Conn)
	if err != nil {
		t.Fatal(err)
	}
	b := &Proxy{Conn: conn, Chooser: &forwardtest.Chooser{Endpoints: []netip.AddrPort{e3}}, Metrics: mb, Log: new(forwardtest.Logger(t))}
	if err := b.Adopt(st.Sessions); err != nil {
		t.Fatalf("Adopt: %v", err)
	}
	served := make(chan error, 1)
	go func() { served <- b.Serve() }()
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	a.Release()

	buf := make([]byte, 100)
	c1.SetReadDeadline(time.Now().Add(forwardtest.WaitTimeout))
	if n, err := c1.Read(buf); err != nil || string(buf[:n]) != "e1:frozen" {
		t.Errorf("datagram sent during the freeze: %q, %v; want e1:frozen", buf[:n], err)
	}
	for _, x := range []struct {
		c    *net.UDPConn
		want string
	}{{c1, "e1:again"}, {c2, "e2:again"}, {forwardtest.DialUDP(t, a.addr), "e3:new"}} {
		if got, err := forwardtest.UDPExchange(x.c, []byte(x.want[3:]), 3, time.Second); err != nil || string(got) != x.want {
			t.Errorf("after the hand-over: %q, %v; want %q", got, err, x.want)
		}
	}
	if sa, sb := ma.Snapshot(), mb.Snapshot(); sa.SessionsOpened != 2 || sa.SessionsClosed != 0 || sb.SessionsOpened != 3 {
		t.Errorf("metrics A %+v, B %+v: want A 2 sessions opened, none closed; B 3 opened (2 adopted)", sa, sb)
	}
}

// TestUDPHandOverKeepsIdleClock: an adopted session is as idle as it was when frozen, and
// expires in the adopter after its Timeout.
func TestUDPHandOverKeepsIdleClock(t *testing.T) {
	forwardtest.CheckNoFDLeaks(t)
	checkNoLeaks(t)
	echo := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "")
	a := startUDPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{echo}}, nil)
	c := forwardtest.DialUDP(t, a.addr)
	if _, err := forwardtest.UDPExchange(c, []byte("x"), 3, time.Second); err != nil {
		t.Fatal(err)
	}
	st, err := a.Freeze(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Sessions) != 1 {
		t.Fatalf("%d sessions, want 1", len(st.Sessions))
	}
	frozenIdle := st.Sessions[0].Idle
	st = passUDPState(t, st)
	conn, err := ConnFromFile(st.Conn)
	if err != nil {
		t.Fatal(err)
	}
	b := &Proxy{Conn: conn, Chooser: &forwardtest.Chooser{}, Timeout: 300 * time.Millisecond, Log: new(forwardtest.Logger(t))}
	if err := b.Adopt(st.Sessions); err != nil {
		t.Fatal(err)
	}
	b.mu.Lock()
	for _, s := range b.sessions {
		if idle := time.Duration(b.now() - s.lastActive.Load()); idle < frozenIdle {
			t.Errorf("adopted session idle for %v, less than the %v it was idle when frozen", idle, frozenIdle)
		}
	}
	b.mu.Unlock()
	a.Release()
	forwardtest.Eventually(t, "the adopted session to expire", func() bool { return b.sessionCount() == 0 })
	if err := b.Close(); err != nil {
		t.Error(err)
	}
}

// TestUDPFreezeMisuse: Freeze and Adopt out of turn fail clearly and close what they were given.
func TestUDPFreezeMisuse(t *testing.T) {
	forwardtest.CheckNoFDLeaks(t)
	checkNoLeaks(t)
	ctx := context.Background()
	r := startUDPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "")}}, nil)
	if _, err := forwardtest.UDPExchange(forwardtest.DialUDP(t, r.addr), []byte("x"), 3, time.Second); err != nil {
		t.Fatal(err) // Serve runs
	}
	st, err := r.Freeze(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := r.Freeze(ctx); !errors.Is(err, forward.ErrFrozen) {
		t.Errorf("second Freeze: %v, want ErrFrozen", err)
	}
	f := forwardtest.SocketFile(t)
	if err := r.Adopt([]forward.UDPSessionState{{Backend: f}}); !errors.Is(err, forward.ErrFrozen) {
		t.Errorf("Adopt on a frozen proxy: %v, want ErrFrozen", err)
	}
	r.Release()
	if _, err := r.Freeze(ctx); !errors.Is(err, forward.ErrClosed) {
		t.Errorf("Freeze after Release: %v, want ErrClosed", err)
	}
	if _, err := ConnFromFile(nil); err == nil {
		t.Error("ConnFromFile(nil) succeeded")
	}
	if _, err := ConnFromFile(forwardtest.SocketFile(t)); err == nil {
		t.Error("ConnFromFile of a TCP socket succeeded")
	}
	if err := (&Proxy{}).Adopt(nil); err == nil {
		t.Error("Adopt without Conn succeeded")
	}
}
