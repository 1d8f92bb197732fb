package loadbalancer

import (
	"fmt"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// TestUnreachablePassedOver: nine of ten endpoints reported unreachable: every pick goes to the
// tenth until their holds end, then the rotation covers all ten again.
func TestUnreachablePassedOver(t *testing.T) {
	for _, affinity := range []bool{false, true} {
		t.Run(fmt.Sprintf("affinity=%v", affinity), func(t *testing.T) {
			h := newHarness(t, thisNode, 1)
			n := name("svc", "http")
			var opts []func(*proxy.ServicePort)
			if affinity {
				opts = append(opts, withAffinity(time.Hour))
			}
			eps := tenEndpoints()
			h.set(svcPort(n, opts...), eps...)
			alive := eps[6].Addr
			for _, e := range eps {
				if e.Addr != alive {
					h.lb.Unreachable(n, e.Addr)
				}
			}
			for i := range 30 {
				client := fmt.Sprintf("192.0.2.%d", i+1) // a new client each time: affinity picks too
				if got := h.next(n, client, false, false).Addr; got != alive {
					t.Fatalf("pick %d: %v, want the one reachable endpoint %v", i, got, alive)
				}
			}
			h.clock.Advance(unreachableHold)
			seen := map[netip.AddrPort]bool{}
			for i := range 10 {
				seen[h.next(n, fmt.Sprintf("192.0.2.%d", 100+i), false, false).Addr] = true
			}
			if len(seen) != 10 {
				t.Errorf("after the holds: picks of %d endpoints, want all 10", len(seen))
			}
		})
	}
}

// TestUnreachableAllHeld: when every usable endpoint is held, picks go on (the one whose hold ends
// first) rather than failing.
func TestUnreachableAllHeld(t *testing.T) {
	h := newHarness(t, thisNode, 2)
	n := name("svc", "http")
	a, b := ready("10.0.0.1", "node-b"), ready("10.0.0.2", "node-b")
	h.set(svcPort(n), a, b)
	h.lb.Unreachable(n, b.Addr)
	h.clock.Advance(100 * time.Millisecond)
	h.lb.Unreachable(n, a.Addr)
	for i := range 4 {
		if got := h.next(n, "", false, false).Addr; got != b.Addr {
			t.Fatalf("pick %d: %v, want %v (its hold ends first)", i, got, b.Addr)
		}
	}
}

// TestUnreachableHoldDoubles: a failure soon after a hold ended doubles the next hold, up to the
// bound; a failure long after starts again from the first hold.
func TestUnreachableHoldDoubles(t *testing.T) {
	h := newHarness(t, thisNode, 3)
	n := name("svc", "http")
	dead, alive := ready("10.0.0.1", "node-b"), ready("10.0.0.2", "node-b")
	h.set(svcPort(n), dead, alive)
	// heldFor reports the hold dead gets now, by advancing the clock until it is picked again.
	heldFor := func() time.Duration {
		t.Helper()
		h.lb.Unreachable(n, dead.Addr)
		const step = 100 * time.Millisecond
		for d := time.Duration(0); d <= 2*maxUnreachableHold; d += step {
			if slices.Contains(h.picks(n, "", false, 2), dead.Addr) {
				return d
			}
			h.clock.Advance(step)
		}
		t.Fatal("the unreachable endpoint was never picked again")
		return 0
	}
	want := unreachableHold
	for i := range 7 {
		if got := heldFor(); got != want {
			t.Fatalf("failure %d: held %v, want %v", i+1, got, want)
		}
		want = min(2*want, maxUnreachableHold)
	}
	h.clock.Advance(2 * maxUnreachableHold)
	if got := heldFor(); got != unreachableHold {
		t.Errorf("a failure long after the last: held %v, want %v again", got, unreachableHold)
	}
}

// TestUnreachableRepeatWithinHold: reports of connections that picked the endpoint before its hold
// began do not lengthen the hold.
func TestUnreachableRepeatWithinHold(t *testing.T) {
	h := newHarness(t, thisNode, 4)
	n := name("svc", "http")
	dead, alive := ready("10.0.0.1", "node-b"), ready("10.0.0.2", "node-b")
	h.set(svcPort(n), dead, alive)
	h.lb.Unreachable(n, dead.Addr)
	h.clock.Advance(unreachableHold / 2)
	h.lb.Unreachable(n, dead.Addr)
	h.lb.Unreachable(n, dead.Addr)
	h.clock.Advance(unreachableHold / 2)
	if !slices.Contains(h.picks(n, "", false, 2), dead.Addr) {
		t.Errorf("still held after %v: repeated reports within the hold lengthened it", unreachableHold)
	}
}

// TestUnreachableForgottenWhenEndpointLeaves: an endpoint that leaves and comes back (a new pod
// with the same address) is not held; reports of unknown endpoints or ports change nothing.
func TestUnreachableForgottenWhenEndpointLeaves(t *testing.T) {
	h := newHarness(t, thisNode, 5)
	n := name("svc", "http")
	a, b := ready("10.0.0.1", "node-b"), ready("10.0.0.2", "node-b")
	sp := svcPort(n)
	h.set(sp, a, b)
	h.lb.Unreachable(n, a.Addr)
	h.lb.Unreachable(n, ap("10.0.0.99"))            // not an endpoint of the port
	h.lb.Unreachable(name("other", "http"), b.Addr) // not a port
	if got := h.picks(n, "", false, 4); slices.Contains(got, a.Addr) {
		t.Fatalf("picks %v include the held %v", got, a.Addr)
	}
	h.set(sp, b)
	h.set(sp, a, b)
	if got := h.picks(n, "", false, 2); !slices.Contains(got, a.Addr) {
		t.Errorf("picks %v: the endpoint that left and came back is still held", got)
	}
	if got := h.picks(n, "", false, 4); !slices.Contains(got, b.Addr) {
		t.Errorf("picks %v: %v held by a report for another port", got, b.Addr)
	}
	// The other endpoint keeps its hold across a change that keeps it.
	h.lb.Unreachable(n, b.Addr)
	h.set(sp, a, b, ready("10.0.0.3", "node-b"))
	if got := h.picks(n, "", false, 6); slices.Contains(got, b.Addr) {
		t.Errorf("picks %v include %v, held before an unrelated change", got, b.Addr)
	}
	h.lb.DeleteServicePort(n)
	h.set(sp, a, b)
	if got := h.picks(n, "", false, 2); !slices.Contains(got, b.Addr) {
		t.Errorf("picks %v: a deleted and re-added port kept its holds", got)
	}
}

// TestUnreachableNoHoldsNoAllocations: ports without holds pick as before, allocating nothing.
func TestUnreachableNoHoldsNoAllocations(t *testing.T) {
	h := newHarness(t, thisNode, 6)
	n := name("svc", "http")
	h.set(svcPort(n), tenEndpoints()...)
	h.lb.Unreachable(n, ap("10.0.0.1"))
	h.clock.Advance(2 * unreachableHold) // past the hold and its doubling window: the table goes
	h.next(n, "", false, false)
	h.lb.mu.RLock()
	p := h.lb.ports[n]
	h.lb.mu.RUnlock()
	if p.held.Load() != nil {
		t.Fatal("holds kept past their end")
	}
	if allocs := testing.AllocsPerRun(100, func() { h.lb.Next(n, netip.Addr{}, false, false) }); allocs != 0 {
		t.Errorf("Next allocates %v times", allocs)
	}
}
