package loadbalancer

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

const thisNode = "node-a"

// fakeClock is a manually advanced clock.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{t: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// harness is a RoundRobin with a fake clock and a fixed random seed.
type harness struct {
	t     *testing.T
	lb    *RoundRobin
	clock *fakeClock
}

func newHarness(t *testing.T, nodeName string, seed uint64) *harness {
	t.Helper()
	clock := newFakeClock()
	lb := New(Options{NodeName: nodeName, Now: clock.Now, Rand: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))})
	return &harness{t: t, lb: lb, clock: clock}
}

func (h *harness) set(sp *proxy.ServicePort, eps ...proxy.Endpoint) {
	h.lb.SetServicePort(sp, eps)
}

// next calls Next and fails the test on error.
func (h *harness) next(name proxy.Name, client string, external, reset bool) proxy.Endpoint {
	h.t.Helper()
	ep, err := h.lb.Next(name, clientAddr(client), external, reset)
	if err != nil {
		h.t.Fatalf("Next(%s, %s, external=%v, reset=%v): %v", name, client, external, reset, err)
	}
	return ep
}

// picks returns the addresses of n successive picks for client (internal traffic unless external).
func (h *harness) picks(name proxy.Name, client string, external bool, n int) []netip.AddrPort {
	h.t.Helper()
	out := make([]netip.AddrPort, n)
	for i := range out {
		out[i] = h.next(name, client, external, false).Addr
	}
	return out
}

// affinityEntries returns how many affinity entries the port holds, over all pools, and how many
// of them point at ep (if valid).
func (h *harness) affinityEntries(name proxy.Name, ep netip.AddrPort) (total, toEP int) {
	h.t.Helper()
	h.lb.mu.RLock()
	p := h.lb.ports[name]
	h.lb.mu.RUnlock()
	if p == nil {
		h.t.Fatalf("port %s unknown", name)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.affinity == nil {
		return 0, 0
	}
	for _, e := range p.affinity.entries {
		total++
		if e.ep == ep {
			toEP++
		}
	}
	return total, toEP
}

func clientAddr(s string) netip.Addr {
	if s == "" {
		return netip.Addr{}
	}
	return netip.MustParseAddr(s)
}

func name(svc, port string) proxy.Name {
	return proxy.Name{Namespace: "ns", Name: svc, Port: port}
}

// svcPort returns a TCP ServicePort, changed by the options.
func svcPort(n proxy.Name, opts ...func(*proxy.ServicePort)) *proxy.ServicePort {
	sp := &proxy.ServicePort{
		Name:       n,
		Protocol:   "TCP",
		Port:       80,
		ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.10")},
	}
	for _, o := range opts {
		o(sp)
	}
	return sp
}

func withAffinity(timeout time.Duration) func(*proxy.ServicePort) {
	return func(sp *proxy.ServicePort) {
		sp.SessionAffinity = true
		sp.AffinityTimeout = timeout
	}
}

func externalLocal(sp *proxy.ServicePort) { sp.ExternalPolicyLocal = true }
func internalLocal(sp *proxy.ServicePort) { sp.InternalPolicyLocal = true }

// Endpoint constructors: s is "ip:port" or "ip" (port 8080).
func ap(s string) netip.AddrPort {
	if a, err := netip.ParseAddrPort(s); err == nil {
		return a
	}
	return netip.AddrPortFrom(netip.MustParseAddr(s), 8080)
}

func ready(s, node string) proxy.Endpoint {
	return proxy.Endpoint{Addr: ap(s), Ready: true, Serving: true, NodeName: node}
}

// terminating is serving and terminating: usable only as a fallback.
func terminating(s, node string) proxy.Endpoint {
	return proxy.Endpoint{Addr: ap(s), Serving: true, Terminating: true, NodeName: node}
}

// stopping is terminating and no longer serving: never usable.
func stopping(s, node string) proxy.Endpoint {
	return proxy.Endpoint{Addr: ap(s), Terminating: true, NodeName: node}
}

// notReady is neither ready nor terminating (starting up, failing its probe): never usable.
func notReady(s, node string) proxy.Endpoint {
	return proxy.Endpoint{Addr: ap(s), NodeName: node}
}

func addrs(eps []proxy.Endpoint) []netip.AddrPort {
	out := make([]netip.AddrPort, len(eps))
	for i, e := range eps {
		out[i] = e.Addr
	}
	return out
}

// checkRotation checks that picks is a fair round robin over want: every aligned window of
// len(want) picks holds each address of want exactly once, and the sequence repeats with period
// len(want).
func checkRotation(picks, want []netip.AddrPort) error {
	n := len(want)
	if n == 0 {
		return errors.New("empty rotation")
	}
	wantSorted := slices.SortedFunc(slices.Values(want), netip.AddrPort.Compare)
	for start := 0; start+n <= len(picks); start += n {
		window := slices.SortedFunc(slices.Values(picks[start:start+n]), netip.AddrPort.Compare)
		if !slices.Equal(window, wantSorted) {
			return fmt.Errorf("picks[%d:%d] = %v, want each of %v once", start, start+n, picks[start:start+n], wantSorted)
		}
	}
	for i := n; i < len(picks); i++ {
		if picks[i] != picks[i-n] {
			return fmt.Errorf("picks %v do not repeat with period %d (index %d)", picks, n, i)
		}
	}
	return nil
}

// affinityOf returns the endpoint of client's affinity entry on the port under its cluster-wide
// rule (or its Local rule if local), and whether there is one (expired or not).
func (h *harness) affinityOf(name proxy.Name, client string, local bool) (netip.AddrPort, bool) {
	h.t.Helper()
	h.lb.mu.RLock()
	p := h.lb.ports[name]
	h.lb.mu.RUnlock()
	if p == nil {
		h.t.Fatalf("port %s unknown", name)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.affinity == nil {
		return netip.AddrPort{}, false
	}
	i, ok := p.affinity.get(poolFor(local), clientAddr(client).Unmap())
	if !ok {
		return netip.AddrPort{}, false
	}
	return p.affinity.entries[i].ep, true
}

// checkAffinityTables checks the structure of every affinity table of lb: the map and the
// slice hold the same entries, within the bound, and the list links each of them once, from the
// newest to the oldest, in order of their use times.
func checkAffinityTables(t *testing.T, lb *RoundRobin) {
	t.Helper()
	lb.mu.RLock()
	defer lb.mu.RUnlock()
	for name, p := range lb.ports {
		p.mu.Lock()
		if err := p.affinity.check(); err != nil {
			t.Errorf("%s: affinity table: %v", name, err)
		}
		p.mu.Unlock()
	}
}

// check returns what is wrong with t's structure; nil t is an empty table.
func (t *affinityTable) check() error {
	if t == nil {
		return nil
	}
	n := len(t.entries)
	switch {
	case n == 0:
		return errors.New("empty table kept")
	case n > t.max:
		return fmt.Errorf("%d entries, bound %d", n, t.max)
	case len(t.index[poolCluster])+len(t.index[poolLocal]) != n:
		return fmt.Errorf("%d entries, %d+%d in the maps", n, len(t.index[poolCluster]), len(t.index[poolLocal]))
	}
	for pool, m := range t.index {
		for c, i := range m {
			if i < 0 || int(i) >= n || t.entries[i].client != c || int(t.entries[i].pool) != pool {
				return fmt.Errorf("map of pool %d: %v at %d, not there", pool, c, i)
			}
		}
	}
	seen := 0
	prev := int32(-1)
	for i := t.newest; i >= 0; i = t.entries[i].older {
		if seen++; seen > n {
			return errors.New("list has a cycle")
		}
		e := t.entries[i]
		if e.newer != prev {
			return fmt.Errorf("entry %d: newer link %d, want %d", i, e.newer, prev)
		}
		if prev >= 0 && e.used > t.entries[prev].used {
			return fmt.Errorf("entry %d used at %v, after the newer entry %d (%v)", i, e.used, prev, t.entries[prev].used)
		}
		prev = i
	}
	if seen != n || prev != t.oldest {
		return fmt.Errorf("list links %d of %d entries, ends at %d, oldest %d", seen, n, prev, t.oldest)
	}
	return nil
}
