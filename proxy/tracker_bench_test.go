package proxy

import (
	"fmt"
	"net/netip"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// trackerObjects returns n services with one TCP port and n slices of one endpoint each.
func trackerObjects(n int) ([]*v1.Service, []*discovery.EndpointSlice) {
	svcs := make([]*v1.Service, n)
	slices := make([]*discovery.EndpointSlice, n)
	base := netip.MustParseAddr("10.96.0.0")
	for i := range n {
		ip := base
		for range i + 1 {
			ip = ip.Next()
		}
		name := fmt.Sprintf("s%d", i)
		svcs[i] = trackedSvc(name, ip.String(), 80)
		slices[i] = trackedSlice(name+"-1", name, 8080, "10.1.0.1")
	}
	return svcs, slices
}

// BenchmarkTrackerInitial is the cost of the tracker taking a source's initial state of 10,000
// services and their EndpointSlices, and of the Drain that hands it to the proxier.
func BenchmarkTrackerInitial(b *testing.B) {
	svcs, slices := trackerObjects(10000)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t := NewTracker(TrackerOptions{})
		for j := range svcs {
			t.OnServiceUpdate(nil, svcs[j])
			t.OnEndpointSliceUpdate(nil, slices[j])
		}
		if c := t.Drain(); len(c.Services) != len(svcs) || len(c.Endpoints) != len(slices) {
			b.Fatalf("%d services and %d endpoints drained", len(c.Services), len(c.Endpoints))
		}
	}
}
