//go:build linux

package tcp

import (
	"context"
	"testing"

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
