package proxy

import (
	"bytes"
	"fmt"
	"maps"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
)

func trackedSvc(name, ip string, ports ...int32) *v1.Service {
	s := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: name},
		Spec:       v1.ServiceSpec{ClusterIP: ip, Type: v1.ServiceTypeClusterIP},
	}
	for i, p := range ports {
		s.Spec.Ports = append(s.Spec.Ports, v1.ServicePort{Name: string(rune('a' + i)), Port: p, Protocol: v1.ProtocolTCP})
	}
	return s
}

func trackedSlice(name, service string, port int32, ips ...string) *discovery.EndpointSlice {
	s := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "ns", Name: name, Labels: map[string]string{discovery.LabelServiceName: service}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr.To("a"), Port: ptr.To(port)}},
	}
	for _, ip := range ips {
		s.Endpoints = append(s.Endpoints, discovery.Endpoint{Addresses: []string{ip}})
	}
	return s
}

var nsName = func(n string) types.NamespacedName { return types.NamespacedName{Namespace: "ns", Name: n} }

// TestServiceCoalescing is upstream's change-coalescing table: several events for one service
// between two drains become one change with the oldest previous and the newest current.
func TestServiceCoalescing(t *testing.T) {
	v1a := trackedSvc("s", "10.0.0.1", 80)
	v1b := trackedSvc("s", "10.0.0.1", 81)
	tests := []struct {
		name      string
		baseline  *v1.Service // applied before the events (drained)
		events    [][2]*v1.Service
		wantPrev  []int // ports of previous, nil = no previous
		wantCur   []int
		wantEmpty bool
	}{
		{name: "add", events: [][2]*v1.Service{{nil, v1a}}, wantCur: []int{80}},
		{name: "add+update", events: [][2]*v1.Service{{nil, v1a}, {v1a, v1b}}, wantCur: []int{81}},
		{name: "add+delete", events: [][2]*v1.Service{{nil, v1a}, {v1a, nil}}, wantEmpty: true},
		{name: "update+update", baseline: v1a, events: [][2]*v1.Service{{v1a, v1b}, {v1b, trackedSvc("s", "10.0.0.1", 82)}}, wantPrev: []int{80}, wantCur: []int{82}},
		{name: "update+update back", baseline: v1a, events: [][2]*v1.Service{{v1a, v1b}, {v1b, v1a}}, wantEmpty: true},
		{name: "update+delete", baseline: v1a, events: [][2]*v1.Service{{v1a, v1b}, {v1b, nil}}, wantPrev: []int{80}},
		{name: "delete+add", baseline: v1a, events: [][2]*v1.Service{{v1a, nil}, {nil, v1b}}, wantPrev: []int{80}, wantCur: []int{81}},
		{name: "no-op update", baseline: v1a, events: [][2]*v1.Service{{v1a, func() *v1.Service { s := v1a.DeepCopy(); s.Labels = map[string]string{"x": "y"}; return s }()}}, wantEmpty: true},
		{name: "clusterIP None removes", baseline: v1a, events: [][2]*v1.Service{{v1a, trackedSvc("s", "None", 80)}}, wantPrev: []int{80}},
		{name: "clusterIP empty removes", baseline: v1a, events: [][2]*v1.Service{{v1a, trackedSvc("s", "", 80)}}, wantPrev: []int{80}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			triggers := 0
			tr := NewTracker(TrackerOptions{OnChange: func() { triggers++ }})
			if tc.baseline != nil {
				tr.OnServiceUpdate(nil, tc.baseline)
				tr.Drain()
			}
			for _, ev := range tc.events {
				tr.OnServiceUpdate(ev[0], ev[1])
			}
			c := tr.Drain()
			if tc.wantEmpty {
				if !c.Empty() {
					t.Fatalf("want no change, got %+v", c.Services)
				}
				return
			}
			ch, ok := c.Services[nsName("s")]
			if !ok || len(c.Services) != 1 {
				t.Fatalf("want one change for ns/s, got %+v", c.Services)
			}
			checkPorts(t, "previous", ch.Previous, tc.wantPrev)
			checkPorts(t, "current", ch.Current, tc.wantCur)
			if len(c.Triggers) != 0 {
				t.Errorf("Service changes brought trigger times %v; kube-proxy takes them from EndpointSlices only", c.Triggers)
			}
			if triggers == 0 {
				t.Error("OnChange never called")
			}
			if again := tr.Drain(); !again.Empty() {
				t.Errorf("second Drain not empty: %+v", again)
			}
		})
	}
}

func checkPorts(t *testing.T, what string, got ServicePorts, want []int) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: got %d ports, want %v", what, len(got), want)
	}
	for i, p := range want {
		sp := got.Get(string(rune('a' + i)))
		if sp == nil || sp.Port != p {
			t.Fatalf("%s: port %d: got %+v, want %d", what, i, sp, p)
		}
	}
}

func TestEndpointsTracking(t *testing.T) {
	tr := NewTracker(TrackerOptions{})
	// Endpoints before the service: tracked on their own.
	s1 := trackedSlice("s-1", "s", 8080, "10.1.0.1")
	tr.OnEndpointSliceUpdate(nil, s1)
	c := tr.Drain()
	ch := c.Endpoints[nsName("s")]
	if ch.Previous != nil || len(ch.Current.Get("a")) != 1 || ch.Current.Get("a")[0].Addr.String() != "10.1.0.1:8080" {
		t.Fatalf("first slice: got %+v", ch)
	}

	// A second slice merges with the first.
	s2 := trackedSlice("s-2", "s", 8080, "10.1.0.2")
	tr.OnEndpointSliceUpdate(nil, s2)
	c = tr.Drain()
	if got := c.Endpoints[nsName("s")].Current.Get("a"); len(got) != 2 {
		t.Fatalf("two slices: got %v", got)
	}

	// Re-delivering the same slice is a no-op.
	tr.OnEndpointSliceUpdate(s2, s2.DeepCopy())
	if c = tr.Drain(); !c.Empty() {
		t.Fatalf("no-op slice update produced %+v", c)
	}

	// Moving a slice to another service removes it from the first.
	moved := s2.DeepCopy()
	moved.Labels[discovery.LabelServiceName] = "other"
	tr.OnEndpointSliceUpdate(s2, moved)
	c = tr.Drain()
	if got := c.Endpoints[nsName("s")].Current.Get("a"); len(got) != 1 {
		t.Errorf("after move, s: got %v", got)
	}
	if got := c.Endpoints[nsName("other")].Current.Get("a"); len(got) != 1 {
		t.Errorf("after move, other: got %v", got)
	}

	// Deleting the last slice leaves no endpoints.
	tr.OnEndpointSliceUpdate(s1, nil)
	c = tr.Drain()
	if ch := c.Endpoints[nsName("s")]; ch.Current != nil || ch.Previous == nil {
		t.Errorf("after delete: got %+v", ch)
	}
}

func TestInvalidObjectsReportedOnce(t *testing.T) {
	var buf bytes.Buffer
	tr := NewTracker(TrackerOptions{Log: zerolog.New(&buf)})
	bad := trackedSvc("bad", "10.0.0.9", 80)
	bad.Spec.ExternalIPs = []string{"not-an-ip"}
	tr.OnServiceUpdate(nil, bad)
	tr.OnServiceUpdate(bad, bad.DeepCopy())
	c := tr.Drain()
	if sp := c.Services[nsName("bad")].Current.Get("a"); sp == nil || len(sp.ExternalIPs) != 0 {
		t.Fatalf("valid part of the service not served: %+v", c.Services)
	}
	out := buf.String()
	if strings.Count(out, "spec.externalIPs[0]") != 1 || !strings.Contains(out, "Service ns/bad") {
		t.Errorf("want one report naming object and field, got %q", out)
	}

	orphan := trackedSlice("orphan", "x", 80, "10.1.0.1")
	delete(orphan.Labels, discovery.LabelServiceName)
	tr.OnEndpointSliceUpdate(nil, orphan)
	if !strings.Contains(buf.String(), "EndpointSlice ns/orphan") {
		t.Errorf("orphan slice not reported: %q", buf.String())
	}
}

// TestSourceSwitch feeds the tracker from one source, then replaces everything with another
// source's view (deleting the first's objects): only the real differences come out.
func TestSourceSwitch(t *testing.T) {
	tr := NewTracker(TrackerOptions{})
	a, b := trackedSvc("a", "10.0.0.1", 80), trackedSvc("b", "10.0.0.2", 80)
	tr.OnServiceUpdate(nil, a)
	tr.OnServiceUpdate(nil, b)
	tr.Drain()
	// The new source delivers a (unchanged) and c; b is gone.
	tr.OnServiceUpdate(a, nil)
	tr.OnServiceUpdate(b, nil)
	tr.OnServiceUpdate(nil, a.DeepCopy())
	tr.OnServiceUpdate(nil, trackedSvc("c", "10.0.0.3", 80))
	c := tr.Drain()
	if _, ok := c.Services[nsName("a")]; ok {
		t.Error("unchanged service a reported as changed")
	}
	if ch := c.Services[nsName("b")]; ch.Previous == nil || ch.Current != nil {
		t.Errorf("b: %+v", ch)
	}
	if ch := c.Services[nsName("c")]; ch.Previous != nil || ch.Current == nil {
		t.Errorf("c: %+v", ch)
	}
}

// TestNodeZone: the zone is handed out by the Drain after it changed, once; a change back to the
// zone already handed out before the Drain is no change.
func TestNodeZone(t *testing.T) {
	changes := 0
	tr := NewTracker(TrackerOptions{OnChange: func() { changes++ }})
	steps := []struct {
		name        string
		zones       []string // OnNodeTopology calls before the Drain
		wantChanges int      // OnChange calls they make
		wantChanged bool
		wantZone    string
	}{
		{name: "nothing yet"},
		{name: "first zone", zones: []string{"zone-a"}, wantChanges: 1, wantChanged: true, wantZone: "zone-a"},
		{name: "same zone again", zones: []string{"zone-a"}},
		{name: "changed twice", zones: []string{"zone-b", "zone-c"}, wantChanges: 2, wantChanged: true, wantZone: "zone-c"},
		{name: "changed and back", zones: []string{"zone-d", "zone-c"}, wantChanges: 1},
		{name: "label removed", zones: []string{""}, wantChanges: 1, wantChanged: true, wantZone: ""},
	}
	for _, st := range steps {
		changes = 0
		for _, z := range st.zones {
			tr.OnNodeTopology(z)
		}
		if changes != st.wantChanges {
			t.Errorf("%s: OnChange called %d times, want %d", st.name, changes, st.wantChanges)
		}
		c := tr.Drain()
		if c.ZoneChanged != st.wantChanged || c.Zone != st.wantZone || c.Empty() == st.wantChanged {
			t.Errorf("%s: Drain gave ZoneChanged %v Zone %q Empty %v, want %v %q", st.name, c.ZoneChanged, c.Zone, c.Empty(), st.wantChanged, st.wantZone)
		}
	}
}

// TestWithSlice: random adds, updates and deletes of a service's slices keep the list sorted by
// name and equal to a map model, and never change a list handed out before.
func TestWithSlice(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	model := map[string]SliceEndpoints{}
	var list []SliceEndpoints
	for i := range 2000 {
		name := fmt.Sprintf("s%d", r.IntN(6))
		var cur *SliceEndpoints
		if r.IntN(3) > 0 {
			se := FromSlice(trackedSlice(name, "svc", 80, fmt.Sprintf("10.0.0.%d", i%250+1)))
			cur = &se
			model[name] = se
		} else {
			delete(model, name)
		}
		before := slices.Clone(list)
		next := withSlice(list, name, cur)
		if !reflect.DeepEqual(list, before) {
			t.Fatalf("step %d: the previous list was changed in place", i)
		}
		want := slices.SortedFunc(maps.Values(model), func(a, b SliceEndpoints) int { return strings.Compare(a.Name, b.Name) })
		if len(want) == 0 {
			want = nil
		}
		if len(next) == 0 {
			next = nil
		}
		if !reflect.DeepEqual(next, want) {
			t.Fatalf("step %d (%s, delete %v): got %d slices, want %d", i, name, cur == nil, len(next), len(want))
		}
		list = next
	}
}

// TestPortsAndEndpointsSortedByName: a service's ports and endpoints are handed out sorted by
// port name whatever the order of the spec and the slice, Get finds each, and a port whose
// endpoints are all invalid is left out.
func TestPortsAndEndpointsSortedByName(t *testing.T) {
	tr := NewTracker(TrackerOptions{})
	svc := trackedSvc("s", "10.0.0.1", 81, 80)
	svc.Spec.Ports[0].Name, svc.Spec.Ports[1].Name = "z", "a"
	tr.OnServiceUpdate(nil, svc)
	sl := trackedSlice("s-1", "s", 8080, "10.1.0.1")
	sl.Ports = append(sl.Ports, discovery.EndpointPort{Name: ptr.To("a"), Port: ptr.To[int32](8081)}, discovery.EndpointPort{Name: ptr.To("m"), Port: ptr.To[int32](0)})
	sl.Ports[0].Name = ptr.To("z")
	tr.OnEndpointSliceUpdate(nil, sl)
	c := tr.Drain()
	ports := c.Services[nsName("s")].Current
	if len(ports) != 2 || ports[0].Name.Port != "a" || ports[1].Name.Port != "z" || ports.Get("z").Port != 81 || ports.Get("m") != nil {
		t.Fatalf("ports: %v", ports)
	}
	eps := c.Endpoints[nsName("s")].Current
	if len(eps) != 2 || eps[0].Port != "a" || eps[1].Port != "z" || eps.Get("a")[0].Addr.Port() != 8081 || eps.Get("m") != nil {
		t.Fatalf("endpoints: %+v", eps)
	}
}

// AwaitsFirstSlices is true exactly while the pending changes are new Services without any
// EndpointSlice.
func TestAwaitsFirstSlices(t *testing.T) {
	tr := NewTracker(TrackerOptions{})
	check := func(step string, want bool) {
		t.Helper()
		if got := tr.AwaitsFirstSlices(); got != want {
			t.Errorf("%s: AwaitsFirstSlices() = %v, want %v", step, got, want)
		}
	}
	check("nothing pending", false)
	a := trackedSvc("a", "10.0.0.1", 80)
	tr.OnServiceUpdate(nil, a)
	check("a new Service", true)
	tr.OnServiceUpdate(nil, trackedSvc("b", "10.0.0.2", 80))
	check("two new Services", true)
	tr.OnEndpointSliceUpdate(nil, trackedSlice("a-1", "a", 8080, "10.1.0.1"))
	check("a's slice arrived", false)
	tr.Drain()
	check("drained", false)

	tr.OnServiceUpdate(a, trackedSvc("a", "10.0.0.1", 81))
	check("a changed Service (not new)", false)
	tr.Drain()
	tr.OnServiceUpdate(nil, trackedSvc("c", "10.0.0.3", 80))
	tr.OnServiceUpdate(trackedSvc("b", "10.0.0.2", 80), nil)
	check("a new Service and a deleted one", false)
	tr.Drain()

	// A slice that came (and was drained) before its Service: nothing to wait for.
	tr.OnEndpointSliceUpdate(nil, trackedSlice("d-1", "d", 8080, "10.1.0.4"))
	tr.Drain()
	tr.OnServiceUpdate(nil, trackedSvc("d", "10.0.0.4", 80))
	check("a new Service whose slice is known", false)
	tr.Drain()

	tr.OnNodeTopology("zone-a")
	tr.OnServiceUpdate(nil, trackedSvc("e", "10.0.0.5", 80))
	check("a new Service and a zone change", false)
	tr.Drain()

	for i := range awaitMax + 1 {
		tr.OnServiceUpdate(nil, trackedSvc(fmt.Sprintf("many-%d", i), fmt.Sprintf("10.0.1.%d", i), 80))
	}
	check("more new Services than awaitMax", false)
}

// TestTriggerTimes pins the start of the network programming latency to kube-proxy's definition:
// the last-change-trigger-time annotation of an EndpointSlice whose contribution changed, none
// without a valid one, none from before the Tracker started, none from Services, and a deleted
// slice drops its service's pending ones.
func TestTriggerTimes(t *testing.T) {
	start := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return start.Add(time.Duration(ms) * time.Millisecond) }
	annotated := func(s *discovery.EndpointSlice, v string) *discovery.EndpointSlice {
		s = s.DeepCopy()
		s.Annotations = map[string]string{v1.EndpointsLastChangeTriggerTime: v}
		return s
	}
	stamp := func(ms int) string { return at(ms).Format(time.RFC3339Nano) }
	a1 := trackedSlice("s-1", "s", 80, "10.1.0.1")
	a2 := trackedSlice("s-1", "s", 80, "10.1.0.1", "10.1.0.2")
	b1 := trackedSlice("s-2", "s", 80, "10.1.0.3")
	v6 := trackedSlice("s-6", "s", 80, "fd00::1")
	v6.AddressType = discovery.AddressTypeIPv6
	v4 := func(ms int) TriggerTime { return TriggerTime{Family: v1.IPv4Protocol, At: at(ms)} }
	tests := []struct {
		name     string
		baseline []*discovery.EndpointSlice // applied and drained first
		events   [][2]*discovery.EndpointSlice
		want     []TriggerTime
	}{
		{name: "new slice", events: [][2]*discovery.EndpointSlice{{nil, annotated(a1, stamp(10))}}, want: []TriggerTime{v4(10)}},
		{name: "update", baseline: []*discovery.EndpointSlice{a1},
			events: [][2]*discovery.EndpointSlice{{a1, annotated(a2, stamp(20))}}, want: []TriggerTime{v4(20)}},
		{name: "every change of a batch", baseline: []*discovery.EndpointSlice{a1}, events: [][2]*discovery.EndpointSlice{
			{a1, annotated(a2, stamp(20))}, {a2, annotated(a1, stamp(30))}, {nil, annotated(b1, stamp(40))}},
			want: []TriggerTime{v4(20), v4(30), v4(40)}},
		{name: "IPv6 slice", events: [][2]*discovery.EndpointSlice{{nil, annotated(v6, stamp(10))}},
			want: []TriggerTime{{Family: v1.IPv6Protocol, At: at(10)}}},
		{name: "no annotation", events: [][2]*discovery.EndpointSlice{{nil, a1}}},
		{name: "invalid annotation", events: [][2]*discovery.EndpointSlice{{nil, annotated(a1, "yesterday")}}},
		{name: "before the tracker started", events: [][2]*discovery.EndpointSlice{{nil, annotated(a1, stamp(-1))}}},
		{name: "same endpoints, new annotation", baseline: []*discovery.EndpointSlice{a1},
			events: [][2]*discovery.EndpointSlice{{a1, annotated(a1, stamp(10))}}},
		{name: "deleted slice drops the service's pending times", baseline: []*discovery.EndpointSlice{a1, b1},
			events: [][2]*discovery.EndpointSlice{{a1, annotated(a2, stamp(20))}, {b1, nil}}},
		{name: "deletion drops only its service's", events: [][2]*discovery.EndpointSlice{
			{nil, annotated(a1, stamp(10))}, {nil, annotated(trackedSlice("o-1", "other", 80, "10.2.0.1"), stamp(11))},
			{annotated(a1, stamp(10)), nil}}, want: []TriggerTime{v4(11)}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tr := NewTracker(TrackerOptions{Now: func() time.Time { return start }})
			tr.OnServiceUpdate(nil, trackedSvc("s", "10.0.0.1", 80))
			for _, s := range tc.baseline {
				tr.OnEndpointSliceUpdate(nil, s)
			}
			if c := tr.Drain(); len(c.Triggers) != 0 {
				t.Fatalf("baseline without annotations brought %v", c.Triggers)
			}
			for _, ev := range tc.events {
				tr.OnEndpointSliceUpdate(ev[0], ev[1])
			}
			got := tr.Drain().Triggers
			slices.SortFunc(got, func(a, b TriggerTime) int { return a.At.Compare(b.At) })
			if !slices.Equal(got, tc.want) {
				t.Errorf("trigger times %v, want %v", got, tc.want)
			}
			if again := tr.Drain().Triggers; len(again) != 0 {
				t.Errorf("second Drain brought %v again", again)
			}
		})
	}
}
