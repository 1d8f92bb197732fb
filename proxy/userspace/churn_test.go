package userspace

import (
	"context"
	"net/netip"
	"slices"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/utils/ptr"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// programmed records what a proxier reports of its syncs and endpoint-only updates.
type programmed struct {
	mu        sync.Mutex
	syncs     []proxy.SyncResult
	endpoints []proxy.EndpointsResult
}

func (r *programmed) synced(s proxy.SyncResult) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.syncs = append(r.syncs, s)
}

func (r *programmed) endpointsProgrammed(e proxy.EndpointsResult) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.endpoints = append(r.endpoints, e)
}

// triggers returns the trigger times reported by syncs and by endpoint-only updates.
func (r *programmed) triggers() (bySync, byEndpoints []time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.syncs {
		for _, tr := range s.Triggers {
			bySync = append(bySync, tr.At)
		}
	}
	for _, e := range r.endpoints {
		for _, tr := range e.Triggers {
			byEndpoints = append(byEndpoints, tr.At)
		}
	}
	return bySync, byEndpoints
}

// portalSyncs counts the portal syncs (rule writes) so far.
func (r *recordingPortals) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.fulls)
}

// action returns the internal action of the port name in the last portal sync.
func (r *recordingPortals) action(name proxy.Name) (proxy.Action, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, st := range r.last {
		if st.ServicePort.Name == name {
			return st.Internal, true
		}
	}
	return 0, false
}

// triggered returns s with the last-change-trigger-time annotation at, and its endpoints'
// conditions set: terminating (not ready, serving) when terminating.
func triggered(s *discovery.EndpointSlice, at time.Time, terminating bool) *discovery.EndpointSlice {
	s.Annotations = map[string]string{v1.EndpointsLastChangeTriggerTime: at.UTC().Format(time.RFC3339Nano)}
	for i := range s.Endpoints {
		c := &s.Endpoints[i].Conditions
		c.Ready, c.Serving, c.Terminating = ptr.To(!terminating), ptr.To(true), ptr.To(terminating)
	}
	return s
}

// TestEndpointChangesProgrammedWithoutSync: an endpoint change that changes no rule (a rolling
// update's: one endpoint terminating, a new one ready) reaches the balancer with no sync and no
// rule write, and its trigger time is observed then; one that does change a rule (the last
// endpoint gone: the portals reject) waits for the sync, whose result carries its trigger time.
func TestEndpointChangesProgrammedWithoutSync(t *testing.T) {
	a, b := startBackend(t, "a"), startBackend(t, "b")
	portals := &programmedPortals{}
	rec := &programmed{}
	p := newTestProxier(t, Options{Portals: &portals.recordingPortals, BindAddress: netip.MustParseAddr("127.0.0.1"),
		OnSynced: rec.synced, OnEndpointsProgrammed: rec.endpointsProgrammed})
	tr := p.Tracker()
	t0 := time.Now()
	tr.OnServiceUpdate(nil, service("echo", []v1.ServicePort{tcpPort("tcp", 80)}))
	sa := triggered(slice("echo", "echo-a", "tcp", v1.ProtocolTCP, a), t0.Add(time.Millisecond), false)
	tr.OnEndpointSliceUpdate(nil, sa)
	p.sync(false)
	port := proxyPort(t, p, echoTCP)
	if got := mustAsk(t, "tcp", port); got != "a" {
		t.Fatalf("answered by %q, want a", got)
	}
	rules := portals.count()

	// A rolling update's step: a terminating, b new and ready.
	sa2 := triggered(slice("echo", "echo-a", "tcp", v1.ProtocolTCP, a), t0.Add(2*time.Millisecond), true)
	sb := triggered(slice("echo", "echo-b", "tcp", v1.ProtocolTCP, b), t0.Add(3*time.Millisecond), false)
	tr.OnEndpointSliceUpdate(sa, sa2)
	tr.OnEndpointSliceUpdate(nil, sb)
	p.programEndpoints()
	for range 4 {
		if got := mustAsk(t, "tcp", port); got != "b" {
			t.Fatalf("answered by %q after a became terminating and b ready, want b", got)
		}
	}
	if n := portals.count(); n != rules {
		t.Errorf("%d rule writes for an endpoint change that changes no rule, want none", n-rules)
	}
	bySync, byEndpoints := rec.triggers()
	if want := []time.Time{t0.Add(2 * time.Millisecond), t0.Add(3 * time.Millisecond)}; !sameTimes(byEndpoints, want) {
		t.Errorf("trigger times observed without a sync: %v, want %v", byEndpoints, want)
	}

	// The last endpoints go: the portals must reject, which takes a sync.
	tr.OnEndpointSliceUpdate(sa2, nil)
	sb2 := triggered(slice("echo", "echo-b", "tcp", v1.ProtocolTCP), t0.Add(4*time.Millisecond), false)
	tr.OnEndpointSliceUpdate(sb, sb2)
	p.programEndpoints()
	if _, again := rec.triggers(); len(again) != len(byEndpoints) {
		t.Errorf("a change that needs a rule was observed before its sync: %v", again)
	}
	p.sync(false)
	if act, ok := portals.action(echoTCP); !ok || act != proxy.Reject {
		t.Errorf("after the last endpoint left, the portals have %v (%v), want %v", act, ok, proxy.Reject)
	}
	if bySync2, _ := rec.triggers(); !sameTimes(bySync2[len(bySync):], []time.Time{t0.Add(4 * time.Millisecond)}) {
		t.Errorf("the sync observed %v, want the rule change's trigger time", bySync2[len(bySync):])
	}
}

// programmedPortals is recordingPortals (kept as a named field so tests read its counts).
type programmedPortals struct{ recordingPortals }

func sameTimes(got, want []time.Time) bool {
	got = slices.Clone(got)
	slices.SortFunc(got, time.Time.Compare)
	return slices.EqualFunc(got, want, time.Time.Equal)
}

// TestRunProgramsEndpointsAtOnce: with the sync rate limit spent (MinSyncPeriod an hour), an
// endpoint change still reaches the balancer at once; and the ClientIP affinity entries of an
// endpoint that left are dropped with it.
func TestRunProgramsEndpointsAtOnce(t *testing.T) {
	a, b := startBackend(t, "a"), startBackend(t, "b")
	portals := &recordingPortals{}
	p := newTestProxier(t, Options{Portals: portals, BindAddress: netip.MustParseAddr("127.0.0.1"), MinSyncPeriod: time.Hour, SyncPeriod: time.Hour})
	tr := p.Tracker()
	affine := func(s *v1.Service) {
		s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
		s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr.To(int32(3600))}}
	}
	tr.OnServiceUpdate(nil, service("echo", []v1.ServicePort{tcpPort("tcp", 80)}, affine))
	sa := slice("echo", "echo-a", "tcp", v1.ProtocolTCP, a)
	tr.OnEndpointSliceUpdate(nil, sa)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { p.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	waitFor(t, func() bool { return portExists(p, echoTCP) })
	// The burst's second sync, for another service: the rate limit is spent for an hour.
	tr.OnServiceUpdate(nil, service("other", []v1.ServicePort{tcpPort("tcp", 80)}))
	waitFor(t, func() bool { return portExists(p, proxy.Name{Namespace: "default", Name: "other", Port: "tcp"}) })
	port := proxyPort(t, p, echoTCP)
	if got := mustAsk(t, "tcp", port); got != "a" {
		t.Fatalf("answered by %q, want a", got)
	}
	if aff := p.lb.Affinity(); len(aff) != 1 || aff[0].Endpoint != a.addr {
		t.Fatalf("affinity entries %v, want one for a", aff)
	}

	// a leaves, b comes: no rule changes, so no sync is needed.
	tr.OnEndpointSliceUpdate(sa, nil)
	tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-b", "tcp", v1.ProtocolTCP, b))
	// The two slice events may be programmed one at a time: wait for the port to have b (a's
	// affinity gone with it), not only for a to be gone.
	waitFor(t, func() bool { return len(p.lb.Affinity()) == 0 && p.lb.Availability(echoTCP).Internal })
	if got := mustAsk(t, "tcp", port); got != "b" {
		t.Errorf("answered by %q after a left, want b", got)
	}
}

// waitFor polls cond until it holds, failing the test after 10 s (a bound for a stuck test,
// not a timing requirement).
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 10 s")
		}
	}
}

// blockingPortals is Portals whose Sync, once armed, waits until released: a rule write that
// takes long (a full restore at 10,000 service ports takes about a second).
type blockingPortals struct {
	armed   bool
	entered chan struct{}
	release chan struct{}
}

func (b *blockingPortals) Sync(context.Context, []proxy.PortState, proxy.NodeAddrs, bool) error {
	if b.armed {
		b.entered <- struct{}{}
		<-b.release
	}
	return nil
}

// TestEndpointsNotHeldByRuleWrite: while a sync writes rules, an endpoint change still reaches
// the balancer.
func TestEndpointsNotHeldByRuleWrite(t *testing.T) {
	a, b := startBackend(t, "a"), startBackend(t, "b")
	portals := &blockingPortals{entered: make(chan struct{}), release: make(chan struct{})}
	p := newTestProxier(t, Options{Portals: portals, BindAddress: netip.MustParseAddr("127.0.0.1")})
	tr := p.Tracker()
	tr.OnServiceUpdate(nil, service("echo", []v1.ServicePort{tcpPort("tcp", 80)}))
	sa := slice("echo", "echo-a", "tcp", v1.ProtocolTCP, a)
	tr.OnEndpointSliceUpdate(nil, sa)
	p.sync(false)
	port := proxyPort(t, p, echoTCP)

	portals.armed = true
	syncDone := make(chan struct{})
	go func() { p.sync(true); close(syncDone) }()
	<-portals.entered // the periodic sync is writing rules
	tr.OnEndpointSliceUpdate(sa, nil)
	tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-b", "tcp", v1.ProtocolTCP, b))
	programmed := make(chan struct{})
	go func() { p.programEndpoints(); close(programmed) }()
	select {
	case <-programmed:
	case <-time.After(10 * time.Second): // a bound for a stuck test, not a timing requirement
		t.Error("the endpoint change waited for the rule write")
	}
	if got := mustAsk(t, "tcp", port); got != "b" {
		t.Errorf("answered by %q during the rule write, want b", got)
	}
	close(portals.release)
	<-syncDone
	<-programmed
}
