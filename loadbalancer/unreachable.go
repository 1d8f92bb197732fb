package loadbalancer

import (
	"maps"
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
// maxUnreachableHold. When a hold ends, the endpoint is not given back to every pick at once:
// the first pick that comes to it makes that connection its trial (half-open, as a circuit
// breaker), and the others keep passing over it for trialHold, the time the trial's dial needs to
// succeed or fail. A trial that fails doubles the hold as above; one that does not report a
// failure within trialHold gives the endpoint back to the rotation. Without the trial, every
// connection of the first moments after a hold dialed an endpoint that was still dead (a node
// that stopped: its pods' addresses answer nothing, each dial waits its whole first timeout)
// and some outwaited their clients. When every usable endpoint of a pick's pool is held, the
// pick ignores the holds (trying one beats refusing the client), taking the one whose hold ends
// first. Holds of endpoints that leave the port are dropped: an endpoint that comes back starts
// afresh.

const (
	unreachableHold    = time.Second
	maxUnreachableHold = 16 * time.Second
	// trialHold covers a trial's dial: the TCP proxy's first two dial timeouts (250 ms and
	// 500 ms) and a UDP endpoint's ICMP answer. A trial that takes longer leaves the endpoint
	// to other picks meanwhile, as without trials.
	trialHold = time.Second
)

// holds are a port's held endpoints; immutable once published (Unreachable copies them).
type holds struct {
	m map[netip.AddrPort]hold
	// end is when the table stops mattering: every hold over, and the window in which a new
	// failure would double one closed (the latest until+length). Past it Next drops the table.
	end time.Duration
}

// hold is one endpoint's: held until (a time since RoundRobin.epoch), for length. A trial hold
// is the short one while one connection tries the endpoint after its hold of length ended.
type hold struct {
	until, length time.Duration
	trial         bool
}

// available reports whether endpoint a may be picked at now under p's holds h: it has no hold,
// or a trial that ended without a failure, or its hold ended and this pick becomes its trial
// (published on p). When the holds changed meanwhile, the current ones decide, without a trial.
func (p *port) available(h *holds, a netip.AddrPort, now time.Duration) bool {
	e, ok := h.m[a]
	switch {
	case !ok:
		return true
	case now < e.until:
		return false
	case e.trial:
		return true
	}
	t := &holds{m: maps.Clone(h.m), end: h.end}
	e = hold{until: now + trialHold, length: e.length, trial: true}
	t.m[a] = e
	t.end = max(t.end, e.until+e.length)
	if p.held.CompareAndSwap(h, t) {
		return true
	}
	cur := p.held.Load()
	if cur == nil {
		return true
	}
	e, ok = cur.m[a]
	return !ok || e.trial && now >= e.until
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
			case now < e.until && !e.trial:
				return // held already: a connection that picked it before its hold began
			case now < e.until+e.length: // a failed trial, or a failure soon after the hold
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

// pickAvailable is pl.pick for a port with holds h: the next endpoint in rotation that is
// available (not held, or its trial: see above), or when none is, the one whose hold ends first.
// Past h's end it drops the table (unless Unreachable replaced it meanwhile).
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
		if p.available(h, ep.Addr, now) {
			return ep
		}
		e := h.m[ep.Addr]
		if i == 0 || e.until < until {
			first, until = ep, e.until
		}
	}
	return first
}
