package main

import (
	"errors"
	"net/netip"
	"strings"
	"testing"
)

var pool = netip.MustParsePrefix("10.77.1.0/24")

func addr(s string) netip.Addr { return netip.MustParseAddr(s) }

func newTestAllocator(t *testing.T, p netip.Prefix) *allocator {
	t.Helper()
	a, err := newAllocator(p)
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// assign is Assign that fails the test on error.
func assign(t *testing.T, a *allocator, key string, requested netip.Addr, current ...netip.Addr) netip.Addr {
	t.Helper()
	ip, err := a.Assign(key, requested, current)
	if err != nil {
		t.Fatalf("Assign(%s, %v, %v): %v", key, requested, current, err)
	}
	return ip
}

func TestAllocatorLowestFreeAndStable(t *testing.T) {
	a := newTestAllocator(t, pool)
	if got := assign(t, a, "ns/a", netip.Addr{}); got != addr("10.77.1.1") {
		t.Errorf("first address %v, want 10.77.1.1 (not the network address)", got)
	}
	if got := assign(t, a, "ns/b", netip.Addr{}); got != addr("10.77.1.2") {
		t.Errorf("second address %v, want 10.77.1.2", got)
	}
	// Asked again (every update of the Service), a Service keeps its address, whatever its
	// status shows.
	for range 3 {
		if got := assign(t, a, "ns/a", netip.Addr{}, addr("10.77.1.50")); got != addr("10.77.1.1") {
			t.Errorf("ns/a again: %v, want its 10.77.1.1", got)
		}
	}
	a.Release("ns/a")
	if got := a.Owner(addr("10.77.1.1")); got != "" {
		t.Errorf("10.77.1.1 owned by %q after its release", got)
	}
	if got := assign(t, a, "ns/c", netip.Addr{}); got != addr("10.77.1.1") {
		t.Errorf("after the release: %v, want the freed 10.77.1.1", got)
	}
	if got := assign(t, a, "ns/b", netip.Addr{}); got != addr("10.77.1.2") {
		t.Errorf("ns/b: %v, want its 10.77.1.2", got)
	}
}

func TestAllocatorRequested(t *testing.T) {
	a := newTestAllocator(t, pool)
	if got := assign(t, a, "ns/a", addr("10.77.1.10")); got != addr("10.77.1.10") {
		t.Fatalf("requested 10.77.1.10, got %v", got)
	}
	// Another Service asking for it gets an error, and ns/a keeps it.
	_, err := a.Assign("ns/b", addr("10.77.1.10"), nil)
	if err == nil || !strings.Contains(err.Error(), "ns/a") {
		t.Errorf("ns/b requesting ns/a's address: %v, want an error naming ns/a", err)
	}
	if got := a.Owner(addr("10.77.1.10")); got != "ns/a" {
		t.Errorf("10.77.1.10 owned by %q, want ns/a", got)
	}
	// A new request moves the Service, freeing its old address.
	if got := assign(t, a, "ns/a", addr("10.77.1.20")); got != addr("10.77.1.20") {
		t.Errorf("ns/a moved to %v, want 10.77.1.20", got)
	}
	if got := a.Owner(addr("10.77.1.10")); got != "" {
		t.Errorf("10.77.1.10 still owned by %q after ns/a moved", got)
	}
	if got := assign(t, a, "ns/b", addr("10.77.1.10")); got != addr("10.77.1.10") {
		t.Errorf("ns/b: %v, want the freed 10.77.1.10", got)
	}
	// Outside the pool, or its network or broadcast address: refused.
	for _, bad := range []string{"10.77.2.1", "10.77.1.0", "10.77.1.255", "fd00::1"} {
		if ip, err := a.Assign("ns/c", addr(bad), nil); err == nil {
			t.Errorf("request of %s: got %v, want an error", bad, ip)
		}
	}
	if _, ok := a.Lookup("ns/c"); ok {
		t.Error("ns/c has an address after refused requests")
	}
}

func TestAllocatorAdoptsStatus(t *testing.T) {
	a := newTestAllocator(t, pool)
	// What the status shows is kept when free; an address that is not the pool's, or another
	// Service's, is not.
	if got := assign(t, a, "ns/a", netip.Addr{}, addr("10.77.1.42")); got != addr("10.77.1.42") {
		t.Errorf("ns/a: %v, want the 10.77.1.42 its status shows", got)
	}
	if got := assign(t, a, "ns/b", netip.Addr{}, addr("10.77.1.42"), addr("192.0.2.1"), addr("10.77.1.43")); got != addr("10.77.1.43") {
		t.Errorf("ns/b: %v, want 10.77.1.43 (10.77.1.42 is ns/a's, 192.0.2.1 not the pool's)", got)
	}
	if got := assign(t, a, "ns/c", netip.Addr{}, addr("10.77.1.42")); got != addr("10.77.1.1") {
		t.Errorf("ns/c: %v, want the lowest free 10.77.1.1", got)
	}
}

func TestAllocatorNeverTwiceAndFull(t *testing.T) {
	a := newTestAllocator(t, netip.MustParsePrefix("10.77.1.0/29")) // .1 to .6
	seen := map[netip.Addr]string{}
	for i := range 6 {
		k := "ns/" + string(rune('a'+i))
		ip := assign(t, a, k, netip.Addr{})
		if other, dup := seen[ip]; dup {
			t.Fatalf("%v given to %s and %s", ip, other, k)
		}
		seen[ip] = k
	}
	if _, dup := seen[addr("10.77.1.7")]; dup {
		t.Error("the broadcast address was handed out")
	}
	if ip, err := a.Assign("ns/z", netip.Addr{}, nil); !errors.Is(err, errPoolFull) {
		t.Errorf("seventh Service: %v, %v; want errPoolFull", ip, err)
	}
	a.Release("ns/c")
	if got := assign(t, a, "ns/z", netip.Addr{}); got != addr("10.77.1.3") {
		t.Errorf("after ns/c's release: %v, want its 10.77.1.3", got)
	}
}

func TestNewAllocatorRejects(t *testing.T) {
	for _, p := range []string{"10.77.1.0/31", "10.77.1.4/32", "fd00::/64"} {
		if _, err := newAllocator(netip.MustParsePrefix(p)); err == nil {
			t.Errorf("newAllocator(%s): no error", p)
		}
	}
}
