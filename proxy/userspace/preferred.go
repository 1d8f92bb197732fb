package userspace

import (
	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/portalloc"
)

// PreferredPorts names the proxy port each service port should have: after a crash, the ports
// the surviving rules of the earlier run send traffic to (portal.ProxyPorts), so that the
// traffic is served the moment a listener opens, before the first sync rewrites the rules.
type PreferredPorts interface {
	// Port returns the proxy port a service port prefers; 0 for none.
	Port(name proxy.Name, protocol v1.Protocol) int
	// Ports returns every port that Port may return.
	Ports() []int
}

// setAsidePreferred keeps the preferred ports out of the allocator's random picks (nil prefs:
// none), so that a service port without a preferred port does not take another's.
func setAsidePreferred(alloc *portalloc.Allocator, prefs PreferredPorts) {
	if prefs != nil {
		alloc.SetAside(prefs.Ports())
	}
}

// openPreferred opens the listener on the port's preferred port when it has one and the
// allocator lets it have it (it is in the range and free), and reports whether it did. A port
// it cannot bind (another program has it) goes back to the allocator, and open allocates one.
func (l *listener) openPreferred(cfg *listenConfig, sp *proxy.ServicePort, metrics forward.Metrics) bool {
	if cfg.preferred == nil {
		return false
	}
	port := cfg.preferred.Port(sp.Name, sp.Protocol)
	if port <= 0 {
		return false
	}
	if !cfg.alloc.Reserve(port) {
		l.logInfo().Int("preferredPort", port).Str("proxyPortRange", cfg.alloc.Range().String()).
			Msg("the proxy port of the earlier run is taken or out of the range; allocating another")
		return false
	}
	if err := l.listen(sp.Protocol, cfg, port, metrics); err != nil {
		cfg.alloc.Release(port)
		l.logInfo().Err(err).Int("preferredPort", port).Msg("cannot listen on the proxy port of the earlier run; allocating another")
		return false
	}
	return true
}
