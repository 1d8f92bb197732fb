package proxy

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/source"
)

// ServicePorts is a service's ports, sorted by port name (unique within a service). A sorted
// slice rather than a map by name: a service has one or a few ports, and a Go map costs a few
// hundred bytes even for one entry, held for every service of the node.
type ServicePorts []*ServicePort

// Get returns the port named port, nil when there is none.
func (ps ServicePorts) Get(port string) *ServicePort {
	for _, sp := range ps {
		if sp.Name.Port == port {
			return sp
		}
	}
	return nil
}

// PortEndpoints is the endpoints of one port of a service, by the port's name.
type PortEndpoints struct {
	Port      string
	Endpoints []Endpoint
}

// EndpointsByPort is a service's endpoints per port name, sorted by port name, no name twice
// and no port without endpoints (a slice for the reason ServicePorts is one).
type EndpointsByPort []PortEndpoints

// Get returns the endpoints of the port named port (nil when it has none).
func (eps EndpointsByPort) Get(port string) []Endpoint {
	for _, pe := range eps {
		if pe.Port == port {
			return pe.Endpoints
		}
	}
	return nil
}

// Change is the change of one service's ports (ServicePorts) or endpoints (EndpointsByPort)
// between two Drains. Previous is nil for an added service, Current nil for a deleted (or now
// skipped) one.
type Change[T ServicePorts | EndpointsByPort] struct {
	Previous, Current T
}

// Changes is what Drain hands out.
type Changes struct {
	Services  map[types.NamespacedName]Change[ServicePorts]
	Endpoints map[types.NamespacedName]Change[EndpointsByPort]
	// ZoneChanged is true when this node's zone changed since the previous Drain; Zone is then
	// the new zone ("" when the node has none).
	ZoneChanged bool
	Zone        string
	// Triggers are the EndpointSlice trigger times of this batch's endpoint changes (see
	// TriggerTime): each starts one network programming latency observation once programmed.
	Triggers []TriggerTime
}

// TriggerTime is when a change of a service's endpoints was triggered, as the EndpointSlice's
// endpoints.kubernetes.io/last-change-trigger-time annotation says (the time the controller saw
// the Pod or Service change that the slice reflects), and the slice's address family: the start
// of one network programming latency observation, as kube-proxy defines it.
type TriggerTime struct {
	Family v1.IPFamily
	At     time.Time
}

// Empty reports whether there is nothing to apply.
func (c *Changes) Empty() bool {
	return len(c.Services) == 0 && len(c.Endpoints) == 0 && !c.ZoneChanged
}

// TrackerOptions configures a Tracker.
type TrackerOptions struct {
	// Log receives invalid-object reports; the zero value logs nothing.
	Log zerolog.Logger
	// OnChange, if set, is called (without locks held) after an event left a change pending:
	// the proxy uses it to trigger a sync.
	OnChange func()
	// OnEndpointsChange, if set, is called instead of OnChange after an EndpointSlice event left
	// a change of endpoints pending: the proxy hands endpoints to its balancer at once
	// (DrainEndpoints), without waiting for a rate-limited sync.
	OnEndpointsChange func()
	// OnSynced, if set, is called when the source reports its initial state complete.
	OnSynced func()
	// OnProblem, if set, receives the invalid fields of a Service (ReasonInvalidField) when they
	// are first reported (as the log reports them: once per distinct error of an object, again
	// only when it changes). It is called on the source's goroutine and must not block.
	OnProblem func(Problem)
	// Now returns the current time; nil means time.Now. Trigger times before the Tracker was
	// created are not reported (they describe changes made before the proxy started).
	Now func() time.Time
}

// Tracker implements source.Handler and coalesces changes until Drain.
type Tracker struct {
	opts TrackerOptions

	mu sync.Mutex // guards the following fields
	// applied is the state handed out by the last Drain.
	appliedPorts     map[types.NamespacedName]ServicePorts
	appliedEndpoints map[types.NamespacedName]EndpointsByPort
	// slices holds what each current EndpointSlice of a service contributes (not the slice:
	// a source need not keep its objects once delivered), sorted by slice name. A list is
	// replaced, never changed in place: a list read under mu stays valid after it is released.
	// (A slice, not a map by name: a service has one or a few, and a map costs ~300 bytes even
	// for one.)
	slices map[types.NamespacedName][]SliceEndpoints
	// pending changes since the last Drain.
	pendingPorts     map[types.NamespacedName]*Change[ServicePorts]
	pendingEndpoints map[types.NamespacedName]*Change[EndpointsByPort]
	// zone is this node's zone as last reported, appliedZone the one the last Drain handed out.
	zone, appliedZone string
	// triggers holds the trigger times of the pending endpoint changes, per service (see
	// TriggerTime); started is when the Tracker was created.
	triggers map[types.NamespacedName][]TriggerTime
	started  time.Time
	// lastErr remembers the last reported error per object so a repeated event does not repeat it.
	lastErr map[string]string
}

var (
	_ source.Handler         = (*Tracker)(nil)
	_ source.TopologyHandler = (*Tracker)(nil)
)

// NewTracker returns an empty Tracker.
func NewTracker(opts TrackerOptions) *Tracker {
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &Tracker{
		opts:             opts,
		appliedPorts:     map[types.NamespacedName]ServicePorts{},
		appliedEndpoints: map[types.NamespacedName]EndpointsByPort{},
		slices:           map[types.NamespacedName][]SliceEndpoints{},
		pendingPorts:     map[types.NamespacedName]*Change[ServicePorts]{},
		pendingEndpoints: map[types.NamespacedName]*Change[EndpointsByPort]{},
		triggers:         map[types.NamespacedName][]TriggerTime{},
		started:          opts.Now(),
		lastErr:          map[string]string{},
	}
}

// OnServiceUpdate records a service add (prev nil), update or delete (cur nil).
func (t *Tracker) OnServiceUpdate(prev, cur *v1.Service) {
	obj := cur
	if obj == nil {
		obj = prev
	}
	if obj == nil {
		return
	}
	name := types.NamespacedName{Namespace: obj.Namespace, Name: obj.Name}
	var ports ServicePorts
	if cur != nil {
		list, err := FromService(cur)
		if t.report("Service", name, err) && t.opts.OnProblem != nil {
			for _, pr := range FieldProblems(name, cur.UID, err) {
				t.opts.OnProblem(pr)
			}
		}
		if len(list) > 0 {
			slices.SortFunc(list, func(a, b *ServicePort) int { return strings.Compare(a.Name.Port, b.Name.Port) })
			ports = slices.Clip(ServicePorts(list))
		}
		if reason := SkipReason(cur); reason != "" {
			t.opts.Log.Debug().Str("service", name.String()).Str("reason", reason).Msg("not proxied")
		}
	} else {
		t.report("Service", name, nil)
	}

	t.mu.Lock()
	changed := recordLocked(t.pendingPorts, t.appliedPorts, name, ports, portsEqual)
	t.noteLocked(changed)
}

// OnEndpointSliceUpdate records an EndpointSlice add (prev nil), update or delete (cur nil).
func (t *Tracker) OnEndpointSliceUpdate(prev, cur *discovery.EndpointSlice) {
	obj := cur
	if obj == nil {
		obj = prev
	}
	if obj == nil {
		return
	}
	svc, ok := SliceServiceName(obj)
	if !ok {
		t.report("EndpointSlice", types.NamespacedName{Namespace: obj.Namespace, Name: obj.Name}, &FieldError{
			Object: "EndpointSlice " + obj.Namespace + "/" + obj.Name,
			Field:  "metadata.labels[" + discovery.LabelServiceName + "]",
			Detail: "missing: the slice belongs to no service"})
		return
	}

	// A slice whose service label changed leaves its old service first.
	if prev != nil && cur != nil {
		if old, ok := SliceServiceName(prev); ok && old != svc {
			t.OnEndpointSliceUpdate(prev, nil)
		}
	}

	var se *SliceEndpoints
	var trigger time.Time
	if cur != nil {
		v := FromSlice(cur)
		se = &v
		var err error
		trigger, err = LastChangeTriggerTime(cur)
		t.report("EndpointSlice", types.NamespacedName{Namespace: obj.Namespace, Name: obj.Name}, err)
	}
	t.mu.Lock()
	old := t.slices[svc]
	list := withSlice(old, obj.Name, se)
	if len(list) == 0 {
		delete(t.slices, svc)
	} else {
		t.slices[svc] = list
	}
	// As kube-proxy: a slice whose contribution changed brings its trigger time (if it has one,
	// and it is not older than the Tracker); a deleted slice drops the service's pending ones,
	// since a deleted object's annotation tells when it was last updated, not when it was deleted.
	switch {
	case cur == nil:
		delete(t.triggers, svc)
	case !trigger.IsZero() && trigger.After(t.started) && sliceChanged(old, list, obj.Name):
		t.triggers[svc] = append(t.triggers[svc], TriggerTime{Family: sliceFamily(cur), At: trigger})
	}
	t.mu.Unlock()

	eps, err := MergeSlices(list)
	t.report("EndpointSlices of", svc, err)

	t.mu.Lock()
	changed := recordLocked(t.pendingEndpoints, t.appliedEndpoints, svc, eps, endpointsEqual)
	if changed && t.opts.OnEndpointsChange != nil {
		t.mu.Unlock()
		t.opts.OnEndpointsChange()
		return
	}
	t.noteLocked(changed)
}

// withSlice returns a copy of list (sorted by name) where the slice named name is cur, or is
// left out when cur is nil.
func withSlice(list []SliceEndpoints, name string, cur *SliceEndpoints) []SliceEndpoints {
	i, found := slices.BinarySearchFunc(list, name, func(s SliceEndpoints, name string) int {
		return strings.Compare(s.Name, name)
	})
	switch {
	case cur == nil && !found:
		return list
	case cur == nil:
		return slices.Concat(list[:i], list[i+1:])
	case found:
		out := slices.Clone(list)
		out[i] = *cur
		return out
	}
	return slices.Concat(list[:i], []SliceEndpoints{*cur}, list[i:])
}

// sliceChanged reports whether what the slice named name contributes differs between the lists
// before and after (sorted by slice name, as the Tracker keeps them).
func sliceChanged(before, after []SliceEndpoints, name string) bool {
	find := func(list []SliceEndpoints) *SliceEndpoints {
		i, ok := slices.BinarySearchFunc(list, name, func(s SliceEndpoints, name string) int { return strings.Compare(s.Name, name) })
		if !ok {
			return nil
		}
		return &list[i]
	}
	a, b := find(before), find(after)
	if a == nil || b == nil {
		return a != b
	}
	return !endpointsEqual(a.Ports, b.Ports) || errString(a.Err) != errString(b.Err)
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// sliceFamily returns the IP family of a slice's addresses (IPv4 for an FQDN slice, which
// contributes nothing).
func sliceFamily(s *discovery.EndpointSlice) v1.IPFamily {
	if s.AddressType == discovery.AddressTypeIPv6 {
		return v1.IPv6Protocol
	}
	return v1.IPv4Protocol
}

// LastChangeTriggerTime returns the time in the slice's
// endpoints.kubernetes.io/last-change-trigger-time annotation (v1.EndpointsLastChangeTriggerTime):
// zero when it has none, and zero with an error naming the field when it is not an RFC 3339
// time. Kube-proxy takes the same annotation, with the same fallbacks (no observation without a
// valid time).
func LastChangeTriggerTime(s *discovery.EndpointSlice) (time.Time, error) {
	v, ok := s.Annotations[v1.EndpointsLastChangeTriggerTime]
	if !ok {
		return time.Time{}, nil
	}
	at, err := time.Parse(time.RFC3339Nano, v)
	if err != nil {
		return time.Time{}, &FieldError{Object: "EndpointSlice " + s.Namespace + "/" + s.Name,
			Field: "metadata.annotations[" + v1.EndpointsLastChangeTriggerTime + "]", Detail: fmt.Sprintf("not an RFC 3339 time: %q", v)}
	}
	return at, nil
}

// recordLocked makes cur the pending state of name (previous: the state the last Drain handed
// out) and reports whether a change is now pending; a change back to that state is none.
func recordLocked[T ServicePorts | EndpointsByPort](pending map[types.NamespacedName]*Change[T], applied map[types.NamespacedName]T,
	name types.NamespacedName, cur T, equal func(a, b T) bool) bool {
	ch, ok := pending[name]
	if !ok {
		ch = &Change[T]{Previous: applied[name]}
	}
	ch.Current = cur
	if equal(ch.Previous, ch.Current) {
		delete(pending, name)
		return false
	}
	pending[name] = ch
	return true
}

// noteLocked ends an event: it releases t.mu and, when the event left a change pending, calls
// OnChange.
func (t *Tracker) noteLocked(changed bool) {
	t.mu.Unlock()
	if changed && t.opts.OnChange != nil {
		t.opts.OnChange()
	}
}

// OnNodeTopology records this node's zone ("" for none).
func (t *Tracker) OnNodeTopology(zone string) {
	t.mu.Lock()
	pending := zone != t.zone && zone != t.appliedZone
	t.zone = zone
	t.noteLocked(pending)
}

// AwaitsFirstSlices reports whether the only pending changes are Services new to the proxy
// (never handed out by Drain) with no EndpointSlice yet: the EndpointSlice controller, or
// whoever manages a selectorless Service's slices, usually writes a new Service's first slice
// within milliseconds, and one sync for both then programs the Service once (see
// syncrunner.Runner.TriggerWithin). It looks at no more than a few pending changes: a larger
// batch is no single new Service, and the answer is false.
func (t *Tracker) AwaitsFirstSlices() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.pendingPorts) == 0 || len(t.pendingPorts) > awaitMax || len(t.pendingEndpoints) > 0 || t.zone != t.appliedZone {
		return false
	}
	for name, ch := range t.pendingPorts {
		if ch.Previous != nil || ch.Current == nil || len(t.slices[name]) > 0 {
			return false
		}
	}
	return true
}

// HasPendingService reports whether a change of the Service name is pending (not yet drained).
func (t *Tracker) HasPendingService(name types.NamespacedName) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, ok := t.pendingPorts[name]
	return ok
}

// HasPendingEndpoints reports whether an endpoint change is pending (not yet drained).
func (t *Tracker) HasPendingEndpoints() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.pendingEndpoints) > 0
}

// awaitMax is the most pending Service changes AwaitsFirstSlices looks at.
const awaitMax = 8

// drainLocked moves the pending changes into out and makes their current state the applied one.
// It returns the maps to use from now on: applied, or a new one sized for the changes when it
// was empty (the first Drain after a source's initial state fills it at once, without growing
// it step by step); and an empty pending map, a new one after a large batch, since a cleared
// map keeps its size and every later Drain would walk it.
func drainLocked[T ServicePorts | EndpointsByPort](pending map[types.NamespacedName]*Change[T], applied map[types.NamespacedName]T,
	out map[types.NamespacedName]Change[T]) (map[types.NamespacedName]T, map[types.NamespacedName]*Change[T]) {
	if len(applied) == 0 {
		applied = make(map[types.NamespacedName]T, len(pending))
	}
	for name, ch := range pending {
		out[name] = *ch
		if ch.Current == nil {
			delete(applied, name)
		} else {
			applied[name] = ch.Current
		}
	}
	if len(pending) > smallBatch {
		return applied, map[types.NamespacedName]*Change[T]{}
	}
	clear(pending)
	return applied, pending
}

// smallBatch is the largest pending map Drain clears for reuse.
const smallBatch = 64

// OnSynced forwards the source's initial-sync signal.
func (t *Tracker) OnSynced() {
	if t.opts.OnSynced != nil {
		t.opts.OnSynced()
	}
}

// Drain returns the pending changes and makes their current state the new baseline.
func (t *Tracker) Drain() Changes {
	t.mu.Lock()
	defer t.mu.Unlock()
	c := Changes{
		Services:  make(map[types.NamespacedName]Change[ServicePorts], len(t.pendingPorts)),
		Endpoints: make(map[types.NamespacedName]Change[EndpointsByPort], len(t.pendingEndpoints)),
		Triggers:  t.takeTriggersLocked(),
	}
	if t.zone != t.appliedZone {
		c.ZoneChanged, c.Zone = true, t.zone
		t.appliedZone = t.zone
	}
	t.appliedPorts, t.pendingPorts = drainLocked(t.pendingPorts, t.appliedPorts, c.Services)
	t.appliedEndpoints, t.pendingEndpoints = drainLocked(t.pendingEndpoints, t.appliedEndpoints, c.Endpoints)
	return c
}

// DrainEndpoints is Drain for the endpoint changes only (and their trigger times): the Service
// and zone changes stay pending for the next Drain.
func (t *Tracker) DrainEndpoints() Changes {
	t.mu.Lock()
	defer t.mu.Unlock()
	c := Changes{
		Endpoints: make(map[types.NamespacedName]Change[EndpointsByPort], len(t.pendingEndpoints)),
		Triggers:  t.takeTriggersLocked(),
	}
	t.appliedEndpoints, t.pendingEndpoints = drainLocked(t.pendingEndpoints, t.appliedEndpoints, c.Endpoints)
	return c
}

// takeTriggersLocked returns the pending trigger times (nil when there are none) and forgets them.
func (t *Tracker) takeTriggersLocked() []TriggerTime {
	if len(t.triggers) == 0 {
		return nil
	}
	var out []TriggerTime
	for _, ts := range t.triggers {
		out = append(out, ts...)
	}
	if len(t.triggers) > smallBatch { // a cleared map keeps its size, and ranging walks it
		t.triggers = map[types.NamespacedName][]TriggerTime{}
	} else {
		clear(t.triggers)
	}
	return out
}

// report logs err for the object kind name unless the same error was the last one reported for
// it; a nil err forgets its last error. The object's name is only formatted when there is an
// error to log or to forget. It reports whether it logged err.
func (t *Tracker) report(kind string, name types.NamespacedName, err error) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if err == nil && len(t.lastErr) == 0 {
		return false
	}
	obj := kind + " " + name.String()
	if err == nil {
		delete(t.lastErr, obj)
		return false
	}
	if t.lastErr[obj] == err.Error() {
		return false
	}
	t.lastErr[obj] = err.Error()
	t.opts.Log.Error().Err(err).Str("object", obj).Msg("invalid fields ignored; serving the rest")
	return true
}

func portsEqual(a, b ServicePorts) bool {
	return slices.EqualFunc(a, b, (*ServicePort).Equal)
}

func endpointsEqual(a, b EndpointsByPort) bool {
	return slices.EqualFunc(a, b, func(x, y PortEndpoints) bool { return x.Port == y.Port && slices.Equal(x.Endpoints, y.Endpoints) })
}
