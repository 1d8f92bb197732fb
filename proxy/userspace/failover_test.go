package userspace

import (
	"fmt"
	"net/netip"
	"sync"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
)

// dialFailures counts the failed dials to each endpoint of every port (TrafficMetrics).
type dialFailures struct {
	mu sync.Mutex
	n  map[netip.AddrPort]int
}

func (d *dialFailures) ForPort(proxy.Name, v1.Protocol) forward.Metrics { return dialSink{d} }
func (d *dialFailures) Forget(proxy.Name, v1.Protocol)                  {}
func (d *dialFailures) KeepEndpoints(proxy.Name, v1.Protocol, func(netip.AddrPort) bool) {
}
func (d *dialFailures) AffinityEvicted(proxy.Name, v1.Protocol) {}

func (d *dialFailures) count(ep netip.AddrPort) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.n[ep]
}

type dialSink struct{ d *dialFailures }

func (s dialSink) DialFailed(ep netip.AddrPort) {
	s.d.mu.Lock()
	defer s.d.mu.Unlock()
	s.d.n[ep]++
}
func (dialSink) ConnAccepted()              {}
func (dialSink) ConnClosed()                {}
func (dialSink) ConnFailed()                {}
func (dialSink) ConnRefused()               {}
func (dialSink) BytesCopied(to, from int64) {}
func (dialSink) UDPSessionOpened()          {}
func (dialSink) UDPSessionClosed()          {}
func (dialSink) DatagramDropped()           {}
func (dialSink) UDPSessionEvicted()         {}

// TestNineOfTenEndpointsDie: nine of a service's ten endpoints stop at once (their ports
// refuse) while the EndpointSlices still list them, as when pods stop before their endpoints'
// removal reaches the proxy. Every connection is answered by the tenth; and once an endpoint has
// refused, the others' connections pass over it: each dead endpoint is dialled about once, not
// once per connection that comes to it in the rotation.
func TestNineOfTenEndpointsDie(t *testing.T) {
	failures := &dialFailures{n: map[netip.AddrPort]int{}}
	p := newTestProxier(t, Options{Metrics: failures})
	tr := p.Tracker()
	tr.OnServiceUpdate(nil, service("echo", []v1.ServicePort{tcpPort("tcp", 80)}))
	var backends []*backend
	for i := range 10 {
		b := startBackend(t, fmt.Sprintf("b%d", i))
		backends = append(backends, b)
		tr.OnEndpointSliceUpdate(nil, slice("echo", fmt.Sprintf("echo-%d", i), "tcp", v1.ProtocolTCP, b))
	}
	p.Sync()
	port := proxyPort(t, p, echoTCP)
	seen := map[string]bool{}
	for range 20 {
		seen[mustAsk(t, "tcp", port)] = true
	}
	if len(seen) != 10 {
		t.Fatalf("answers from %d backends before, want 10", len(seen))
	}

	for _, b := range backends[:9] {
		b.stop()
	}
	const conns = 40
	for i := range conns {
		got, err := ask(t, "tcp", port, "ping")
		if err != nil {
			t.Fatalf("connection %d after nine endpoints died: %v", i, err)
		}
		if name := got[:len("b9")]; name != "b9" {
			t.Fatalf("connection %d answered by %q, want b9", i, got)
		}
	}
	total := 0
	for _, b := range backends[:9] {
		n := failures.count(b.addr)
		total += n
		if n == 0 {
			t.Errorf("%s (%v) was never dialled: the test did not exercise failover", b.name, b.addr)
		}
	}
	// Within the hold, a dead endpoint is dialled again only by connections that chose it before
	// its first refusal was reported (none here: the connections are sequential), and once its
	// hold has ended.
	t.Logf("%d connections, %d failed dials to the nine dead endpoints", conns, total)
	if total > 18 { // a retrial each, should the connections take longer than a hold
		t.Errorf("%d failed dials to nine dead endpoints over %d sequential connections: dead endpoints are not passed over", total, conns)
	}
}
