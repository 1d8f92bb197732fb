package portal

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// FlowDeleter deletes connection-tracking entries (*conntrack.Tool).
type FlowDeleter interface {
	// DeleteUDP deletes the UDP flows whose original destination is exactly one of dsts
	// (address and port), in as few runs as it can and within a bounded time.
	DeleteUDP(dsts []netip.AddrPort) error
}

// udpTargets maps every UDP address and port clients send to, in the valid portals of the
// family, to what new flows to it meet (action and proxy port, and for load-balancer IPs the
// source ranges): when that changes, flows tracked before lead somewhere stale. A NodePort's
// targets are the node addresses it is served on (nodeIPs, narrowed by --nodeport-addresses),
// so that a deletion never touches flows to other hosts or other services that happen to use
// the same port number.
func udpTargets(cfg Config, portals []Portal, nodeIPs []netip.Addr) map[netip.AddrPort]string {
	out := map[netip.AddrPort]string{}
	var npIPs []netip.Addr
	npIPsDone := false
	for i := range portals {
		p := &portals[i]
		if p.Protocol != "udp" || p.Validate() != nil {
			continue
		}
		what := func(a proxy.Action) string { return strconv.Itoa(int(a)) + ":" + strconv.Itoa(p.ProxyPort) }
		target := func(ip netip.Addr, port int) netip.AddrPort { return netip.AddrPortFrom(ip, uint16(port)) }
		if ip := p.ClusterIP.Unmap(); inFamily(cfg.Family, ip) {
			out[target(ip, p.Port)] = what(p.Internal)
		}
		for _, ip := range p.ExternalIPs {
			if ip = ip.Unmap(); inFamily(cfg.Family, ip) {
				out[target(ip, p.Port)] = what(p.External)
			}
		}
		// Who may send to a load-balancer IP is part of its handling: flows from a source that
		// a new range list leaves out must meet the rules again.
		lb := what(p.External) + fmt.Sprint(p.LoadBalancerSourceRanges)
		for _, ip := range p.LoadBalancerIPs {
			if ip = ip.Unmap(); inFamily(cfg.Family, ip) {
				out[target(ip, p.Port)] = lb
			}
		}
		if p.NodePort == 0 {
			continue
		}
		if !npIPsDone {
			npIPs = nodePortTargetIPs(cfg, nodeIPs)
			npIPsDone = true
		}
		for _, ip := range npIPs {
			out[target(ip, p.NodePort)] = what(p.External)
		}
	}
	return out
}

// nodePortTargetIPs returns the node addresses of the family whose NodePorts the rules capture:
// those --nodeport-addresses selects, or with none, every address of the family; loopback
// addresses as far as they serve NodePorts (see Config.NoLocalhostNodePorts).
func nodePortTargetIPs(cfg Config, nodeIPs []netip.Addr) []netip.Addr {
	ips, all := NodePortIPs(cfg.Family, cfg.NodePortAddresses, nodeIPs)
	if all {
		for _, a := range nodeIPs {
			if a = a.Unmap(); inFamily(cfg.Family, a) && !a.IsUnspecified() {
				ips = append(ips, a.WithZone(""))
			}
		}
		slices.SortFunc(ips, netip.Addr.Compare)
		ips = slices.Compact(ips)
	}
	if cfg.Family == iptables.IPv6 || cfg.NoLocalhostNodePorts {
		ips = slices.DeleteFunc(ips, netip.Addr.IsLoopback)
	}
	return ips
}

// deleteStaleFlowsLocked deletes the tracked UDP flows of every target whose handling changed
// since the last call (all of them on the first), including targets that went away and those a
// failed deletion left, with one call of the FlowDeleter. It runs on the calling goroutine,
// whose thread's network namespace the rules were written in; the FlowDeleter bounds its time.
// A failure is logged and its targets are kept as stale (flowDeleteFailed): retryFlowsLocked
// tries them again at a later sync, after a backoff (FlowRetryDue says when). A client that
// keeps sending keeps its flow alive: without the retry it would never meet the rules again.
func (m *Manager) deleteStaleFlowsLocked(portals []Portal, nodeIPs []netip.Addr) {
	if m.flows == nil {
		return
	}
	now := udpTargets(m.cfg, portals, nodeIPs)
	var stale []netip.AddrPort
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
	if len(stale) == 0 {
		return
	}
	slices.SortFunc(stale, netip.AddrPort.Compare)
	start := time.Now()
	if err := m.flows.DeleteUDP(stale); err != nil {
		for _, t := range stale {
			m.udpTargets[t] = flowDeleteFailed // a target that went away stays until deleted
		}
		m.flowFailures++
		wait := min(flowRetryBase<<min(m.flowFailures-1, 16), flowRetryMax)
		m.flowRetryAt = time.Now().Add(wait)
		m.log.Warn().Err(err).Int("targets", len(stale)).Dur("retryIn", wait).Msg("cannot delete stale UDP flows")
		return
	}
	m.flowFailures, m.flowRetryAt = 0, time.Time{}
	m.log.Debug().Int("targets", len(stale)).Dur("took", time.Since(start)).Msg("deleted stale UDP flows")
}

// flowDeleteFailed is what udpTargets holds for a target whose stale flows a deletion failed to
// delete: no handling is written so, so the next deletion tries it again (a successor's too,
// through FlowTargets).
const flowDeleteFailed = "stale: deletion failed"

// The backoff of retries after failed deletions: 1 s, doubling, at most 30 s.
const (
	flowRetryBase = time.Second
	flowRetryMax  = 30 * time.Second
)

// retryFlowsLocked is deleteStaleFlowsLocked for a sync that wrote nothing: it runs only when a
// failed deletion left stale targets and their retry is due.
func (m *Manager) retryFlowsLocked(portals []Portal, nodeIPs []netip.Addr) {
	if m.flowFailures > 0 && !time.Now().Before(m.flowRetryAt) {
		m.deleteStaleFlowsLocked(portals, nodeIPs)
	}
}

// FlowRetryDue returns when stale UDP flows that a deletion failed to delete are to be tried
// again, and false when none are waiting. The retry comes with a sync: the caller runs one then.
func (m *Manager) FlowRetryDue() (time.Time, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.flowRetryAt, m.flowFailures > 0
}

// RetryDue returns the earliest FlowRetryDue of the families, and false when none has a retry
// waiting. The proxier runs a sync then (see userspace.Portals).
func (s *Set) RetryDue() (time.Time, bool) {
	var at time.Time
	any := false
	for _, f := range s.families {
		if t, ok := f.manager.FlowRetryDue(); ok && (!any || t.Before(at)) {
			at, any = t, true
		}
	}
	return at, any
}

// FlowTargets is what the portals did with each UDP target at their last sync, per family
// ("IPv4", "IPv6"; targets as "address:port"): a successor seeds its portals with its
// predecessor's (Set.SeedFlowTargets) so that its first sync deletes only the flows of targets
// whose handling changed in between, not those of every target, which would move UDP clients
// whose sessions it adopted to other endpoints.
type FlowTargets map[string]map[string]string

// FlowTargets returns what every family's portals did with each UDP target at their last
// successful sync (nil for a family that has not synced).
func (s *Set) FlowTargets() FlowTargets {
	out := FlowTargets{}
	for _, f := range s.families {
		f.manager.mu.Lock()
		if f.manager.udpTargets != nil {
			m := make(map[string]string, len(f.manager.udpTargets))
			for t, v := range f.manager.udpTargets {
				m[t.String()] = v
			}
			out[f.family.String()] = m
		}
		f.manager.mu.Unlock()
	}
	return out
}

// SeedFlowTargets takes a predecessor's FlowTargets as what the portals did at their last sync;
// call it before the first Sync. A family missing from ft keeps deleting the flows of every
// target at its first sync; an unparsable target is left out (its flows are deleted then).
func (s *Set) SeedFlowTargets(ft FlowTargets) {
	for _, f := range s.families {
		in, ok := ft[f.family.String()]
		if !ok {
			continue
		}
		m := make(map[netip.AddrPort]string, len(in))
		for t, v := range in {
			if ap, err := netip.ParseAddrPort(t); err == nil {
				m[ap] = v
			}
		}
		f.manager.mu.Lock()
		f.manager.udpTargets = m
		f.manager.mu.Unlock()
	}
}
