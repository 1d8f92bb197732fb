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

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/serviceport"
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

func (h *harness) set(sp *serviceport.ServicePort, eps ...serviceport.Endpoint) {
	h.lb.SetServicePort(sp, eps)
}

// next calls Next and fails the test on error.
func (h *harness) next(name serviceport.Name, client string, external, reset bool) serviceport.Endpoint {
	h.t.Helper()
	ep, err := h.lb.Next(name, clientAddr(client), external, reset)
	if err != nil {
		h.t.Fatalf("Next(%s, %s, external=%v, reset=%v): %v", name, client, external, reset, err)
	}
	return ep
}

// picks returns the addresses of n successive picks for client (internal traffic unless external).
func (h *harness) picks(name serviceport.Name, client string, external bool, n int) []netip.AddrPort {
	h.t.Helper()
	out := make([]netip.AddrPort, n)
	for i := range out {
		out[i] = h.next(name, client, external, false).Addr
	}
	return out
}

// affinityEntries returns how many affinity entries the port holds, over all pools, and how many
// of them point at ep (if valid).
func (h *harness) affinityEntries(name serviceport.Name, ep netip.AddrPort) (total, toEP int) {
	h.t.Helper()
	h.lb.mu.RLock()
	p := h.lb.ports[name]
	h.lb.mu.RUnlock()
	if p == nil {
		h.t.Fatalf("port %s unknown", name)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, table := range p.affinity {
		for _, e := range table {
			total++
			if e.ep == ep {
				toEP++
			}
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

func name(svc, port string) serviceport.Name {
	return serviceport.Name{Namespace: "ns", Name: svc, Port: port}
}

// svcPort returns a TCP ServicePort, changed by the options.
func svcPort(n serviceport.Name, opts ...func(*serviceport.ServicePort)) *serviceport.ServicePort {
	sp := &serviceport.ServicePort{
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

func withAffinity(timeout time.Duration) func(*serviceport.ServicePort) {
	return func(sp *serviceport.ServicePort) {
		sp.SessionAffinity = true
		sp.AffinityTimeout = timeout
	}
}

func externalLocal(sp *serviceport.ServicePort) { sp.ExternalPolicyLocal = true }
func internalLocal(sp *serviceport.ServicePort) { sp.InternalPolicyLocal = true }

// Endpoint constructors: s is "ip:port" or "ip" (port 8080).
func ap(s string) netip.AddrPort {
	if a, err := netip.ParseAddrPort(s); err == nil {
		return a
	}
	return netip.AddrPortFrom(netip.MustParseAddr(s), 8080)
}

func ready(s, node string) serviceport.Endpoint {
	return serviceport.Endpoint{Addr: ap(s), Ready: true, Serving: true, NodeName: node}
}

// terminating is serving and terminating: usable only as a fallback.
func terminating(s, node string) serviceport.Endpoint {
	return serviceport.Endpoint{Addr: ap(s), Serving: true, Terminating: true, NodeName: node}
}

// stopping is terminating and no longer serving: never usable.
func stopping(s, node string) serviceport.Endpoint {
	return serviceport.Endpoint{Addr: ap(s), Terminating: true, NodeName: node}
}

// notReady is neither ready nor terminating (starting up, failing its probe): never usable.
func notReady(s, node string) serviceport.Endpoint {
	return serviceport.Endpoint{Addr: ap(s), NodeName: node}
}

func addrs(eps []serviceport.Endpoint) []netip.AddrPort {
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
