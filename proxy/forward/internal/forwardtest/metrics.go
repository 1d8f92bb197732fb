package forwardtest

import (
	"net/netip"
	"sync"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
)

// MetricsSnapshot holds the counts of a Metrics.
type MetricsSnapshot struct {
	Accepted, Closed, Failed                int
	DialFailed                              []netip.AddrPort
	ToEndpoint, FromEndpoint                int64
	SessionsOpened, SessionsClosed, Dropped int
	Refused, Evicted                        int
}

// Metrics is a forward.Metrics that counts the events it receives (Snapshot).
type Metrics struct {
	mu sync.Mutex
	s  MetricsSnapshot
}

var _ forward.Metrics = (*Metrics)(nil)

func (m *Metrics) update(f func(*MetricsSnapshot)) {
	m.mu.Lock()
	defer m.mu.Unlock()
	f(&m.s)
}

func (m *Metrics) ConnAccepted() { m.update(func(s *MetricsSnapshot) { s.Accepted++ }) }

func (m *Metrics) ConnClosed() { m.update(func(s *MetricsSnapshot) { s.Closed++ }) }

func (m *Metrics) ConnFailed() { m.update(func(s *MetricsSnapshot) { s.Failed++ }) }

func (m *Metrics) UDPSessionOpened() { m.update(func(s *MetricsSnapshot) { s.SessionsOpened++ }) }

func (m *Metrics) UDPSessionClosed() { m.update(func(s *MetricsSnapshot) { s.SessionsClosed++ }) }

func (m *Metrics) DatagramDropped() { m.update(func(s *MetricsSnapshot) { s.Dropped++ }) }

func (m *Metrics) ConnRefused() { m.update(func(s *MetricsSnapshot) { s.Refused++ }) }

func (m *Metrics) UDPSessionEvicted() {
	m.update(func(s *MetricsSnapshot) { s.Evicted++ })
}

func (m *Metrics) DialFailed(ep netip.AddrPort) {
	m.update(func(s *MetricsSnapshot) { s.DialFailed = append(s.DialFailed, ep) })
}

func (m *Metrics) BytesCopied(to, from int64) {
	m.update(func(s *MetricsSnapshot) { s.ToEndpoint += to; s.FromEndpoint += from })
}

// Snapshot returns a copy of the counts.
func (m *Metrics) Snapshot() MetricsSnapshot {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.s
	s.DialFailed = append([]netip.AddrPort(nil), m.s.DialFailed...)
	return s
}
