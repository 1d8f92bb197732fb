package loadbalancer

import (
	"net/netip"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// Endpoints that could not be reached. The proxy reports each failed TCP dial (refused, timed
// out, unreachable) and each ICMP error a UDP session's endpoint answers with, with Unreachable;
// for a while (the hold) the port's picks then pass over that endpoint, so that other
// connections and sessions do not wait on it too. It matters when endpoints die
// before their EndpointSlices say so: a node that stops with its pods, pods whose network is torn
// down while their endpoints are still listed. The first hold is unreachableHold; a failure
// reported within a hold's length after the previous hold ended doubles it, up to
// maxUnreachableHold. An endpoint whose hold has ended is picked again in its turn: its next
// connection is its trial. When every usable endpoint of a pick's pool is held, the pick ignores
// the holds (trying one beats refusing the client), taking the one whose hold ends first. Holds
// of endpoints that leave the port are dropped: an endpoint that comes back starts afresh.

const (
	unreachableHold    = time.Second
	maxUnreachableHold = 16 * time.Second
)

// holds are a port's held endpoints; immutable once published (Unreachable copies them).
type holds struct {
	m map[netip.AddrPort]hold
	// end is when the table stops mattering: every hold over, and the window in which a new
	// failure would double one closed (the latest until+length). Past it Next drops the table.
	end time.Duration
}

// hold is one endpoint's: held until (a time since RoundRobin.epoch), for length.
type hold struct {
	until, length time.Duration
}

// held reports whether a is held at now.
func (h *holds) held(a netip.AddrPort, now time.Duration) bool {
	e, ok := h.m[a]
	return ok && now < e.until
}

// Unreachable reports that a dial to endpoint of the service port name failed: the port's picks
// pass over it for its hold (see above). An endpoint the port does not have is ignored.
func (lb *RoundRobin) Unreachable(name proxy.Name, endpoint netip.AddrPort) {
	lb.mu.RLock()
	p := lb.ports[name]
	lb.mu.RUnlock()
	if p == nil {
		return
	}
	now := lb.now().Sub(lb.epoch)
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.snap.Load()
	if !s.has(endpoint) {
		return
	}
	old := p.held.Load()
	length := unreachableHold
	if old != nil {
		if e, ok := old.m[endpoint]; ok {
			switch {
			case now < e.until:
				return // held already: a connection that picked it before its hold began
			case now < e.until+e.length:
				length = min(2*e.length, maxUnreachableHold)
			}
		}
	}
	h := &holds{m: map[netip.AddrPort]hold{endpoint: {until: now + length, length: length}}}
	h.end = now + 2*length
	if old != nil {
		for a, e := range old.m {
			if a != endpoint && now < e.until+e.length {
				h.m[a] = e
				h.end = max(h.end, e.until+e.length)
			}
		}
	}
	p.held.Store(h)
}

// keepHeldLocked drops the holds of endpoints no longer in present. p.mu must be held.
func (p *port) keepHeldLocked(present endpointSet) {
	old := p.held.Load()
	if old == nil {
		return
	}
	var h *holds
	for a, e := range old.m {
		if _, ok := present.index(a); !ok {
			continue
		}
		if h == nil {
			h = &holds{m: map[netip.AddrPort]hold{}}
		}
		h.m[a] = e
		h.end = max(h.end, e.until+e.length)
	}
	switch {
	case h == nil:
		p.held.Store(nil)
	case len(h.m) < len(old.m):
		p.held.Store(h)
	}
}

// has reports whether endpoint is in one of s's pools.
func (s *snapshot) has(endpoint netip.AddrPort) bool {
	for _, pl := range s.pools {
		if _, ok := pl.find(endpoint); ok {
			return true
		}
	}
	return false
}

// pickAvailable is pl.pick for a port with holds h: the next endpoint in rotation that is not
// held, or when all are, the one whose hold ends first. Past h's end it drops the table (unless
// Unreachable replaced it meanwhile).
func (lb *RoundRobin) pickAvailable(p *port, pl *pool, h *holds) proxy.Endpoint {
	now := lb.now().Sub(lb.epoch)
	if now >= h.end {
		p.held.CompareAndSwap(h, nil)
		return pl.pick()
	}
	var (
		first proxy.Endpoint
		until time.Duration
	)
	for i := range pl.len() {
		ep := pl.pick()
		e, ok := h.m[ep.Addr]
		if !ok || now >= e.until {
			return ep
		}
		if i == 0 || e.until < until {
			first, until = ep, e.until
		}
	}
	return first
}
