package loadbalancer

import (
	"fmt"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
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

// TestUnreachableTrial: when a hold ends, one pick tries the endpoint and the others keep passing
// over it for trialHold; a failed trial doubles the hold, a trial without a failure gives the
// endpoint back to the rotation. With affinity too: clients bound to the endpoint do not all
// return to it at once.
func TestUnreachableTrial(t *testing.T) {
	for _, affinity := range []bool{false, true} {
		t.Run(fmt.Sprintf("affinity=%v", affinity), func(t *testing.T) {
			h := newHarness(t, thisNode, 7)
			n := name("svc", "http")
			var opts []func(*proxy.ServicePort)
			if affinity {
				opts = append(opts, withAffinity(time.Hour))
			}
			eps := []proxy.Endpoint{ready("10.0.0.1", "node-b"), ready("10.0.0.2", "node-b"), ready("10.0.0.3", "node-b")}
			dead := eps[0].Addr
			h.set(svcPort(n, opts...), eps...)
			// Twelve clients; with affinity a third of them are bound to dead, and their entries
			// still name it when its hold ends (they did not come back meanwhile).
			bound := make([]string, 12)
			for i := range bound {
				bound[i] = fmt.Sprintf("192.0.2.%d", i+1)
				h.next(n, bound[i], false, false)
			}
			// deadPicks counts the picks of dead among two picks for each of clients.
			deadPicks := func(clients []string) int {
				k := 0
				for range 2 {
					for _, c := range clients {
						if h.next(n, c, false, false).Addr == dead {
							k++
						}
					}
				}
				return k
			}
			fresh := 0
			freshClients := func() []string {
				out := make([]string, 12)
				for i := range out {
					fresh++
					out[i] = fmt.Sprintf("198.51.100.%d", fresh)
				}
				return out
			}
			h.lb.Unreachable(n, dead)
			if k := deadPicks(freshClients()); k != 0 {
				t.Fatalf("held: %d picks of %v", k, dead)
			}
			h.clock.Advance(unreachableHold)
			if k := deadPicks(bound); k != 1 {
				t.Fatalf("hold ended: %d picks of %v, want 1 (its trial)", k, dead)
			}
			h.clock.Advance(trialHold / 2)
			if k := deadPicks(freshClients()); k != 0 {
				t.Fatalf("trial under way: %d picks of %v, want 0", k, dead)
			}
			h.lb.Unreachable(n, dead) // the trial failed: held twice as long
			h.clock.Advance(2*unreachableHold - time.Millisecond)
			if k := deadPicks(freshClients()); k != 0 {
				t.Fatalf("after a failed trial, within the doubled hold: %d picks of %v", k, dead)
			}
			h.clock.Advance(time.Millisecond)
			if k := deadPicks(freshClients()); k != 1 {
				t.Fatalf("doubled hold ended: %d picks of %v, want 1 (its trial)", k, dead)
			}
			h.clock.Advance(trialHold) // no failure reported: back in the rotation
			if k := deadPicks(freshClients()); k < 2 {
				t.Errorf("after a trial without failure: %d picks of %v, want it in the rotation", k, dead)
			}
		})
	}
}

// TestUnreachableOneTrialAtOnce: picks racing when a hold ends make one trial between them.
func TestUnreachableOneTrialAtOnce(t *testing.T) {
	h := newHarness(t, thisNode, 8)
	n := name("svc", "http")
	eps := tenEndpoints()
	dead := eps[3].Addr
	h.set(svcPort(n), eps...)
	h.lb.Unreachable(n, dead)
	h.clock.Advance(unreachableHold)
	var (
		wg    sync.WaitGroup
		picks atomic.Int32
	)
	for range 8 {
		wg.Go(func() {
			for range 50 {
				ep, err := h.lb.Next(n, netip.Addr{}, false, false)
				if err == nil && ep.Addr == dead {
					picks.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if got := picks.Load(); got != 1 {
		t.Errorf("400 concurrent picks as the hold ended: %d of %v, want 1 (its trial)", got, dead)
	}
}
