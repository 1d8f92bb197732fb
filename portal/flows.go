package portal

import (
	"net/netip"
	"slices"
	"strconv"
)

// FlowDeleter deletes connection-tracking entries (*conntrack.Tool).
type FlowDeleter interface {
	// DeleteUDP deletes the UDP flows whose original destination is dst:port (any address of
	// dst's family when dst is unspecified) and returns how many it deleted.
	DeleteUDP(dst netip.Addr, port int) (int, error)
}

// udpTarget is one UDP address and port clients send to: a ClusterIP, externalIP or LB IP with
// the service port, or the unspecified address with a NodePort.
type udpTarget struct {
	addr netip.Addr
	port int
}

// udpTargets maps every UDP target of the valid portals in family to what new flows to it meet
// (action and proxy port): when that changes, flows tracked before lead somewhere stale.
func udpTargets(cfg Config, portals []Portal) map[udpTarget]string {
	out := map[udpTarget]string{}
	for i := range portals {
		p := &portals[i]
		if p.Protocol != "udp" || p.Validate() != nil {
			continue
		}
		what := func(a Action) string { return strconv.Itoa(int(a)) + ":" + strconv.Itoa(p.ProxyPort) }
		if ip := p.ClusterIP.Unmap(); inFamily(cfg.Family, ip) {
			out[udpTarget{ip, p.Port}] = what(p.Internal)
		}
		for _, ip := range slices.Concat(p.ExternalIPs, p.LoadBalancerIPs) {
			if ip = ip.Unmap(); inFamily(cfg.Family, ip) {
				out[udpTarget{ip, p.Port}] = what(p.External)
			}
		}
		if p.NodePort != 0 {
			unspec := netip.IPv4Unspecified()
			if !inFamily(cfg.Family, unspec) {
				unspec = netip.IPv6Unspecified()
			}
			out[udpTarget{unspec, p.NodePort}] = what(p.External)
		}
	}
	return out
}

// deleteStaleFlowsLocked deletes the tracked UDP flows of every target whose handling changed
// since the last call (all of them on the first), including targets that went away. Failures
// are logged: the flows then end on their own once their clients pause for conntrack's timeout.
func (m *Manager) deleteStaleFlowsLocked(portals []Portal) {
	if m.flows == nil {
		return
	}
	now := udpTargets(m.cfg, portals)
	var stale []udpTarget
	for t, v := range now {
		if was, ok := m.udpTargets[t]; !ok || was != v {
			stale = append(stale, t)
		}
	}
	for t := range m.udpTargets {
		if _, ok := now[t]; !ok {
			stale = append(stale, t)
		}
	}
	m.udpTargets = now
	total := 0
	for _, t := range stale {
		n, err := m.flows.DeleteUDP(t.addr, t.port)
		if err != nil {
			m.log.Warn().Err(err).Stringer("addr", t.addr).Int("port", t.port).Msg("cannot delete stale UDP flows")
			continue
		}
		total += n
	}
	if total > 0 {
		m.log.Info().Int("flows", total).Int("targets", len(stale)).Msg("deleted stale UDP flows")
	}
}
