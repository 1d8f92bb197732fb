package proxy

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"runtime"
	"slices"
	"testing"
	"weak"

	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
)

// referenceEndpoints is the merge of a service's slices as a reader of the API documents it:
// every port of every slice in order, every address of every endpoint in order, an address
// listed twice for one port once (its first ready copy, else its first), each port's list sorted
// by address. Invalid addresses and ports are left out.
func referenceEndpoints(list []*discovery.EndpointSlice) map[string][]Endpoint {
	out := map[string][]Endpoint{}
	for _, s := range list {
		if s.AddressType == discovery.AddressTypeFQDN {
			continue
		}
		for _, p := range s.Ports {
			if p.Port == nil || *p.Port < 1 || *p.Port > 65535 {
				continue
			}
			name := ptr.Deref(p.Name, "")
			for _, e := range s.Endpoints {
				ready := ptr.Deref(e.Conditions.Ready, true)
				for _, a := range e.Addresses {
					ip, err := netip.ParseAddr(a)
					if err != nil {
						continue
					}
					ep := Endpoint{Addr: netip.AddrPortFrom(ip, uint16(*p.Port)), Ready: ready,
						Serving: ptr.Deref(e.Conditions.Serving, ready), Terminating: ptr.Deref(e.Conditions.Terminating, false),
						NodeName: ptr.Deref(e.NodeName, "")}
					i := slices.IndexFunc(out[name], func(x Endpoint) bool { return x.Addr == ep.Addr })
					switch {
					case i < 0:
						out[name] = append(out[name], ep)
					case !out[name][i].Ready && ready:
						out[name][i] = ep
					}
				}
			}
		}
	}
	for _, eps := range out {
		slices.SortFunc(eps, func(a, b Endpoint) int { return a.Addr.Compare(b.Addr) })
	}
	return out
}

// TestMergeSlicesMatchesReference: random slices of one service (shared and repeated addresses,
// ready or not, several ports, some past the length from which a slice is indexed) merge, slice
// by slice through FromSlice and MergeSlices, into what the reference merge gives.
func TestMergeSlicesMatchesReference(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for round := range 500 {
		var list []*discovery.EndpointSlice
		for i := range 1 + r.IntN(4) {
			s := &discovery.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: fmt.Sprintf("web-%d", i)},
				AddressType: discovery.AddressTypeIPv4}
			for range 1 + r.IntN(2) {
				s.Ports = append(s.Ports, discovery.EndpointPort{Name: ptr.To([]string{"a", "b"}[r.IntN(2)]), Port: ptr.To(int32(8080 + r.IntN(2)))})
			}
			for range r.IntN(40) {
				e := discovery.Endpoint{Addresses: []string{fmt.Sprintf("10.0.0.%d", 1+r.IntN(30))}}
				if r.IntN(2) == 0 {
					e.Conditions.Ready = ptr.To(r.IntN(2) == 0)
				}
				if r.IntN(3) == 0 {
					e.NodeName = ptr.To(fmt.Sprintf("node%d", r.IntN(3)))
				}
				s.Endpoints = append(s.Endpoints, e)
			}
			list = append(list, s)
		}
		got, err := endpointsFromSlices(types.NamespacedName{Namespace: "ns", Name: "web"}, list)
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		want := referenceEndpoints(list)
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("round %d: got %v\nwant %v", round, got, want)
		}
	}
}

// TestMergeSlicesSharesOneSlicesLists: a port only one slice has keeps that slice's list (no
// second copy of a service's endpoints), and nothing is changed in place.
func TestMergeSlicesSharesOneSlicesLists(t *testing.T) {
	a := FromSlice(trackedSlice("web-1", "web", 80, "10.0.0.2", "10.0.0.1"))
	b := trackedSlice("web-2", "web", 80, "10.0.0.1", "10.0.0.3")
	b.Ports[0].Name = ptr.To("b")
	bs := FromSlice(b)
	aBefore := slices.Clone(a.Ports[0].Endpoints)
	for _, list := range [][]SliceEndpoints{{a}, {a, bs}} {
		got, err := MergeSlices(list)
		if err != nil {
			t.Fatal(err)
		}
		if eps := got.Get("a"); len(eps) != 2 || &eps[0] != &a.Ports[0].Endpoints[0] {
			t.Fatalf("%d slices: port a is %v, not slice web-1's list", len(list), eps)
		}
	}
	if !slices.Equal(a.Ports[0].Endpoints, aBefore) || aBefore[0].Addr.Addr().String() != "10.0.0.1" {
		t.Fatalf("slice web-1's list changed or unsorted: %v", a.Ports[0].Endpoints)
	}
}

// TestTrackerKeepsNoSlice: the tracker keeps what a slice contributes, not the slice, so that a
// source may let its objects go once delivered (the manifests source does: a decoded
// EndpointSlice is ~1 KB, its endpoints here a tenth of that).
func TestTrackerKeepsNoSlice(t *testing.T) {
	tr := NewTracker(TrackerOptions{})
	sl := trackedSlice("s-1", "s", 8080, "10.1.0.1")
	w := weak.Make(sl)
	tr.OnEndpointSliceUpdate(nil, sl)
	sl = nil
	runtime.GC()
	if w.Value() != nil {
		t.Fatal("the tracker still holds the EndpointSlice it was given")
	}
	c := tr.Drain()
	if eps := c.Endpoints[nsName("s")].Current.Get("a"); len(eps) != 1 || eps[0].Addr != netip.MustParseAddrPort("10.1.0.1:8080") {
		t.Fatalf("endpoints after the slice was collected: %+v", c.Endpoints)
	}
	// A second slice of the service merges with what the first contributed.
	tr.OnEndpointSliceUpdate(nil, trackedSlice("s-2", "s", 8080, "10.1.0.2"))
	c = tr.Drain()
	if eps := c.Endpoints[nsName("s")].Current.Get("a"); len(eps) != 2 {
		t.Fatalf("endpoints of two slices: %+v", eps)
	}
}

// endpointsFromSlices merges the EndpointSlices of one service into Endpoints per port name, as
// the Tracker does (FromSlice per slice, then MergeSlices): what the tests check of the
// conversion. svc names the service (unused by the conversion).
func endpointsFromSlices(svc types.NamespacedName, slices []*discovery.EndpointSlice) (map[string][]Endpoint, error) {
	each := make([]SliceEndpoints, 0, len(slices))
	for _, s := range slices {
		if s != nil {
			each = append(each, FromSlice(s))
		}
	}
	eps, err := MergeSlices(each)
	out := make(map[string][]Endpoint, len(eps))
	for _, pe := range eps {
		out[pe.Port] = pe.Endpoints
	}
	_ = svc
	return out, err
}

// TestFromSliceAllocations: reading a valid slice of one port (the common case, once per
// EndpointSlice update) allocates its endpoint list and its list of ports, nothing more.
func TestFromSliceAllocations(t *testing.T) {
	s := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "default", Name: "web-1", Labels: map[string]string{discovery.LabelServiceName: "web"}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To[int32](8080)}},
	}
	for i := range 10 {
		s.Endpoints = append(s.Endpoints, discovery.Endpoint{Addresses: []string{fmt.Sprintf("10.0.0.%d", 10-i)},
			Conditions: discovery.EndpointConditions{Ready: ptr.To(i != 3), Terminating: ptr.To(i == 3)}})
	}
	se := FromSlice(s)
	if se.Err != nil || len(se.Ports) != 1 || len(se.Ports[0].Endpoints) != 10 {
		t.Fatalf("FromSlice: %+v", se)
	}
	if n := testing.AllocsPerRun(50, func() { FromSlice(s) }); n > 2 {
		t.Errorf("FromSlice of one port: %v allocations, want at most 2 (the endpoints, the ports)", n)
	}
}
