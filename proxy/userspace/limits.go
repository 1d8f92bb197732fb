package userspace

import (
	"net/netip"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/tcp"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/udp"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/portalloc"
)

// Limits bounds what the data path of all service ports may hold, so that no flood against one
// service, and no flood at all, takes the node's other services or the proxy's own control work
// down. The zero value sets no bound.
type Limits struct {
	// FileLimit is the process's open-files limit (RLIMIT_NOFILE). Zero means no descriptor
	// budget: the data path takes descriptors until the kernel refuses them.
	FileLimit int
	// Reserve is how many descriptors below FileLimit the data path leaves to the control work:
	// reading manifests, iptables-restore and conntrack, the API watch, the health and metrics
	// servers. Zero means DefaultReserve(FileLimit).
	Reserve int
	// MaxConnsPerPort bounds the TCP connections of one service port open at once, and
	// MaxSessionsPerPort its UDP sessions; beyond them new connections are reset and the
	// longest-idle session is ended. Zero means half the data path's budget, so that a flood
	// against one service leaves the other half to the others; negative means no bound.
	MaxConnsPerPort, MaxSessionsPerPort int
	// MaxAffinityEntries bounds the ClientIP affinity entries of one service port (the least
	// recently used client is forgotten beyond it); zero means loadbalancer's default.
	MaxAffinityEntries int
	// TCPIdleTimeout ends connections that moved no byte either way for that long; zero means
	// never (kube-proxy's iptables mode lets conntrack's established timeout, 24 h by default,
	// do the same).
	TCPIdleTimeout time.Duration
}

// DefaultReserve is the reserve for a file limit: a quarter of it, at most 256.
func DefaultReserve(fileLimit int) int { return min(256, fileLimit/4) }

// ReserveFDs returns Reserve or its default.
func (l Limits) ReserveFDs() int {
	if l.Reserve > 0 {
		return l.Reserve
	}
	return DefaultReserve(l.FileLimit)
}

// ConnsPerPort and SessionsPerPort return the per-port bounds in force (0: none).
func (l Limits) ConnsPerPort() int    { return l.perPort(l.MaxConnsPerPort, 2) }
func (l Limits) SessionsPerPort() int { return l.perPort(l.MaxSessionsPerPort, 1) }

// dataPathFDs is what the data path may hold before the listeners take their share.
func (l Limits) dataPathFDs() int { return max(l.FileLimit-l.ReserveFDs(), 0) }

// listenerFDs is what the listeners and held ports may hold together: the data path's share
// less a floor kept for connections (a quarter of it, at most 4,096), so that a node with more
// service ports than descriptors still serves the ports it has listeners for. With a 20,000
// limit: 256 reserved, 4,096 for connections, 15,648 TCP service ports.
func (l Limits) listenerFDs() int {
	d := l.dataPathFDs()
	return d - min(d/4, 4096)
}

// perPort resolves a per-port bound: v when set, none when negative, else half the data path's
// budget in units of fds descriptors (none without a budget).
func (l Limits) perPort(v, fds int) int {
	switch {
	case v > 0:
		return v
	case v < 0 || l.FileLimit <= 0:
		return 0
	}
	return max(l.dataPathFDs()/2/fds, 1)
}

// listenConfig is what every listener is opened with.
type listenConfig struct {
	alloc       *portalloc.Allocator
	bind        netip.Addr
	udpTimeout  time.Duration
	metrics     TrafficMetrics // nil: none
	budget      *forward.Budget
	maxConns    int
	maxSessions int
	idleTimeout time.Duration
	preferred   PreferredPorts // nil: none
	// poller resumes the read loops of idle UDP listeners (udp.Proxy.Start); nil: each
	// keeps a goroutine. The proxier creates it with its first listener and closes it with the
	// last (closeListeners).
	poller *udp.Poller
	// loops relay TCP (tcp.Proxy.Loops); the proxier closes them at the end of Shutdown.
	// Nil if they could not be created.
	loops *tcp.Loops
	// testHookServe, when set, is called as a listener starts serving (tests).
	testHookServe func(*listener)
}
