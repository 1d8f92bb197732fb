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

func TestRoundRobin(t *testing.T) {
	svc := name("web", "http")
	tests := []struct {
		name    string
		eps     []proxy.Endpoint
		wantErr error
	}{
		{name: "no endpoints", wantErr: ErrNoEndpoints},
		{name: "only unusable endpoints", eps: []proxy.Endpoint{
			notReady("10.0.0.1", "n1"), stopping("10.0.0.2", "n1"),
		}, wantErr: ErrNoEndpoints},
		{name: "one endpoint", eps: []proxy.Endpoint{ready("10.0.0.1", "n1")}},
		{name: "many endpoints", eps: []proxy.Endpoint{
			ready("10.0.0.1", "n1"), ready("10.0.0.2", "n2"), ready("10.0.0.3", "n3"),
			ready("10.0.0.4", "n1"), ready("10.0.0.5", "n2"),
		}},
		{name: "IPv6 endpoints only", eps: []proxy.Endpoint{
			ready("[fd00::1]:8080", "n1"), ready("[fd00::2]:8080", "n2"),
		}},
		{name: "duplicate addresses count once", eps: []proxy.Endpoint{
			ready("10.0.0.1", "n1"), ready("10.0.0.2", "n2"), ready("10.0.0.1", "n1"),
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, thisNode, 1)
			h.set(svcPort(svc), tt.eps...)
			for _, external := range []bool{false, true} {
				if tt.wantErr != nil {
					_, err := h.lb.Next(svc, clientAddr("192.168.1.1"), external, false)
					if !errors.Is(err, tt.wantErr) {
						t.Fatalf("Next(external=%v) error = %v, want %v", external, err, tt.wantErr)
					}
					continue
				}
				want := slices.Compact(slices.SortedFunc(slices.Values(addrs(tt.eps)), netip.AddrPort.Compare))
				picks := h.picks(svc, "192.168.1.1", external, 3*len(want))
				if err := checkRotation(picks, want); err != nil {
					t.Errorf("external=%v: %v", external, err)
				}
			}
		})
	}
}

// TestShuffle checks that the rotation starts from a random order that depends only on the seed.
func TestShuffle(t *testing.T) {
	svc := name("web", "http")
	var eps []proxy.Endpoint
	for i := range 8 {
		eps = append(eps, ready(netip.AddrFrom4([4]byte{10, 0, 0, byte(i + 1)}).String(), "n1"))
	}
	firstLap := func(seed uint64) []netip.AddrPort {
		h := newHarness(t, thisNode, seed)
		h.set(svcPort(svc), eps...)
		return h.picks(svc, "192.168.1.1", false, len(eps))
	}
	orders := map[string]bool{}
	for seed := range uint64(20) {
		lap := firstLap(seed)
		if again := firstLap(seed); !slices.Equal(lap, again) {
			t.Fatalf("seed %d: orders %v and %v differ", seed, lap, again)
		}
		if err := checkRotation(lap, addrs(eps)); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		orders[fmt.Sprint(lap)] = true
	}
	if len(orders) < 10 {
		t.Errorf("20 seeds gave only %d distinct orders; want a shuffled order", len(orders))
	}

	// An endpoint added later joins the rotation at a random place, not always last.
	positions := map[int]bool{}
	added := ready("10.0.0.100", "n1")
	for seed := range uint64(20) {
		h := newHarness(t, thisNode, seed)
		h.set(svcPort(svc), eps...)
		h.picks(svc, "192.168.1.1", false, len(eps))
		h.set(svcPort(svc), append(slices.Clone(eps), added)...)
		lap := h.picks(svc, "192.168.1.1", false, len(eps)+1)
		positions[slices.Index(lap, added.Addr)] = true
	}
	if len(positions) < 4 {
		t.Errorf("over 20 seeds an added endpoint took only lap positions %v; want random positions", positions)
	}
}

func TestMultiplePortsIndependent(t *testing.T) {
	http, https := name("web", "http"), name("web", "https")
	h := newHarness(t, thisNode, 2)
	h.set(svcPort(http), ready("10.0.0.1:80", ""), ready("10.0.0.2:80", ""), ready("10.0.0.3:80", ""))
	h.set(svcPort(https), ready("10.0.0.1:443", ""), ready("10.0.0.2:443", ""))

	var httpPicks, httpsPicks []netip.AddrPort
	for i := range 12 {
		httpPicks = append(httpPicks, h.next(http, "192.168.1.1", false, false).Addr)
		for range i % 3 {
			httpsPicks = append(httpsPicks, h.next(https, "192.168.1.1", false, false).Addr)
		}
	}
	if err := checkRotation(httpPicks, []netip.AddrPort{ap("10.0.0.1:80"), ap("10.0.0.2:80"), ap("10.0.0.3:80")}); err != nil {
		t.Errorf("http: %v", err)
	}
	if err := checkRotation(httpsPicks, []netip.AddrPort{ap("10.0.0.1:443"), ap("10.0.0.2:443")}); err != nil {
		t.Errorf("https: %v", err)
	}

	// Updating and deleting one port leaves the other alone.
	want := h.picks(http, "192.168.1.1", false, 3)
	h.set(svcPort(https), ready("10.0.0.9:443", ""))
	h.lb.DeleteServicePort(https)
	if got := h.picks(http, "192.168.1.1", false, 3); !slices.Equal(got, want) {
		t.Errorf("http rotation after changing https = %v, want %v", got, want)
	}
}

func TestEndpointUpdates(t *testing.T) {
	svc := name("web", "http")
	a, b, c, d, e := "10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"
	tests := []struct {
		name   string
		before []proxy.Endpoint
		picks  int // picks made before the update
		after  []proxy.Endpoint
		spOpts []func(*proxy.ServicePort) // options of the ServicePort set with after
	}{
		{
			name:   "endpoints added mid-rotation",
			before: []proxy.Endpoint{ready(a, ""), ready(b, ""), ready(c, "")},
			picks:  1,
			after:  []proxy.Endpoint{ready(a, ""), ready(b, ""), ready(c, ""), ready(d, ""), ready(e, "")},
		},
		{
			name:   "next endpoint removed mid-rotation",
			before: []proxy.Endpoint{ready(a, ""), ready(b, ""), ready(c, ""), ready(d, "")},
			picks:  5,
			after:  nil, // filled in from the observed rotation: everything but the next pick
		},
		{
			name:   "all endpoints replaced",
			before: []proxy.Endpoint{ready(a, ""), ready(b, "")},
			picks:  1,
			after:  []proxy.Endpoint{ready(c, ""), ready(d, ""), ready(e, "")},
		},
		{
			name:   "endpoint becomes terminating",
			before: []proxy.Endpoint{ready(a, ""), ready(b, ""), ready(c, "")},
			picks:  2,
			after:  []proxy.Endpoint{ready(a, ""), terminating(b, ""), ready(c, "")},
		},
		{
			name:   "only the service changes",
			before: []proxy.Endpoint{ready(a, ""), ready(b, ""), ready(c, "")},
			picks:  1,
			after:  []proxy.Endpoint{ready(c, ""), ready(b, ""), ready(a, "")},
			spOpts: []func(*proxy.ServicePort){externalLocal, func(sp *proxy.ServicePort) { sp.Port = 8080 }},
		},
		{
			name:   "all endpoints removed",
			before: []proxy.Endpoint{ready(a, ""), ready(b, "")},
			picks:  1,
			after:  []proxy.Endpoint{},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t, thisNode, 3)
			h.set(svcPort(svc), tt.before...)
			// Learn the rotation from a full lap (which brings it back to its start), then
			// move it on by tt.picks.
			lap := h.picks(svc, "192.168.1.1", false, len(tt.before))
			h.picks(svc, "192.168.1.1", false, tt.picks)
			after := tt.after
			if after == nil {
				for _, ep := range tt.before {
					if ep.Addr != lap[tt.picks%len(lap)] {
						after = append(after, ep)
					}
				}
			}
			h.set(svcPort(svc, tt.spOpts...), after...)

			usable := addrs(Usable(svcPort(svc), after, Node{Name: thisNode}, false))
			if len(usable) == 0 {
				if _, err := h.lb.Next(svc, clientAddr("192.168.1.1"), false, false); !errors.Is(err, ErrNoEndpoints) {
					t.Fatalf("Next after update: error %v, want %v", err, ErrNoEndpoints)
				}
				return
			}
			// The rotation continues where it was: with the endpoint that would have been next,
			// or the first one after it that is still usable; new endpoints join the rotation.
			var wantFirst netip.AddrPort
			for k := range lap {
				if cand := lap[(tt.picks+k)%len(lap)]; slices.Contains(usable, cand) {
					wantFirst = cand
					break
				}
			}
			got := h.picks(svc, "192.168.1.1", false, 3*len(usable))
			if wantFirst.IsValid() && got[0] != wantFirst {
				t.Errorf("first pick after update = %v, want %v (rotation before: %v, %d picks made)", got[0], wantFirst, lap, tt.picks)
			}
			if err := checkRotation(got, usable); err != nil {
				t.Error(err)
			}
			// Surviving endpoints keep their order.
			var keptBefore, keptAfter []netip.AddrPort
			for _, x := range lap {
				if slices.Contains(usable, x) {
					keptBefore = append(keptBefore, x)
				}
			}
			for _, x := range got[:len(usable)] {
				if slices.Contains(keptBefore, x) {
					keptAfter = append(keptAfter, x)
				}
			}
			if !isRotationOf(keptAfter, keptBefore) {
				t.Errorf("surviving endpoints rotate as %v, before as %v", keptAfter, keptBefore)
			}
		})
	}
}

// isRotationOf reports whether a is b rotated (same cyclic order).
func isRotationOf(a, b []netip.AddrPort) bool {
	if len(a) != len(b) {
		return false
	}
	if len(a) == 0 {
		return true
	}
	for s := range b {
		if slices.Equal(a, append(slices.Clone(b[s:]), b[:s]...)) {
			return true
		}
	}
	return false
}

func TestServicePortRemoval(t *testing.T) {
	svc, other := name("web", "http"), name("web", "metrics")
	h := newHarness(t, thisNode, 4)
	if _, err := h.lb.Next(svc, clientAddr("192.168.1.1"), false, false); !errors.Is(err, ErrUnknownServicePort) {
		t.Fatalf("Next before SetServicePort: error %v, want %v", err, ErrUnknownServicePort)
	}
	h.set(svcPort(svc), ready("10.0.0.1", ""))
	h.set(svcPort(other), ready("10.0.0.1:9090", ""))
	h.next(svc, "192.168.1.1", false, false)
	h.lb.DeleteServicePort(svc)
	h.lb.DeleteServicePort(svc) // deleting twice is harmless
	for _, external := range []bool{false, true} {
		if _, err := h.lb.Next(svc, clientAddr("192.168.1.1"), external, false); !errors.Is(err, ErrUnknownServicePort) {
			t.Errorf("Next(external=%v) after DeleteServicePort: error %v, want %v", external, err, ErrUnknownServicePort)
		}
	}
	if got := h.next(other, "192.168.1.1", false, false).Addr; got != ap("10.0.0.1:9090") {
		t.Errorf("other port of the service: got %v", got)
	}
	h.set(svcPort(svc), ready("10.0.0.2", ""))
	if got := h.next(svc, "192.168.1.1", false, false).Addr; got != ap("10.0.0.2") {
		t.Errorf("after re-adding: got %v, want 10.0.0.2:8080", got)
	}
}

func TestSessionAffinity(t *testing.T) {
	svc := name("web", "http")
	three := []proxy.Endpoint{ready("10.0.0.1", ""), ready("10.0.0.2", ""), ready("10.0.0.3", "")}
	const c1, c2, c3 = "192.168.1.1", "192.168.1.2", "192.168.1.3"

	tests := []struct {
		name string
		run  func(t *testing.T, h *harness)
	}{
		{"same client gets the same endpoint", func(t *testing.T, h *harness) {
			h.set(svcPort(svc, withAffinity(time.Hour)), three...)
			first := h.next(svc, c1, false, false)
			for i := range 20 {
				h.next(svc, "10.1.0."+string(rune('0'+i%10)), false, false) // others move the rotation
				if got := h.next(svc, c1, false, false); got != first {
					t.Fatalf("pick %d = %v, want %v", i, got, first)
				}
			}
		}},
		{"different clients spread", func(t *testing.T, h *harness) {
			h.set(svcPort(svc, withAffinity(time.Hour)), three...)
			got := []netip.AddrPort{h.next(svc, c1, false, false).Addr, h.next(svc, c2, false, false).Addr, h.next(svc, c3, false, false).Addr}
			if err := checkRotation(got, addrs(three)); err != nil {
				t.Error(err)
			}
		}},
		{"expires after the timeout since last use, then round robin", func(t *testing.T, h *harness) {
			h.set(svcPort(svc, withAffinity(10*time.Second)), three...)
			first := h.next(svc, c1, false, false)
			for range 3 { // each use restarts the timeout
				h.clock.Advance(9 * time.Second)
				if got := h.next(svc, c1, false, false); got != first {
					t.Fatalf("within timeout: %v, want %v", got, first)
				}
			}
			h.clock.Advance(10 * time.Second)
			second := h.next(svc, c1, false, false)
			if second == first {
				t.Fatalf("after timeout: still %v, want the next endpoint in rotation", first)
			}
			if got := h.next(svc, c1, false, false); got != second {
				t.Errorf("new affinity: %v, want %v", got, second)
			}
		}},
		{"default timeout when unset", func(t *testing.T, h *harness) {
			h.set(svcPort(svc, withAffinity(0)), three...)
			first := h.next(svc, c1, false, false)
			h.clock.Advance(proxy.DefaultAffinityTimeout - time.Second)
			if got := h.next(svc, c1, false, false); got != first {
				t.Fatalf("before default timeout: %v, want %v", got, first)
			}
			h.clock.Advance(proxy.DefaultAffinityTimeout)
			if got := h.next(svc, c1, false, false); got == first {
				t.Errorf("after default timeout: still %v", got)
			}
		}},
		{"custom timeout honoured on the first SetServicePort (107398)", func(t *testing.T, h *harness) {
			h.set(svcPort(svc, withAffinity(5*time.Second)), three...)
			first := h.next(svc, c1, false, false)
			h.clock.Advance(4 * time.Second)
			if got := h.next(svc, c1, false, false); got != first {
				t.Fatalf("before timeout: %v, want %v", got, first)
			}
			h.clock.Advance(5 * time.Second)
			if got := h.next(svc, c1, false, false); got == first {
				t.Errorf("after the custom 5s timeout: still %v", got)
			}
		}},
		{"custom timeout honoured when endpoints came first (107398)", func(t *testing.T, h *harness) {
			h.set(svcPort(svc), three...)
			h.set(svcPort(svc, withAffinity(5*time.Second)), three...)
			first := h.next(svc, c1, false, false)
			h.clock.Advance(5 * time.Second)
			if got := h.next(svc, c1, false, false); got == first {
				t.Errorf("after the custom 5s timeout: still %v", got)
			}
		}},
		{"shortened timeout applies to existing entries (107398)", func(t *testing.T, h *harness) {
			h.set(svcPort(svc, withAffinity(100*time.Second)), three...)
			first := h.next(svc, c1, false, false)
			h.clock.Advance(6 * time.Second)
			h.set(svcPort(svc, withAffinity(5*time.Second)), three...)
			if got := h.next(svc, c1, false, false); got == first {
				t.Errorf("entry last used 6s ago under a new 5s timeout: still %v", got)
			}
		}},
		{"lengthened timeout applies to existing entries", func(t *testing.T, h *harness) {
			h.set(svcPort(svc, withAffinity(5*time.Second)), three...)
			first := h.next(svc, c1, false, false)
			h.clock.Advance(time.Second)
			h.set(svcPort(svc, withAffinity(100*time.Second)), three...)
			h.clock.Advance(50 * time.Second)
			h.lb.Sweep()
			if got := h.next(svc, c1, false, false); got != first {
				t.Errorf("entry last used 51s ago under a new 100s timeout: %v, want %v", got, first)
			}
		}},
		{"endpoint removal drops its entries", func(t *testing.T, h *harness) {
			h.set(svcPort(svc, withAffinity(time.Hour)), three...)
			e1, e2 := h.next(svc, c1, false, false), h.next(svc, c2, false, false)
			var rest []proxy.Endpoint
			for _, e := range three {
				if e != e1 {
					rest = append(rest, e)
				}
			}
			h.set(svcPort(svc, withAffinity(time.Hour)), rest...)
			if total, toE1 := h.affinityEntries(svc, e1.Addr); total != 1 || toE1 != 0 {
				t.Fatalf("after removing %v: %d entries, %d to it; want 1 and 0", e1, total, toE1)
			}
			if got := h.next(svc, c2, false, false); got != e2 {
				t.Errorf("client of a surviving endpoint: %v, want %v", got, e2)
			}
			moved := h.next(svc, c1, false, false)
			if moved == e1 {
				t.Fatalf("client of the removed endpoint still gets it")
			}
			h.set(svcPort(svc, withAffinity(time.Hour)), three...) // it comes back
			if got := h.next(svc, c1, false, false); got != moved {
				t.Errorf("after the endpoint came back: %v, want %v (old entry must be gone)", got, moved)
			}
		}},
		{"resetAffinity moves to another endpoint", func(t *testing.T, h *harness) {
			h.set(svcPort(svc, withAffinity(time.Hour)), three...)
			failed := h.next(svc, c1, false, false)
			// Two more clients: the rotation is now back at the failed endpoint.
			h.next(svc, c2, false, false)
			h.next(svc, c3, false, false)
			moved := h.next(svc, c1, false, true)
			if moved == failed {
				t.Fatalf("resetAffinity returned the failed endpoint %v", failed)
			}
			if got := h.next(svc, c1, false, false); got != moved {
				t.Errorf("after reset: %v, want the new choice %v", got, moved)
			}
		}},
		{"resetAffinity with one endpoint returns it", func(t *testing.T, h *harness) {
			h.set(svcPort(svc, withAffinity(time.Hour)), three[0])
			h.next(svc, c1, false, false)
			if got := h.next(svc, c1, false, true); got != three[0] {
				t.Errorf("got %v, want %v", got, three[0])
			}
		}},
		{"affinity turned off drops entries and round robins", func(t *testing.T, h *harness) {
			h.set(svcPort(svc, withAffinity(time.Hour)), three...)
			h.next(svc, c1, false, false)
			h.next(svc, c2, false, false)
			h.set(svcPort(svc), three...)
			if total, _ := h.affinityEntries(svc, netip.AddrPort{}); total != 0 {
				t.Fatalf("%d entries left with affinity off", total)
			}
			if err := checkRotation(h.picks(svc, c1, false, 6), addrs(three)); err != nil {
				t.Errorf("affinity off: %v", err)
			}
			h.set(svcPort(svc, withAffinity(time.Hour)), three...)
			first := h.next(svc, c1, false, false)
			if got := h.next(svc, c1, false, false); got != first {
				t.Errorf("affinity on again: %v, want %v", got, first)
			}
		}},
		{"entry of an endpoint no longer usable is not used", func(t *testing.T, h *harness) {
			a, b := ready("10.0.0.1", ""), ready("10.0.0.2", "")
			h.set(svcPort(svc, withAffinity(time.Hour)), a, b)
			pinned := h.next(svc, c1, false, false)
			other := a
			if pinned == a {
				other = b
			}
			h.set(svcPort(svc, withAffinity(time.Hour)), terminating(pinned.Addr.String(), ""), other)
			if got := h.next(svc, c1, false, false); got != other {
				t.Fatalf("pinned endpoint terminating while another is ready: %v, want %v", got, other)
			}
			// Only the terminating one is left: it is usable again (fallback).
			h.set(svcPort(svc, withAffinity(time.Hour)), terminating(pinned.Addr.String(), ""))
			if got := h.next(svc, c1, false, false); got.Addr != pinned.Addr {
				t.Errorf("fallback to terminating: %v, want %v", got, pinned.Addr)
			}
		}},
		{"affinity is per service port", func(t *testing.T, h *harness) {
			other := name("web", "https")
			h.set(svcPort(svc, withAffinity(time.Hour)), three...)
			h.set(svcPort(other, withAffinity(time.Hour)), three...)
			first := h.next(svc, c1, false, false)
			for range 4 {
				h.next(other, c1, false, true)
			}
			if got := h.next(svc, c1, false, false); got != first {
				t.Errorf("resets on another port changed this one: %v, want %v", got, first)
			}
		}},
		{"IPv4-mapped client is the same client", func(t *testing.T, h *harness) {
			h.set(svcPort(svc, withAffinity(time.Hour)), three...)
			first := h.next(svc, c1, false, false)
			for range 3 {
				if got := h.next(svc, "::ffff:"+c1, false, false); got != first {
					t.Fatalf("mapped client: %v, want %v", got, first)
				}
			}
		}},
		{"invalid client address gets round robin", func(t *testing.T, h *harness) {
			h.set(svcPort(svc, withAffinity(time.Hour)), three...)
			if err := checkRotation(h.picks(svc, "", false, 6), addrs(three)); err != nil {
				t.Error(err)
			}
		}},
		{"Local and cluster-wide choices are kept apart", func(t *testing.T, h *harness) {
			local := ready("10.0.0.1", thisNode)
			h.set(svcPort(svc, withAffinity(time.Hour), externalLocal), local, ready("10.0.0.2", "n2"), ready("10.0.0.3", "n3"))
			// A client whose cluster-wide choice is not the local endpoint.
			var client string
			var internal proxy.Endpoint
			for _, c := range []string{c1, c2, c3} {
				if internal = h.next(svc, c, false, false); internal != local {
					client = c
					break
				}
			}
			c1 := client
			for range 3 {
				if got := h.next(svc, c1, true, false); got != local {
					t.Fatalf("external (Local): %v, want %v", got, local)
				}
				if got := h.next(svc, c1, false, false); got != internal {
					t.Fatalf("ClusterIP: %v, want %v", got, internal)
				}
			}
		}},
		{"Sweep drops expired entries only", func(t *testing.T, h *harness) {
			h.set(svcPort(svc, withAffinity(10*time.Second)), three...)
			h.next(svc, c1, false, false)
			h.clock.Advance(5 * time.Second)
			e2 := h.next(svc, c2, false, false)
			h.clock.Advance(5 * time.Second) // c1 idle 10s: expired; c2 idle 5s
			h.lb.Sweep()
			if total, toE2 := h.affinityEntries(svc, e2.Addr); total != 1 || toE2 != 1 {
				t.Fatalf("after Sweep: %d entries (%d to c2's endpoint), want only c2's", total, toE2)
			}
			h.clock.Advance(5 * time.Second)
			h.lb.Sweep()
			if total, _ := h.affinityEntries(svc, netip.AddrPort{}); total != 0 {
				t.Errorf("after second Sweep: %d entries, want 0", total)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.run(t, newHarness(t, thisNode, 5))
		})
	}
}

// TestTrafficPolicies checks Next and Usable together: Next must rotate over exactly the
// endpoints Usable returns.
func TestTrafficPolicies(t *testing.T) {
	svc := name("web", "http")
	l1, l2 := "10.0.0.1", "10.0.0.2" // on thisNode
	r1, r2 := "10.0.1.1", "10.0.1.2" // elsewhere
	tests := []struct {
		name     string
		nodeName string // RoundRobin's node; thisNode unless set to "-" (empty)
		spOpts   []func(*proxy.ServicePort)
		eps      []proxy.Endpoint
		external bool
		want     []string // usable addresses, in eps order
		wantErr  error
	}{
		{
			name: "ready only when some are ready",
			eps:  []proxy.Endpoint{ready(l1, thisNode), terminating(l2, thisNode), ready(r1, "n2"), notReady(r2, "n2")},
			want: []string{l1, r1},
		},
		{
			name: "serving terminating when none is ready",
			eps:  []proxy.Endpoint{terminating(l1, thisNode), stopping(l2, thisNode), terminating(r1, "n2"), notReady(r2, "n2")},
			want: []string{l1, r1},
		},
		{
			name: "serving but not terminating is no fallback",
			eps:  []proxy.Endpoint{{Addr: ap(l1), Serving: true, NodeName: thisNode}, terminating(r1, "n2")},
			want: []string{r1},
		},
		{
			name:    "nothing serving",
			eps:     []proxy.Endpoint{stopping(l1, thisNode), notReady(r1, "n2")},
			wantErr: ErrNoEndpoints,
		},
		{
			name:     "external Local: local endpoints only",
			spOpts:   []func(*proxy.ServicePort){externalLocal},
			eps:      []proxy.Endpoint{ready(l1, thisNode), ready(l2, thisNode), ready(r1, "n2")},
			external: true,
			want:     []string{l1, l2},
		},
		{
			name:     "external Local: local terminating before remote ready",
			spOpts:   []func(*proxy.ServicePort){externalLocal},
			eps:      []proxy.Endpoint{terminating(l1, thisNode), stopping(l2, thisNode), ready(r1, "n2")},
			external: true,
			want:     []string{l1},
		},
		{
			name:     "external Local: no local endpoint",
			spOpts:   []func(*proxy.ServicePort){externalLocal},
			eps:      []proxy.Endpoint{ready(r1, "n2"), ready(r2, "n3")},
			external: true,
			wantErr:  ErrNoLocalEndpoints,
		},
		{
			name:     "external Local: local endpoint not serving",
			spOpts:   []func(*proxy.ServicePort){externalLocal},
			eps:      []proxy.Endpoint{notReady(l1, thisNode), ready(r1, "n2")},
			external: true,
			wantErr:  ErrNoLocalEndpoints,
		},
		{
			name:     "external Local: no endpoints",
			spOpts:   []func(*proxy.ServicePort){externalLocal},
			external: true,
			wantErr:  ErrNoEndpoints,
		},
		{
			name:     "external Local: no usable endpoints anywhere",
			spOpts:   []func(*proxy.ServicePort){externalLocal},
			eps:      []proxy.Endpoint{notReady(l1, thisNode), stopping(r1, "n2")},
			external: true,
			wantErr:  ErrNoEndpoints,
		},
		{
			name:   "external Local: ClusterIP traffic not restricted",
			spOpts: []func(*proxy.ServicePort){externalLocal},
			eps:    []proxy.Endpoint{ready(l1, thisNode), ready(r1, "n2"), ready(r2, "n3")},
			want:   []string{l1, r1, r2},
		},
		{
			name:   "internal Local: local endpoints only",
			spOpts: []func(*proxy.ServicePort){internalLocal},
			eps:    []proxy.Endpoint{ready(l1, thisNode), ready(r1, "n2"), terminating(l2, thisNode)},
			want:   []string{l1},
		},
		{
			name:   "internal Local: local terminating fallback",
			spOpts: []func(*proxy.ServicePort){internalLocal},
			eps:    []proxy.Endpoint{terminating(l1, thisNode), terminating(l2, thisNode), ready(r1, "n2")},
			want:   []string{l1, l2},
		},
		{
			name:    "internal Local: no local endpoint",
			spOpts:  []func(*proxy.ServicePort){internalLocal},
			eps:     []proxy.Endpoint{ready(r1, "n2")},
			wantErr: ErrNoLocalEndpoints,
		},
		{
			name:    "internal Local: no endpoints",
			spOpts:  []func(*proxy.ServicePort){internalLocal},
			wantErr: ErrNoEndpoints,
		},
		{
			name:     "internal Local: external traffic not restricted",
			spOpts:   []func(*proxy.ServicePort){internalLocal},
			eps:      []proxy.Endpoint{ready(l1, thisNode), ready(r1, "n2")},
			external: true,
			want:     []string{l1, r1},
		},
		{
			name:     "both Local",
			spOpts:   []func(*proxy.ServicePort){internalLocal, externalLocal},
			eps:      []proxy.Endpoint{ready(r1, "n2"), ready(l2, thisNode)},
			external: true,
			want:     []string{l2},
		},
		{
			name:     "unknown node name: nothing is local",
			nodeName: "-",
			spOpts:   []func(*proxy.ServicePort){externalLocal},
			eps:      []proxy.Endpoint{ready(l1, ""), ready(r1, "n2")},
			external: true,
			wantErr:  ErrNoLocalEndpoints,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			node := thisNode
			if tt.nodeName == "-" {
				node = ""
			}
			sp := svcPort(svc, tt.spOpts...)
			var want []netip.AddrPort
			for _, s := range tt.want {
				want = append(want, ap(s))
			}
			if got := addrs(Usable(sp, tt.eps, Node{Name: node}, tt.external)); !slices.Equal(got, want) {
				t.Errorf("Usable = %v, want %v", got, want)
			}
			for _, affinity := range []bool{false, true} {
				h := newHarness(t, node, 6)
				if affinity {
					sp = svcPort(svc, append(slices.Clone(tt.spOpts), withAffinity(time.Hour))...)
				}
				h.set(sp, tt.eps...)
				if tt.wantErr != nil {
					_, err := h.lb.Next(svc, clientAddr("192.168.1.1"), tt.external, false)
					if !errors.Is(err, tt.wantErr) {
						t.Errorf("affinity=%v: Next error = %v, want %v", affinity, err, tt.wantErr)
					}
					continue
				}
				var picks []netip.AddrPort
				for i := range 3 * len(want) {
					// distinct clients, so affinity does not pin them all to one endpoint
					client := netip.AddrFrom4([4]byte{192, 168, 2, byte(i)}).String()
					picks = append(picks, h.next(svc, client, tt.external, false).Addr)
				}
				if err := checkRotation(picks, want); err != nil {
					t.Errorf("affinity=%v: %v", affinity, err)
				}
			}
		})
	}
}

// TestConcurrentUse runs Next from many goroutines while the service port changes; run with
// -race. Every pick must be an endpoint of some version of the port, every error a sentinel.
func TestConcurrentUse(t *testing.T) {
	svc := name("web", "http")
	clock := newFakeClock()
	lb := New(Options{NodeName: thisNode, Now: clock.Now, Rand: rand.New(rand.NewPCG(7, 7))})
	all := map[netip.AddrPort]bool{}
	versions := make([][]proxy.Endpoint, 6)
	for v := range versions {
		for i := range v + 1 {
			e := ready(netip.AddrFrom4([4]byte{10, 0, byte(v), byte(i)}).String(), []string{thisNode, "n2"}[i%2])
			versions[v] = append(versions[v], e)
			all[e.Addr] = true
		}
	}
	lb.SetServicePort(svcPort(svc), versions[0])

	stop := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Go(func() {
			client := netip.AddrFrom4([4]byte{192, 168, 0, byte(g)})
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				ep, err := lb.Next(svc, client, g%2 == 0, i%7 == 0)
				switch {
				case err == nil:
					if !all[ep.Addr] {
						errs <- errors.New("unknown endpoint " + ep.String())
						return
					}
				case errors.Is(err, ErrUnknownServicePort), errors.Is(err, ErrNoLocalEndpoints), errors.Is(err, ErrNoEndpoints):
				default:
					errs <- err
					return
				}
			}
		})
	}
	for i := range 300 {
		opts := []func(*proxy.ServicePort){withAffinity(time.Duration(1+i%3) * time.Second)}
		if i%4 == 0 {
			opts = append(opts, externalLocal)
		}
		if i%5 == 0 {
			opts = opts[1:]
		}
		lb.SetServicePort(svcPort(svc, opts...), versions[i%len(versions)])
		clock.Advance(700 * time.Millisecond)
		lb.Sweep()
		if i%50 == 49 {
			lb.DeleteServicePort(svc)
		}
	}
	close(stop)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestAddressFamilies checks that the traffic of a dual-stack service keeps its address family,
// and falls back to the other family only when its own has no usable endpoint.
func TestAddressFamilies(t *testing.T) {
	svc := name("dual", "http")
	v4 := []proxy.Endpoint{ready("10.0.0.1", "n1"), ready("10.0.0.2", "n2")}
	v6 := []proxy.Endpoint{ready("[fd00::1]:8080", "n1"), ready("[fd00::2]:8080", "n2"), ready("[fd00::3]:8080", "n3")}
	all := append(slices.Clone(v4), v6...)
	clients := map[string][]proxy.Endpoint{
		"192.168.1.1":        v4,
		"::ffff:192.168.1.2": v4, // an IPv4 client of a dual-stack listener
		"fd01::1":            v6,
	}
	for _, affinity := range []bool{false, true} {
		t.Run(fmt.Sprintf("affinity=%v", affinity), func(t *testing.T) {
			h := newHarness(t, thisNode, 3)
			sp := svcPort(svc)
			if affinity {
				sp = svcPort(svc, withAffinity(time.Hour))
			}
			h.set(sp, all...)
			for client, want := range clients {
				for _, external := range []bool{false, true} {
					if !affinity {
						if err := checkRotation(h.picks(svc, client, external, 3*len(want)), addrs(want)); err != nil {
							t.Errorf("client %s external=%v: %v", client, external, err)
						}
						continue
					}
					first := h.next(svc, client, external, false).Addr
					if !slices.Contains(addrs(want), first) {
						t.Errorf("client %s: got %v, not of its family (%v)", client, first, addrs(want))
					}
					if again := h.next(svc, client, external, false).Addr; again != first {
						t.Errorf("client %s: affinity broken: %v then %v", client, first, again)
					}
					if other := h.next(svc, client, external, true).Addr; other == first || !slices.Contains(addrs(want), other) {
						t.Errorf("client %s: after a failed dial of %v got %v, want another of %v", client, first, other, addrs(want))
					}
				}
			}
			// The IPv4 endpoints stop being ready: IPv4 clients are bridged to IPv6 ones.
			h.set(sp, append([]proxy.Endpoint{notReady("10.0.0.1", "n1"), notReady("10.0.0.2", "n2")}, v6...)...)
			if got := h.next(svc, "192.168.1.1", false, false).Addr; !slices.Contains(addrs(v6), got) {
				t.Errorf("IPv4 client with no IPv4 endpoint left: got %v, want one of %v", got, addrs(v6))
			}
		})
	}
}

// TestEndpointSetFirstIndex checks that an endpoint set finds the first position of every
// address, and none for an absent one, by scanning (small lists) and through its index (longer
// ones) alike, with repeated addresses in both.
func TestEndpointSetFirstIndex(t *testing.T) {
	for _, n := range []int{1, indexedPool, indexedPool + 1, 3 * indexedPool} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			var eps []proxy.Endpoint
			for i := range n {
				eps = append(eps, ready(fmt.Sprintf("10.0.%d.%d", i/2/250, i/2%250+1), "n1")) // each address twice in a row
			}
			s := newEndpointSet(eps)
			if indexed := s.idx != nil; indexed != (n > indexedPool) {
				t.Fatalf("indexed = %v with %d endpoints", indexed, n)
			}
			for i, e := range eps {
				got, ok := s.index(e.Addr)
				if want := i - i%2; !ok || got != want {
					t.Errorf("index(%v) = %d, %v; want %d, true", e.Addr, got, ok, want)
				}
			}
			if got, ok := s.index(netip.MustParseAddrPort("192.0.2.1:80")); ok {
				t.Errorf("absent address found at %d", got)
			}
		})
	}
}

// TestOrderSharesTheEndpointList: a port of one endpoint (and any port whose rotation order is
// the list given, as given) keeps that list, not a copy of it.
func TestOrderSharesTheEndpointList(t *testing.T) {
	lb := New(Options{NodeName: thisNode, Rand: rand.New(rand.NewPCG(1, 1))})
	svc := name("web", "http")
	eps := []proxy.Endpoint{ready("10.0.0.1", "n2")}
	lb.SetServicePort(svcPort(svc), eps)
	order := lb.ports[svc].snap.Load().pools[poolCluster].eps
	if len(order) != 1 || &order[0] != &eps[0] {
		t.Fatalf("the rotation order of one endpoint is a copy of the list given")
	}
	// The same endpoints again, in the order kept: still that list.
	lb.SetServicePort(svcPort(svc), eps)
	if order := lb.ports[svc].snap.Load().pools[poolCluster].eps; &order[0] != &eps[0] {
		t.Fatalf("the rotation order of an unchanged endpoint is a copy of the list given")
	}
	if got, err := lb.Next(svc, netip.MustParseAddr("192.168.0.1"), false, false); err != nil || got.Addr != eps[0].Addr {
		t.Fatalf("Next: %v, %v", got, err)
	}
}

// TestPoolsShareTheEndpointList: however a port's endpoints are shuffled and narrowed (a
// terminating endpoint, two address families, a Local policy), every pool holds the list given to
// SetServicePort, not copies of its endpoints; a new list of equal endpoints (as each slice update
// brings) takes the old one's place in every pool, and the rotation carries on as if the list
// had not changed.
func TestPoolsShareTheEndpointList(t *testing.T) {
	var eps []proxy.Endpoint
	for i := range 12 {
		eps = append(eps, ready(fmt.Sprintf("10.0.0.%d", i+1), []string{thisNode, "n2"}[i%2]))
	}
	eps = append(eps, ready("[fd00::1]:8080", "n2"), ready("[fd00::2]:8080", thisNode))
	eps[0] = terminating("10.0.0.1", thisNode)
	sp := svcPort(name("web", "http"), internalLocal)
	client := netip.MustParseAddr("192.168.0.1")

	lb := New(Options{NodeName: thisNode, Rand: rand.New(rand.NewPCG(1, 1))})
	twin := New(Options{NodeName: thisNode, Rand: rand.New(rand.NewPCG(1, 1))})
	lb.SetServicePort(sp, eps)
	twin.SetServicePort(sp, eps)
	checkPools := func(list []proxy.Endpoint) {
		t.Helper()
		var pools []*pool
		for _, pl := range lb.ports[sp.Name].snap.Load().pools {
			pools = append(pools, pl)
			if fs := pl.families(); fs != nil {
				pools = append(pools, fs[0], fs[1])
			}
		}
		for i, pl := range pools {
			if pl.len() == 0 {
				t.Fatalf("pool %d is empty", i)
			}
			if &pl.eps[0] != &list[0] {
				t.Errorf("pool %d holds a copy of the endpoints, not the list given", i)
			}
		}
	}
	checkPools(eps)
	for range 5 {
		a, errA := lb.Next(sp.Name, client, true, false)
		b, errB := twin.Next(sp.Name, client, true, false)
		if errA != nil || errB != nil || a != b {
			t.Fatalf("Next: %v, %v and %v, %v", a, errA, b, errB)
		}
	}
	again := slices.Clone(eps)
	lb.SetServicePort(sp, again)
	checkPools(again)
	for _, external := range []bool{true, false, true, false, false} {
		a, errA := lb.Next(sp.Name, client, external, false)
		b, errB := twin.Next(sp.Name, client, external, false)
		if errA != nil || errB != nil || a != b {
			t.Fatalf("Next after a new list of the same endpoints: %v, %v; unchanged: %v, %v", a, errA, b, errB)
		}
	}
}

// TestSplitFamiliesOfOneFamilyAllocatesNothing: a pool of one address family (almost every pool)
// is not split, and finding that out allocates nothing: it runs for each pool of each update.
func TestSplitFamiliesOfOneFamilyAllocatesNothing(t *testing.T) {
	var eps []proxy.Endpoint
	for i := range 10 {
		eps = append(eps, ready(fmt.Sprintf("10.0.0.%d", i+1), "n2"))
	}
	pl := newPool(rotation{eps: eps})
	if n := testing.AllocsPerRun(100, func() { pl.splitFamilies(nil) }); n != 0 {
		t.Errorf("splitFamilies of a pool of one family: %v allocations, want 0", n)
	}
	if pl.families() != nil {
		t.Errorf("a pool of one family was split")
	}
	dual := newPool(rotation{eps: append(slices.Clone(eps), ready("[fd00::1]:8080", "n2"))})
	dual.splitFamilies(nil)
	if fs := dual.families(); fs == nil || fs[familyIPv4].len() != 10 || fs[familyIPv6].len() != 1 {
		t.Errorf("a dual-stack pool was not split 10 + 1: %v", fs)
	}
}
