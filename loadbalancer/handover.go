package loadbalancer

import (
	"net/netip"
	"slices"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// AffinityEntry is one client's remembered endpoint on one service port, as handed from a
// proxy to its successor, so that a restart or an upgrade keeps every client on its endpoint.
type AffinityEntry struct {
	Port     proxy.Name     `json:"port"`
	Client   netip.Addr     `json:"client"`
	Local    bool           `json:"local,omitempty"` // the rule of this node's endpoints only
	Endpoint netip.AddrPort `json:"endpoint"`
	// Idle is how long ago the entry was last used.
	Idle time.Duration `json:"idle"`
}

// Affinity returns every ClientIP affinity entry, the least recently used of each port first.
func (lb *RoundRobin) Affinity() []AffinityEntry {
	lb.mu.RLock()
	ports := make(map[proxy.Name]*port, len(lb.ports))
	for name, p := range lb.ports {
		ports[name] = p
	}
	lb.mu.RUnlock()
	now := lb.now().Sub(lb.epoch)
	var out []AffinityEntry
	for name, p := range ports {
		p.mu.Lock()
		if t := p.affinity; t != nil { // nil once deleted
			for i := t.oldest; i >= 0; i = t.entries[i].newer {
				e := &t.entries[i]
				out = append(out, AffinityEntry{Port: name, Client: e.client, Local: e.pool == poolLocal,
					Endpoint: e.ep, Idle: max(now-e.used, 0)})
			}
		}
		p.mu.Unlock()
	}
	return out
}

// RestoreAffinity takes entries handed over by a predecessor. Each port's entries are applied
// when SetServicePort first sets that port (restore before the first sync): those whose
// endpoint is among the port's endpoints and that have not expired are kept, in their order of
// use, as if this balancer had recorded them. Entries of ports that are already set are
// ignored.
func (lb *RoundRobin) RestoreAffinity(entries []AffinityEntry) {
	lb.writeMu.Lock()
	defer lb.writeMu.Unlock()
	if lb.restore == nil {
		lb.restore = map[proxy.Name][]AffinityEntry{}
	}
	for _, e := range entries {
		if e.Client.IsValid() && e.Endpoint.IsValid() {
			lb.restore[e.Port] = append(lb.restore[e.Port], e)
		}
	}
}

// restoreAffinityLocked applies the handed-over entries of a port just set; lb.writeMu and
// p.mu are held, s is the port's new snapshot and present its endpoints.
func (lb *RoundRobin) restoreAffinityLocked(p *port, s *snapshot, present endpointSet) {
	entries, ok := lb.restore[s.sp.Name]
	if !ok {
		return
	}
	delete(lb.restore, s.sp.Name)
	if !s.affinity {
		return
	}
	// Oldest first: the table's use order is the order of adding.
	slices.SortStableFunc(entries, func(a, b AffinityEntry) int { return int(b.Idle - a.Idle) })
	now := lb.now().Sub(lb.epoch)
	for _, e := range entries {
		if _, ok := present.index(e.Endpoint); !ok || e.Idle >= s.timeout() {
			continue
		}
		pool := poolCluster
		if e.Local {
			pool = poolLocal
		}
		if p.affinity == nil {
			p.affinity = newAffinityTable(lb.maxAffinity)
		}
		client := e.Client.Unmap()
		if _, dup := p.affinity.get(pool, client); dup {
			continue
		}
		p.affinity.add(pool, client, e.Endpoint, now-e.Idle)
	}
}
