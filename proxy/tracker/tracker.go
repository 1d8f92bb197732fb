// Package tracker coalesces Service and EndpointSlice events into per-service changes, the way
// kube-proxy's change trackers do.
//
// A source calls the Tracker (it implements source.Handler) with every event. The Tracker keeps
// the current objects and, per service, the state it last handed out; Drain hands out what
// changed since the previous Drain as (previous, current) pairs. Several events for one service
// between two Drains coalesce into one change (oldest previous, newest current), and a change
// whose current equals its previous (an update that changed nothing the proxy uses, or an add
// followed by a delete) is dropped. Services and endpoints are tracked independently: endpoints
// may arrive before their service, and the consumer joins them by name.
//
// The Tracker also implements source.TopologyHandler: this node's zone is handed out by Drain
// when it differs from the zone the previous Drain handed out.
//
// The Tracker is safe for concurrent use.
package tracker

import (
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/serviceport"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/source"
)

// Ports is a service's ports by port name.
type Ports map[string]*serviceport.ServicePort

// Endpoints is a service's endpoints by port name.
type Endpoints map[string][]serviceport.Endpoint

// ServiceChange is the change of one service's ports between two Drains. Previous is nil for an
// added service, Current nil for a deleted (or now skipped) one.
type ServiceChange struct {
	Previous, Current Ports
}

// EndpointsChange is the change of one service's endpoints between two Drains.
type EndpointsChange struct {
	Previous, Current Endpoints
}

// Changes is what Drain hands out.
type Changes struct {
	Services  map[types.NamespacedName]ServiceChange
	Endpoints map[types.NamespacedName]EndpointsChange
	// ZoneChanged is true when this node's zone changed since the previous Drain; Zone is then
	// the new zone ("" when the node has none).
	ZoneChanged bool
	Zone        string
	// Oldest is when the oldest change in this batch was recorded (zero when empty): the start
	// of the network programming latency.
	Oldest time.Time
}

// Empty reports whether there is nothing to apply.
func (c *Changes) Empty() bool {
	return len(c.Services) == 0 && len(c.Endpoints) == 0 && !c.ZoneChanged
}

// Options configures a Tracker.
type Options struct {
	// Log receives invalid-object reports; the zero value logs nothing.
	Log zerolog.Logger
	// OnChange, if set, is called (without locks held) after an event left a change pending:
	// the proxy uses it to trigger a sync.
	OnChange func()
	// OnSynced, if set, is called when the source reports its initial state complete.
	OnSynced func()
	// Now returns the current time; nil means time.Now.
	Now func() time.Time
}

// Tracker implements source.Handler and coalesces changes until Drain.
type Tracker struct {
	opts Options

	mu sync.Mutex // guards the following fields
	// applied is the state handed out by the last Drain.
	appliedPorts     map[types.NamespacedName]Ports
	appliedEndpoints map[types.NamespacedName]Endpoints
	// slices holds the current EndpointSlices per service, by slice name.
	slices map[types.NamespacedName]map[string]*discovery.EndpointSlice
	// pending changes since the last Drain.
	pendingPorts     map[types.NamespacedName]*ServiceChange
	pendingEndpoints map[types.NamespacedName]*EndpointsChange
	// zone is this node's zone as last reported, appliedZone the one the last Drain handed out.
	zone, appliedZone string
	oldest            time.Time
	// lastErr remembers the last reported error per object so a repeated event does not repeat it.
	lastErr map[string]string
	// serviceEvents and endpointEvents count events that left a change pending.
	serviceEvents, endpointEvents int
}

var (
	_ source.Handler         = (*Tracker)(nil)
	_ source.TopologyHandler = (*Tracker)(nil)
)

// New returns an empty Tracker.
func New(opts Options) *Tracker {
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &Tracker{
		opts:             opts,
		appliedPorts:     map[types.NamespacedName]Ports{},
		appliedEndpoints: map[types.NamespacedName]Endpoints{},
		slices:           map[types.NamespacedName]map[string]*discovery.EndpointSlice{},
		pendingPorts:     map[types.NamespacedName]*ServiceChange{},
		pendingEndpoints: map[types.NamespacedName]*EndpointsChange{},
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
	var ports Ports
	if cur != nil {
		list, err := serviceport.FromService(cur)
		t.report("Service "+name.String(), err)
		if len(list) > 0 {
			ports = make(Ports, len(list))
			for _, sp := range list {
				ports[sp.Name.Port] = sp
			}
		}
		if reason := serviceport.SkipReason(cur); reason != "" {
			t.opts.Log.Debug().Str("service", name.String()).Str("reason", reason).Msg("not proxied")
		}
	} else {
		t.forget("Service " + name.String())
	}

	t.mu.Lock()
	ch, ok := t.pendingPorts[name]
	if !ok {
		ch = &ServiceChange{Previous: t.appliedPorts[name]}
	}
	ch.Current = ports
	changed := !portsEqual(ch.Previous, ch.Current)
	if changed {
		t.pendingPorts[name] = ch
		t.serviceEvents++
		t.markLocked()
	} else {
		delete(t.pendingPorts, name)
	}
	t.mu.Unlock()
	if changed && t.opts.OnChange != nil {
		t.opts.OnChange()
	}
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
	svc, ok := serviceport.SliceServiceName(obj)
	if !ok {
		t.report("EndpointSlice "+obj.Namespace+"/"+obj.Name, &serviceport.FieldError{
			Object: "EndpointSlice " + obj.Namespace + "/" + obj.Name,
			Field:  "metadata.labels[" + discovery.LabelServiceName + "]",
			Detail: "missing: the slice belongs to no service"})
		return
	}

	// A slice whose service label changed leaves its old service first.
	if prev != nil && cur != nil {
		if old, ok := serviceport.SliceServiceName(prev); ok && old != svc {
			t.OnEndpointSliceUpdate(prev, nil)
		}
	}

	t.mu.Lock()
	byName := t.slices[svc]
	if cur == nil {
		delete(byName, obj.Name)
		if len(byName) == 0 {
			delete(t.slices, svc)
		}
	} else {
		if byName == nil {
			byName = map[string]*discovery.EndpointSlice{}
			t.slices[svc] = byName
		}
		byName[obj.Name] = cur
	}
	list := make([]*discovery.EndpointSlice, 0, len(byName))
	for _, k := range slices.Sorted(maps.Keys(byName)) {
		list = append(list, byName[k])
	}
	t.mu.Unlock()

	eps, err := serviceport.EndpointsFromSlices(svc, list)
	t.report("EndpointSlices of "+svc.String(), err)
	if len(eps) == 0 {
		eps = nil
	}

	t.mu.Lock()
	ch, ok := t.pendingEndpoints[svc]
	if !ok {
		ch = &EndpointsChange{Previous: t.appliedEndpoints[svc]}
	}
	ch.Current = eps
	changed := !endpointsEqual(ch.Previous, ch.Current)
	if changed {
		t.pendingEndpoints[svc] = ch
		t.endpointEvents++
		t.markLocked()
	} else {
		delete(t.pendingEndpoints, svc)
	}
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
	if pending {
		t.markLocked()
	}
	t.mu.Unlock()
	if pending && t.opts.OnChange != nil {
		t.opts.OnChange()
	}
}

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
		Services:  make(map[types.NamespacedName]ServiceChange, len(t.pendingPorts)),
		Endpoints: make(map[types.NamespacedName]EndpointsChange, len(t.pendingEndpoints)),
		Oldest:    t.oldest,
	}
	if t.zone != t.appliedZone {
		c.ZoneChanged, c.Zone = true, t.zone
		t.appliedZone = t.zone
	}
	for name, ch := range t.pendingPorts {
		c.Services[name] = *ch
		if ch.Current == nil {
			delete(t.appliedPorts, name)
		} else {
			t.appliedPorts[name] = ch.Current
		}
	}
	for name, ch := range t.pendingEndpoints {
		c.Endpoints[name] = *ch
		if ch.Current == nil {
			delete(t.appliedEndpoints, name)
		} else {
			t.appliedEndpoints[name] = ch.Current
		}
	}
	clear(t.pendingPorts)
	clear(t.pendingEndpoints)
	t.oldest = time.Time{}
	return c
}

// Pending reports whether changes are waiting for Drain, and since when.
func (t *Tracker) Pending() (bool, time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.pendingPorts)+len(t.pendingEndpoints) > 0 || t.zone != t.appliedZone, t.oldest
}

// EventCounts returns how many service and endpoint events left a change pending so far (the
// kubeproxy_sync_proxy_rules_{service,endpoint}_changes_total metrics).
func (t *Tracker) EventCounts() (services, endpoints int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.serviceEvents, t.endpointEvents
}

func (t *Tracker) markLocked() {
	if t.oldest.IsZero() {
		t.oldest = t.opts.Now()
	}
}

// report logs err for obj unless the same error was the last one reported for it.
func (t *Tracker) report(obj string, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if err == nil {
		delete(t.lastErr, obj)
		return
	}
	if t.lastErr[obj] == err.Error() {
		return
	}
	t.lastErr[obj] = err.Error()
	t.opts.Log.Error().Err(err).Str("object", obj).Msg("invalid fields ignored; serving the rest")
}

func (t *Tracker) forget(obj string) {
	t.mu.Lock()
	delete(t.lastErr, obj)
	t.mu.Unlock()
}

func portsEqual(a, b Ports) bool {
	return maps.EqualFunc(a, b, (*serviceport.ServicePort).Equal)
}

func endpointsEqual(a, b Endpoints) bool {
	return maps.EqualFunc(a, b, func(x, y []serviceport.Endpoint) bool { return slices.Equal(x, y) })
}
