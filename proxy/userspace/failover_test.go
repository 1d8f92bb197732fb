package userspace

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

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
// removal reaches the proxy. Every connection, or UDP client, is answered by the tenth; and once
// an endpoint has refused, the others pass over it for a while: each dead endpoint is tried about
// once, not once per connection that comes to it in the rotation. A TCP dial is refused and the
// proxy dials the next endpoint; a UDP session's datagram draws ICMP port unreachable, which its
// connected socket reports, and is lost: the client's next datagram chooses again.
func TestNineOfTenEndpointsDie(t *testing.T) {
	for _, tc := range []struct {
		proto v1.Protocol
		port  v1.ServicePort
		name  proxy.Name
		// ask is one connection, or one UDP client: its answer, from the first endpoint that
		// answers.
		ask func(port int) (string, error)
	}{
		{v1.ProtocolTCP, tcpPort("tcp", 80), echoTCP, func(port int) (string, error) { return ask(t, "tcp", port, "ping") }},
		{v1.ProtocolUDP, udpPort("udp", 53), echoUDP, askUDPUntilAnswered},
	} {
		t.Run(string(tc.proto), func(t *testing.T) {
			failures := &dialFailures{n: map[netip.AddrPort]int{}}
			p := newTestProxier(t, Options{Metrics: failures})
			tr := p.Tracker()
			tr.OnServiceUpdate(nil, service("echo", []v1.ServicePort{tc.port}))
			var backends []*backend
			for i := range 10 {
				b := startBackend(t, fmt.Sprintf("b%d", i))
				backends = append(backends, b)
				tr.OnEndpointSliceUpdate(nil, slice("echo", fmt.Sprintf("echo-%d", i), tc.port.Name, tc.proto, b))
			}
			p.Sync()
			port := proxyPort(t, p, tc.name)
			seen := map[string]bool{}
			for range 20 {
				seen[mustAsk(t, strings.ToLower(string(tc.proto)), port)] = true
			}
			if len(seen) != 10 {
				t.Fatalf("answers from %d backends before, want 10", len(seen))
			}

			for _, b := range backends[:9] {
				b.stop()
			}
			const clients = 40
			start := time.Now()
			for i := range clients {
				got, err := tc.ask(port)
				if err != nil {
					t.Fatalf("client %d after nine endpoints died: %v", i, err)
				}
				if name := got[:len("b9")]; name != "b9" {
					t.Fatalf("client %d answered by %q, want b9", i, got)
				}
			}
			elapsed := time.Since(start)
			// After each failure an endpoint is passed over for at least a second; the clients
			// are sequential, so none picks an endpoint before its failure is reported: each
			// draws at most one failure per second that passed, and one more.
			bound := 1 + int(elapsed/time.Second)
			total := 0
			for _, b := range backends[:9] {
				n := failures.count(b.addr)
				total += n
				if n == 0 {
					t.Errorf("%s (%v) never failed: the test did not exercise the failover", b.name, b.addr)
				}
				if n > bound {
					t.Errorf("%s (%v) failed %d times within %v, want at most %d: an endpoint that failed is not passed over", b.name, b.addr, n, elapsed, bound)
				}
			}
			t.Logf("%d clients in %v, %d failures of the nine dead endpoints", clients, elapsed, total)
		})
	}
}

// askUDPUntilAnswered sends "ping" from a new socket to the proxy port, again after each 20 ms
// without an answer (a datagram to a dead endpoint is lost), and returns the first answer.
func askUDPUntilAnswered(port int) (string, error) {
	c, err := net.Dial("udp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		return "", err
	}
	defer c.Close()
	buf := make([]byte, 1500)
	for range 250 {
		if _, err := c.Write([]byte("ping\n")); err != nil {
			return "", err
		}
		_ = c.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
		n, err := c.Read(buf)
		if err == nil {
			return strings.TrimSpace(string(buf[:n])), nil
		}
		if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
			return "", err
		}
	}
	return "", errors.New("no answer to 250 datagrams")
}
