//go:build linux

package tcp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// A Freeze that comes at once after a Thaw (a successor arriving right after a failed
// hand-over) or after an Adopt (a proxy taken over right after it took over) must find every
// connection that the Thaw or Adopt gave back to the loops: each is exported, none relays on
// the frozen proxy any more, and Release returns.

// refreezeConns is how many connections the refreeze tests hand around, on both loops of the
// proxy; refreezeRounds is how many times a test meets the window (the loops may run what the
// Thaw or Adopt gave them before the freeze looks, or not).
const (
	refreezeConns  = 16
	refreezeRounds = 8
)

// establish dials n clients through r and makes a round trip on each: every connection is
// established and relaying on r's loops when it returns.
func establish(t *testing.T, r *proxyRun, n int) []*net.TCPConn {
	t.Helper()
	cs := make([]*net.TCPConn, n)
	for i := range cs {
		cs[i] = forwardtest.DialTCP(t, r.addr)
		msg := fmt.Sprintf("hello %d", i)
		if got, err := forwardtest.RoundTrip(cs[i], []byte(msg)); err != nil || string(got) != msg {
			t.Fatalf("client %d before the freezes: %q, %v", i, got, err)
		}
	}
	return cs
}

// loopsSettled returns once every loop of p has run what was posted to it before the call.
func loopsSettled(t *testing.T, p *Proxy) {
	t.Helper()
	for _, l := range p.loopState().set {
		done := make(chan struct{})
		if !l.post(func() { close(done) }) {
			t.Fatal("the event loops are closed")
		}
		<-done
	}
}

// relayingOn counts p's connections on its loops (frozen ones are off them).
func relayingOn(p *Proxy) int {
	n := 0
	p.eachLoopConn(func(*loop, *lconn) { n++ })
	return n
}

// checkRefrozen checks a freeze's state and its proxy's loops: all n connections exported,
// none left on the loops, after everything posted to the loops before has run. It reports
// whether they were.
func checkRefrozen(t *testing.T, what string, r *proxyRun, st forward.TCPState, n int, dialled bool) bool {
	t.Helper()
	ok := len(st.Conns) == n
	if !ok {
		t.Errorf("%s: exported %d of %d connections", what, len(st.Conns), n)
	}
	for i, cs := range st.Conns {
		if (cs.Backend != nil) != dialled {
			t.Errorf("%s: connection %d exported with an endpoint socket: %v, want %v", what, i, cs.Backend != nil, dialled)
		}
	}
	loopsSettled(t, r.Proxy)
	if k := relayingOn(r.Proxy); k != 0 {
		t.Errorf("%s: %d connections still relay on the frozen proxy's loops", what, k)
		ok = false
	}
	return ok
}

// releaseOrUnblock releases r, a frozen proxy. Release waits for every connection of r to stop:
// when some still relay on it, it does not return, and the test fails and closes the clients,
// which ends them (and the Release) so that the test can end.
func releaseOrUnblock(t *testing.T, r *proxyRun, clients []*net.TCPConn) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		r.Release()
		close(done)
	}()
	select {
	case <-done:
		return
	case <-time.After(forwardtest.WaitTimeout):
	}
	t.Errorf("Release of the frozen proxy has not returned after %v: connections still relay on it", forwardtest.WaitTimeout)
	for _, c := range clients {
		c.Close()
	}
	<-done
}

// freezeServing freezes r, whose Serve was called just before (it may start after the freeze,
// and then fails with ErrFrozen), and collects Serve's end for the test's cleanup.
func freezeServing(t *testing.T, r *proxyRun, ctx context.Context) forward.TCPState {
	t.Helper()
	st, err := r.Freeze(ctx)
	if err != nil {
		t.Fatalf("Freeze: %v", err)
	}
	if err := <-r.served; err != nil && !errors.Is(err, forward.ErrFrozen) {
		t.Errorf("Serve of the frozen proxy: %v", err)
	}
	r.served <- nil // for the cleanup
	return st
}

// adoptFrozen has a new proxy adopt st (through a Unix socket, as another process would)
// and serve its listener.
func adoptFrozen(t *testing.T, st forward.TCPState, chooser forward.Chooser, m *forwardtest.Metrics) *proxyRun {
	t.Helper()
	st = passTCPState(t, st)
	ln, err := ListenerFromFile(st.Listener)
	if err != nil {
		t.Fatalf("ListenerFromFile: %v", err)
	}
	return serveAdopted(t, ln, chooser, func(p *Proxy) { p.Metrics = m }, st.Conns)
}

// checkServedBy makes a round trip on every client, after a hand-over to a proxy counting into
// m, which must count every connection adopted and none ended.
func checkServedBy(t *testing.T, m *forwardtest.Metrics, clients []*net.TCPConn) {
	t.Helper()
	for i, c := range clients {
		msg := fmt.Sprintf("after %d", i)
		if got, err := forwardtest.RoundTrip(c, []byte(msg)); err != nil || string(got) != msg {
			t.Errorf("client %d after the hand-over: %q, %v", i, got, err)
		}
	}
	if s := m.Snapshot(); s.Accepted != len(clients) || s.Closed != 0 || s.Failed != 0 {
		t.Errorf("the adopter's metrics %+v: want all %d connections adopted, none ended", s, len(clients))
	}
}

// TestTCPFreezeRightAfterThaw: Freeze, Thaw (the hand-over failed) and at once Freeze again
// (the next successor), a few rounds, with established connections: each freeze exports every
// one, and the adopter serves them once the frozen proxy is released.
func TestTCPFreezeRightAfterThaw(t *testing.T) {
	forwardtest.CheckNoFDLeaks(t)
	checkNoLeaks(t)
	echo := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{echo}}
	ma := &forwardtest.Metrics{}
	a := startTCPProxy(t, "4", chooser, func(p *Proxy) { p.Metrics = ma })
	clients := establish(t, a, refreezeConns)
	st := refreezeAfterThaws(t, a, context.Background(), true)

	mb := &forwardtest.Metrics{}
	adoptFrozen(t, st, chooser, mb)
	releaseOrUnblock(t, a, clients)
	checkServedBy(t, mb, clients)
	if s := ma.Snapshot(); s.Closed != 0 || s.Failed != 0 {
		t.Errorf("the first proxy's metrics %+v: it must end no connection", s)
	}
}

// refreezeAfterThaws freezes a, then thaws it and freezes it again at once refreezeRounds
// times, checking each freeze; it returns the last freeze's state. Every connection is dialled,
// or (the freezes give their dials up) every one is undialled.
func refreezeAfterThaws(t *testing.T, a *proxyRun, ctx context.Context, dialled bool) forward.TCPState {
	t.Helper()
	st, err := a.Freeze(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-a.served; err != nil {
		t.Errorf("Serve of the frozen proxy: %v", err)
	}
	a.served <- nil
	if !checkRefrozen(t, "first freeze", a, st, refreezeConns, dialled) {
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
		st = freezeServing(t, a, ctx)
		if !checkRefrozen(t, fmt.Sprintf("freeze %d right after a thaw", round), a, st, refreezeConns, dialled) {
			missed++
		}
	}
	if missed > 0 {
		t.Errorf("%d of %d freezes right after a thaw missed connections", missed, refreezeRounds)
	}
	return st
}

// TestTCPFreezeRightAfterAdopt: established connections handed from proxy to proxy, each
// frozen at once after it adopted them (the next successor), a few hops: each freeze exports
// every one, and the last adopter serves them once its predecessor is released.
func TestTCPFreezeRightAfterAdopt(t *testing.T) {
	forwardtest.CheckNoFDLeaks(t)
	checkNoLeaks(t)
	echo := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{echo}}
	prev := startTCPProxy(t, "4", chooser, nil)
	clients := establish(t, prev, refreezeConns)
	st := freezeServing(t, prev, context.Background())
	if !checkRefrozen(t, "first freeze", prev, st, refreezeConns, true) {
		t.FailNow()
	}
	for hop := 1; hop <= refreezeRounds; hop++ {
		next := adoptFrozen(t, st, chooser, &forwardtest.Metrics{})
		st = freezeServing(t, next, context.Background())
		releaseOrUnblock(t, prev, clients)
		if !checkRefrozen(t, fmt.Sprintf("freeze right after adoption %d", hop), next, st, refreezeConns, true) {
			_ = st.Close()
			releaseOrUnblock(t, next, clients)
			return
		}
		prev = next
	}
	m := &forwardtest.Metrics{}
	adoptFrozen(t, st, chooser, m)
	releaseOrUnblock(t, prev, clients)
	checkServedBy(t, m, clients)
}

// TestTCPFreezeRightAfterThawDialling: connections frozen while dialling (the freezes give
// their dials up), thawed and frozen again at once, a few rounds: their new dials are given up
// too and every one is exported undialled; the adopter dials them and the clients' bytes get
// through.
func TestTCPFreezeRightAfterThawDialling(t *testing.T) {
	forwardtest.CheckNoFDLeaks(t)
	checkNoLeaks(t)
	hole := blackholeEndpoint(t)
	a := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{hole}}, func(p *Proxy) {
		p.DialTimeouts = []time.Duration{forwardtest.WaitTimeout}
	})
	clients := make([]*net.TCPConn, refreezeConns)
	for i := range clients {
		clients[i] = forwardtest.DialTCP(t, a.addr)
		if _, err := fmt.Fprintf(clients[i], "ping %2d", i); err != nil {
			t.Fatal(err)
		}
	}
	forwardtest.Eventually(t, "every connection to dial", func() bool {
		n := 0
		for _, l := range a.loopState().set {
			l.withTurn(func() { n += l.dialing })
		}
		return n == refreezeConns
	})
	giveUp, cancel := context.WithCancel(context.Background())
	cancel()
	st := refreezeAfterThaws(t, a, giveUp, false)

	echo := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	mb := &forwardtest.Metrics{}
	adoptFrozen(t, st, &forwardtest.Chooser{Endpoints: []netip.AddrPort{echo}}, mb)
	releaseOrUnblock(t, a, clients)
	for i, c := range clients {
		want := fmt.Sprintf("ping %2d", i)
		got := make([]byte, len(want))
		_ = c.SetReadDeadline(time.Now().Add(forwardtest.WaitTimeout))
		if _, err := io.ReadFull(c, got); err != nil || string(got) != want {
			t.Errorf("client %d after the hand-over: %q, %v; want the echo of %q", i, got, err, want)
		}
	}
	if s := mb.Snapshot(); s.Accepted != refreezeConns {
		t.Errorf("the adopter's metrics %+v: want all %d connections adopted", s, refreezeConns)
	}
}

// TestTCPShutdownRightAfterAdopt: a proxy shut down at once after it adopted connections, its
// context already ended, cuts every one of them and returns; a few rounds.
func TestTCPShutdownRightAfterAdopt(t *testing.T) {
	forwardtest.CheckNoFDLeaks(t)
	checkNoLeaks(t)
	echo := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{echo}}
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	missed := 0
	for round := 1; round <= refreezeRounds; round++ {
		a := startTCPProxy(t, "4", chooser, nil)
		clients := establish(t, a, refreezeConns)
		st := freezeServing(t, a, context.Background())
		if !checkRefrozen(t, "the freeze", a, st, refreezeConns, true) {
			t.FailNow()
		}
		m := &forwardtest.Metrics{}
		b := adoptFrozen(t, st, chooser, m)
		a.Release()
		done := make(chan struct{})
		go func() {
			_ = b.Shutdown(ended)
			close(done)
		}()
		select {
		case <-done:
		case <-time.After(forwardtest.WaitTimeout):
			t.Errorf("round %d: Shutdown has not returned after %v: connections still relay on the proxy", round, forwardtest.WaitTimeout)
			missed++
			for _, c := range clients {
				c.Close()
			}
			<-done
			continue
		}
		if s := m.Snapshot(); s.Accepted != refreezeConns || s.Closed+s.Failed != refreezeConns {
			t.Errorf("round %d: metrics %+v: want all %d connections adopted and cut", round, s, refreezeConns)
		}
		for i, c := range clients {
			if got, err := forwardtest.RoundTrip(c, []byte("x")); err == nil {
				t.Errorf("round %d: client %d: %q through a proxy shut down, want its connection cut", round, i, got)
			}
		}
	}
	if missed > 0 {
		t.Errorf("%d of %d shutdowns right after an adoption missed connections", missed, refreezeRounds)
	}
}
