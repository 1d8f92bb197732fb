//go:build linux

package forward

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// A hand-over that fails after the freeze thaws the proxy in place: it serves again on its own
// sockets, without a descriptor more. TCP: a stream with bytes in both splice pipes when frozen
// carries on with every byte once and in order; a datagram-less UDP session keeps its endpoint
// and a datagram sent while frozen is answered.
func TestTCPThawMidStream(t *testing.T) {
	ms := startMidStream(t)
	n, a, m := ms.n, ms.a, ms.metrics

	st, err := a.Freeze(context.Background())
	if err != nil {
		t.Fatalf("Freeze: %v", err)
	}
	if err := <-a.served; err != nil {
		t.Errorf("Serve of the frozen proxy: %v", err)
	}
	if len(st.Conns) != 1 || len(st.Conns[0].ToEndpoint) == 0 || len(st.Conns[0].ToClient) == 0 {
		t.Errorf("frozen state %+v: want one connection with bytes pending both ways", plainTCPState(st))
	}
	if err := st.Close(); err != nil { // the failed hand-over's duplicates
		t.Fatal(err)
	}
	if err := a.Thaw(); err != nil {
		t.Fatalf("Thaw: %v", err)
	}
	go func() { a.served <- a.Serve() }()
	ms.finish(t)
	// A new connection is served too.
	if _, err := forwardtest.RoundTrip(forwardtest.DialTCP(t, a.addr), []byte("ping")); err != nil {
		t.Errorf("a new connection after the thaw: %v", err)
	}
	forwardtest.Eventually(t, "the stream's connection to close", func() bool { return m.Snapshot().Closed >= 1 })
	if s := m.Snapshot(); s.ToEndpoint < n || s.FromEndpoint < n {
		t.Errorf("bytes counted: %d to and %d from the endpoint, want at least %d each", s.ToEndpoint, s.FromEndpoint, n)
	}
	if err := a.Thaw(); err == nil {
		t.Error("a second Thaw of a running proxy succeeded")
	}
}

func TestUDPThaw(t *testing.T) {
	checkNoFDLeaks(t)
	checkNoLeaks(t)
	e1, e2 := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "e1:"), forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "e2:")
	chooser := &fakeChooser{Endpoints: []netip.AddrPort{e1, e2}}
	a := startUDPProxy(t, "4", chooser, nil)
	c1 := forwardtest.DialUDP(t, a.addr)
	if got, err := forwardtest.UDPExchange(c1, []byte("one"), 3, time.Second); err != nil || string(got) != "e1:one" {
		t.Fatalf("before the freeze: %q, %v", got, err)
	}
	st, err := a.Freeze(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := <-a.served; err != nil {
		t.Errorf("Serve of the frozen proxy: %v", err)
	}
	if _, err := c1.Write([]byte("frozen")); err != nil {
		t.Fatal(err)
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Thaw(); err != nil {
		t.Fatalf("Thaw: %v", err)
	}
	go func() { a.served <- a.Serve() }()
	buf := make([]byte, 100)
	c1.SetReadDeadline(time.Now().Add(forwardtest.WaitTimeout))
	if n, err := c1.Read(buf); err != nil || string(buf[:n]) != "e1:frozen" {
		t.Errorf("datagram sent while frozen: %q, %v; want e1:frozen (the session's endpoint)", buf[:n], err)
	}
	if got, err := forwardtest.UDPExchange(c1, []byte("again"), 3, time.Second); err != nil || string(got) != "e1:again" {
		t.Errorf("after the thaw: %q, %v; want e1:again", got, err)
	}
	if got, err := forwardtest.UDPExchange(forwardtest.DialUDP(t, a.addr), []byte("new"), 3, time.Second); err != nil || string(got) != "e2:new" {
		t.Errorf("a new session after the thaw: %q, %v; want e2:new", got, err)
	}
}
