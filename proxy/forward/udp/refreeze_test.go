//go:build linux

package udp

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// A Freeze that comes at once after a Thaw (a successor arriving right after a failed
// hand-over) or after an Adopt (a proxy taken over right after it took over) must find every
// session that the Thaw or Adopt started again: each is exported, and Freeze and Release
// return.

// refreezeSessions is how many sessions the refreeze tests hand around; refreezeRounds how
// many times a test meets the window (the sessions' goroutines may have started before the
// freeze looks, or not).
const (
	refreezeSessions = 16
	refreezeRounds   = 8
)

// openSessions opens n sessions through r, each answered once.
func openSessions(t *testing.T, r *udpRun, n int) []*net.UDPConn {
	t.Helper()
	cs := make([]*net.UDPConn, n)
	for i := range cs {
		cs[i] = forwardtest.DialUDP(t, r.addr)
		msg := fmt.Sprintf("hello %d", i)
		if got, err := forwardtest.UDPExchange(cs[i], []byte(msg), 3, time.Second); err != nil || string(got) != msg {
			t.Fatalf("client %d before the freezes: %q, %v", i, got, err)
		}
	}
	return cs
}

// within runs fn and fails the test if it has not returned after forwardtest.WaitTimeout.
func within(t *testing.T, what string, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		fn()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(forwardtest.WaitTimeout):
		t.Fatalf("%s has not returned after %v", what, forwardtest.WaitTimeout)
	}
}

// freezeUDP freezes r, whose Serve was called just before (it may start after the freeze, and
// then fails with ErrFrozen), and checks that it exported n sessions.
func freezeUDP(t *testing.T, what string, r *udpRun, n int) (st forward.UDPState, ok bool) {
	t.Helper()
	var err error
	within(t, what, func() { st, err = r.Freeze(context.Background()) })
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	if err := <-r.served; err != nil && !errors.Is(err, forward.ErrFrozen) {
		t.Errorf("Serve of the frozen proxy: %v", err)
	}
	r.served <- nil // for the cleanup
	if len(st.Sessions) != n {
		t.Errorf("%s: exported %d of %d sessions", what, len(st.Sessions), n)
		return st, false
	}
	return st, true
}

// adoptUDP has a new proxy, counting into m, adopt st (through a Unix socket, as another
// process would) and serve its socket.
func adoptUDP(t *testing.T, st forward.UDPState, chooser forward.Chooser, m *forwardtest.Metrics) *udpRun {
	t.Helper()
	st = passUDPState(t, st)
	conn, err := ConnFromFile(st.Conn)
	if err != nil {
		t.Fatal(err)
	}
	b := &Proxy{Conn: conn, Chooser: chooser, Metrics: m, Log: new(forwardtest.Logger(t))}
	if err := b.Adopt(st.Sessions); err != nil {
		t.Errorf("Adopt: %v", err)
	}
	r := &udpRun{Proxy: b, addr: conn.LocalAddr().(*net.UDPAddr).AddrPort(), served: make(chan error, 1)}
	go func() { r.served <- b.Serve() }()
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if err := <-r.served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return r
}

// checkUDPServedBy exchanges a datagram on every client, whose sessions were handed over to
// a proxy counting into m: each is answered by its own endpoint, through an adopted session.
func checkUDPServedBy(t *testing.T, m *forwardtest.Metrics, clients []*net.UDPConn) {
	t.Helper()
	for i, c := range clients {
		msg := fmt.Sprintf("after %d", i)
		if got, err := forwardtest.UDPExchange(c, []byte(msg), 3, time.Second); err != nil || string(got) != msg {
			t.Errorf("client %d after the hand-over: %q, %v", i, got, err)
		}
	}
	if s := m.Snapshot(); s.SessionsOpened != len(clients) || s.SessionsClosed != 0 {
		t.Errorf("the adopter's metrics %+v: want the %d sessions adopted and no other", s, len(clients))
	}
}

// TestUDPFreezeRightAfterThaw: Freeze, Thaw (the hand-over failed) and at once Freeze again
// (the next successor), a few rounds: each freeze exports every session, and the adopter serves
// them once the frozen proxy is released.
func TestUDPFreezeRightAfterThaw(t *testing.T) {
	forwardtest.CheckNoFDLeaks(t)
	checkNoLeaks(t)
	echo := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "")
	chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{echo}}
	a := startUDPProxy(t, "4", chooser, nil)
	clients := openSessions(t, a, refreezeSessions)
	st, ok := freezeUDP(t, "first freeze", a, refreezeSessions)
	if !ok {
		t.FailNow()
	}
	missed := 0
	for round := 1; round <= refreezeRounds; round++ {
		_ = st.Close() // the failed hand-over's duplicates
		<-a.served
		if err := a.Thaw(); err != nil {
			t.Fatal(err)
		}
		go func() { a.served <- a.Serve() }()
		if st, ok = freezeUDP(t, fmt.Sprintf("freeze %d right after a thaw", round), a, refreezeSessions); !ok {
			missed++
		}
	}
	if missed > 0 {
		t.Errorf("%d of %d freezes right after a thaw missed sessions", missed, refreezeRounds)
	}
	m := &forwardtest.Metrics{}
	adoptUDP(t, st, chooser, m)
	within(t, "Release", a.Release)
	checkUDPServedBy(t, m, clients)
}

// TestUDPFreezeRightAfterAdopt: sessions handed from proxy to proxy, each frozen at once after
// it adopted them (the next successor), a few hops: each freeze exports every session, and the
// last adopter serves them once its predecessor is released.
func TestUDPFreezeRightAfterAdopt(t *testing.T) {
	forwardtest.CheckNoFDLeaks(t)
	checkNoLeaks(t)
	echo := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "")
	chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{echo}}
	prev := startUDPProxy(t, "4", chooser, nil)
	clients := openSessions(t, prev, refreezeSessions)
	st, ok := freezeUDP(t, "first freeze", prev, refreezeSessions)
	if !ok {
		t.FailNow()
	}
	for hop := 1; hop <= refreezeRounds; hop++ {
		next := adoptUDP(t, st, chooser, &forwardtest.Metrics{})
		st, ok = freezeUDP(t, fmt.Sprintf("freeze right after adoption %d", hop), next, refreezeSessions)
		within(t, "Release", prev.Release)
		if !ok {
			_ = st.Close()
			return
		}
		prev = next
	}
	m := &forwardtest.Metrics{}
	adoptUDP(t, st, chooser, m)
	within(t, "Release", prev.Release)
	checkUDPServedBy(t, m, clients)
}
