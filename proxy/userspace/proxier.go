package userspace

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/sync/errgroup"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/loadbalancer"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/tcp"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/udp"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/portalloc"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/syncrunner"
)

// Portals programs the rules that send service traffic to the proxy's listeners.
type Portals interface {
	// Sync makes the rules match ports exactly (the complete desired state); node is the node's
	// addresses as of this sync. With full set it rewrites every rule, repairing whatever
	// someone else changed; otherwise it may write only what changed since its last successful
	// sync.
	Sync(ctx context.Context, ports []proxy.PortState, node proxy.NodeAddrs, full bool) error
}

// retryingPortals is Portals that may leave work for a later sync (*portal.Set: stale UDP
// flows whose deletion failed, tried again after a backoff): RetryDue says when, and the
// proxier runs a sync then, changes or not.
type retryingPortals interface {
	RetryDue() (time.Time, bool)
}

// Options configures a Proxier. The zero value of each field is documented.
type Options struct {
	// Log is the component's logger; the zero value logs nothing.
	Log zerolog.Logger
	// NodeName is this node's name, for Local traffic policies and node topology hints. This
	// node's zone, for zone hints, comes from the source through the Tracker (unknown until then).
	NodeName string
	// BindAddress is the address the proxy listeners bind to; the zero value (or an unspecified
	// address) binds all addresses of both families.
	BindAddress netip.Addr
	// PortRange is --proxy-port-range; the zero value lets the kernel pick ports.
	PortRange portalloc.Range
	// UDPTimeout is the idle timeout of UDP sessions; zero means forward's default.
	UDPTimeout time.Duration
	// MinSyncPeriod and SyncPeriod bound the sync frequency (defaults 1s and 30s).
	MinSyncPeriod, SyncPeriod time.Duration
	// FirstSliceWait is how long the sync for a new Service may wait for the Service's first
	// EndpointSlice, so that one sync programs both (see proxy.Tracker.AwaitsFirstSlices):
	// zero means DefaultFirstSliceWait, a negative value no wait.
	FirstSliceWait time.Duration
	// Portals programs rules; nil means none (--portal-mode none: only the listeners).
	Portals Portals
	// HoldPorts, when set, holds NodePorts and local portal IP:ports with real sockets.
	HoldPorts bool
	// OnQueued, if set, is called when a change starts waiting for the next sync.
	OnQueued func(at time.Time)
	// OnSynced, if set, receives the result of every sync, on the sync's goroutine.
	OnSynced func(proxy.SyncResult)
	// OnEndpointsProgrammed, if set, receives the result of every endpoint-only update that
	// programmed its changes without a sync (see Proxier), on that update's goroutine.
	OnEndpointsProgrammed func(proxy.EndpointsResult)
	// Metrics, if set, receives per-service-port traffic events.
	Metrics TrafficMetrics
	// NodeAddrs lists the node's own addresses, once per sync; nil means proxy.ListNodeAddrs.
	NodeAddrs func() (proxy.NodeAddrs, error)
	// TransparentLocal dials endpoints from the client's own address (forward.Target.Transparent)
	// for external traffic of externalTrafficPolicy: Local services to endpoints on this node
	// (NodeName), so they see the real client. It needs the reply routing of package
	// portal/transparent. False dials from the node's address, as the userspace proxy always did.
	TransparentLocal bool
	// Limits bounds the data path; the zero value bounds nothing.
	Limits Limits
	// ClusterCIDRs are the pods' addresses (kube-proxy's --cluster-cidr). Pods reaching a
	// NodePort, externalIP or load-balancer IP of an externalTrafficPolicy: Local service are
	// served by any endpoint, as the node itself is: their traffic is in-cluster, and kube-proxy
	// sends it to the cluster-wide endpoints too. Empty: only the node's own traffic is.
	ClusterCIDRs []netip.Prefix
	// PreferredPorts, if set, names the proxy port each service port's listener tries first
	// (after a crash, those the surviving rules name); a port that is taken or out of the range
	// falls back to allocation. Nil: every port is allocated.
	PreferredPorts PreferredPorts
	// OnProblem, if set, receives what keeps a Service from being served as it asks (see
	// proxy.Problem): its invalid fields (from the Tracker), a service port whose listener cannot
	// be opened, endpoints refused as the proxy itself. Each is reported when it begins, not at
	// every sync while it lasts. It is called with the proxier's lock held, from the sync's
	// goroutines: it must not block (the proxy queues them for the Events it writes).
	OnProblem func(proxy.Problem)
}

// newLoops returns the event loops that relay TCP: one per processor the runtime uses. Nil
// when they cannot be created (no descriptor left): TCP service ports are then not served,
// each saying so in the log.
func newLoops(opts Options) *tcp.Loops {
	loops, err := tcp.NewLoops(runtime.GOMAXPROCS(0))
	if err != nil {
		opts.Log.Error().Err(err).Msg("TCP event loops not available; TCP service ports will not be served")
		return nil
	}
	opts.Log.Info().Int("loops", runtime.GOMAXPROCS(0)).Msg("TCP data path: event loops")
	return loops
}

// newBalancer returns the load balancer for opts: this node, the affinity bound, and evictions
// counted in the metrics.
func newBalancer(opts Options) *loadbalancer.RoundRobin {
	lbOpts := loadbalancer.Options{NodeName: opts.NodeName, Log: opts.Log, MaxAffinityEntries: opts.Limits.MaxAffinityEntries}
	if opts.Metrics != nil {
		lbOpts.OnAffinityEvicted = opts.Metrics.AffinityEvicted
	}
	return loadbalancer.New(lbOpts)
}

// syncBurst is how many syncs may follow each other before MinSyncPeriod applies: 2, as in
// kube-proxy's iptables mode, so that a Service and its EndpointSlice created together are both
// programmed at once.
const syncBurst = 2

// DefaultFirstSliceWait is Options.FirstSliceWait's default. A new Service programmed alone
// gets a REJECT rule (no endpoints yet) that its slice's sync, the next, replaces; at 10,000
// service ports each of those syncs costs ~15–40 ms of iptables-restore. The EndpointSlice
// controller (or whoever writes a selectorless Service's slices) usually follows within a few
// milliseconds: waiting up to this long for it lets one sync program the Service, with its
// endpoints, sooner than two would.
const DefaultFirstSliceWait = 50 * time.Millisecond

// Proxier runs the sync loop and owns every listener. Create it with New, feed its Tracker from a
// source, and call Run.
type Proxier struct {
	opts    Options
	log     zerolog.Logger
	tracker *proxy.Tracker
	lb      *loadbalancer.RoundRobin
	alloc   *portalloc.Allocator
	runner  *syncrunner.Runner
	// routing is what every listener's chooser shares; its node addresses are replaced by each
	// sync.
	routing *routing
	// openFDs counts the process's open descriptors (openFDCount; tests replace it).
	openFDs func() (int, error)
	// testHookRecord, when set, is called as a freeze adds each record; an error fails the
	// freeze there, as running out of descriptors would (tests).
	testHookRecord func(kind string) error
	// listen is what every listener is opened with; budget is its descriptor budget (nil
	// without Limits.FileLimit), whose limit each sync updates.
	listen listenConfig
	budget *forward.Budget

	syncedOnce sync.Once
	synced     chan struct{} // closed when the source's initial state is in

	// syncMu is held by every sync, and by Freeze while it stops syncing.
	syncMu sync.Mutex

	// The following fields are owned by the sync goroutine (Run); mu guards them against readers
	// such as Ports and Close.
	mu        sync.Mutex
	ports     map[proxy.Name]*listener
	endpoints map[types.NamespacedName]proxy.EndpointsByPort
	holder    *holder
	closed    bool
	// frozen is set by Freeze: syncs do nothing until Resume.
	frozen bool
	// stash holds the listeners handed over by a predecessor (Adopt) until a sync opens them.
	stash map[listenerKey]*inherited
	// unservable are the service ports the descriptor limit left without a listener.
	unservable map[proxy.Name]bool
	// refused is the last refusal of endpoints that are the proxy itself, per service port.
	refused map[proxy.Name]string
	// lastFull is when the last successful full portal sync started, lastSweep when the last
	// sync that swept the balancer's affinity entries did; sync goroutine only.
	lastFull, lastSweep time.Time
	// last is the last sync's port states (for Ports).
	last []proxy.PortState
	// gen counts the changes to the listeners: a port added, removed or redefined, a listener
	// opened or released (see recheckGen).
	gen uint64
	// self is the proxy's own addresses, updated for the services a sync touches (see
	// selfAddrsLocked); sorted is the listeners in the order of their names, updated as they
	// come and go. A sync of one more service among 10,000 thus rebuilds neither.
	self   *selfAddrs
	sorted []*listener
	// stale is set when listeners changed outside a sync (a hand-over): the next sync rebuilds
	// self and every port's state.
	stale bool
	// recheckGen and recheckNode are gen and the node's addresses at the last periodic check
	// of every port's endpoints against the proxy's own addresses.
	recheckGen  uint64
	recheckNode []netip.Addr
	// holds keeps the preferred proxy ports from other sockets until the first sync opens
	// their listeners (see portHolds); nil from then on.
	holds *portHolds
	// triggers are the trigger times of endpoint changes handed to the balancer that wait for
	// a sync to program their rules (see programEndpoints).
	triggers []proxy.TriggerTime

	// endpointsDue holds a pending request for programEndpoints (one slot: requests merge).
	endpointsDue chan struct{}
}

// New returns a Proxier configured by opts. Nothing runs until Run.
func New(opts Options) *Proxier {
	if opts.MinSyncPeriod <= 0 {
		opts.MinSyncPeriod = time.Second
	}
	if opts.SyncPeriod <= 0 {
		opts.SyncPeriod = 30 * time.Second
	}
	if opts.FirstSliceWait == 0 {
		opts.FirstSliceWait = DefaultFirstSliceWait
	}
	if !opts.BindAddress.IsValid() {
		opts.BindAddress = netip.IPv6Unspecified()
	}
	if opts.NodeAddrs == nil {
		opts.NodeAddrs = proxy.ListNodeAddrs
	}
	p := &Proxier{
		opts:      opts,
		log:       opts.Log,
		lb:        newBalancer(opts),
		alloc:     newAllocator(opts.PortRange),
		synced:    make(chan struct{}),
		ports:     map[proxy.Name]*listener{},
		endpoints: map[types.NamespacedName]proxy.EndpointsByPort{},
		holder:    newHolder(opts.Log),
		refused:   map[proxy.Name]string{},
		stash:     map[listenerKey]*inherited{},

		unservable: map[proxy.Name]bool{},

		endpointsDue: make(chan struct{}, 1),
	}
	p.openFDs = openFDCount
	p.routing = &routing{nodeName: opts.NodeName, clusterCIDRs: opts.ClusterCIDRs}
	p.routing.transparentLocal.Store(opts.TransparentLocal)
	if lim := opts.Limits; lim.FileLimit > 0 {
		p.budget = forward.NewBudget(lim.dataPathFDs())
	}
	p.listen = listenConfig{
		alloc:       p.alloc,
		bind:        opts.BindAddress,
		udpTimeout:  opts.UDPTimeout,
		metrics:     opts.Metrics,
		budget:      p.budget,
		maxConns:    opts.Limits.ConnsPerPort(),
		maxSessions: opts.Limits.SessionsPerPort(),
		idleTimeout: opts.Limits.TCPIdleTimeout,
		preferred:   opts.PreferredPorts,
		loops:       newLoops(opts),
	}
	setAsidePreferred(p.alloc, opts.PreferredPorts)
	if prefs := opts.PreferredPorts; prefs != nil {
		most := math.MaxInt // as many as the listeners may have descriptors
		if opts.Limits.FileLimit > 0 {
			most = opts.Limits.listenerFDs()
		}
		p.holds = holdPorts(listenAddr(opts.BindAddress, 0).Addr(), prefs.Ports(), most)
	}
	p.runner = syncrunner.New(p.sync, opts.MinSyncPeriod, opts.SyncPeriod, syncBurst)
	p.tracker = proxy.NewTracker(proxy.TrackerOptions{
		Log:       opts.Log,
		OnProblem: opts.OnProblem,
		OnChange: func() {
			if opts.OnQueued != nil {
				opts.OnQueued(time.Now())
			}
			if opts.FirstSliceWait > 0 && p.tracker.AwaitsFirstSlices() {
				p.runner.TriggerWithin(opts.FirstSliceWait)
				return
			}
			p.runner.Trigger()
		},
		OnEndpointsChange: func() {
			select {
			case p.endpointsDue <- struct{}{}:
			default:
			}
		},
		OnSynced: func() {
			p.syncedOnce.Do(func() { close(p.synced) })
			p.runner.Trigger()
		},
	})
	return p
}

// newAllocator returns the allocator of proxy ports: the range, or the kernel's ephemeral range
// picked by the proxy itself (portalloc.NewLocalAllocator) when there is none.
func newAllocator(r portalloc.Range) *portalloc.Allocator {
	if r.Size == 0 {
		return portalloc.NewLocalAllocator(nil)
	}
	return portalloc.NewAllocator(r, nil)
}

// Tracker returns the source.Handler to feed with Services and EndpointSlices.
func (p *Proxier) Tracker() *proxy.Tracker { return p.tracker }

// Synced is closed once the source has delivered its initial state.
func (p *Proxier) Synced() <-chan struct{} { return p.synced }

// Run runs the sync loop, and the loop that hands endpoint changes to the balancer at once
// (programEndpoints), until ctx is done, then closes every listener (established connections
// are left to Shutdown) and returns once both loops have.
func (p *Proxier) Run(ctx context.Context) {
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-p.endpointsDue:
				p.programEndpoints()
			}
		}
	})
	p.runner.Run(ctx)
	wg.Wait()
	p.closeListeners()
}

// programEndpoints hands the pending endpoint changes to the balancer at once, without waiting
// for the rate limit of syncs (MinSyncPeriod), which is for rule writes: a userspace proxy's
// rules do not name endpoints, so most endpoint changes (a rolling update's, a scale-up's)
// change no rule. It touches only the changed services' ports. An endpoint change that does
// change a port's rules (its first or last usable endpoint, the local endpoints of a Local
// policy, a service whose listener is not open yet) triggers a sync for them; the changes'
// trigger times are then observed when that sync has programmed the rules, the others' now
// (Options.OnEndpointsProgrammed). Before the first sync, and while frozen, it leaves the
// changes to the sync.
func (p *Proxier) programEndpoints() {
	select {
	case <-p.synced:
	default:
		return
	}
	// Not syncMu: a sync holds it while it writes rules (at 10,000 service ports a full
	// sync's restore takes a second), and endpoint changes must not wait for that. mu is
	// enough: a sync drains and applies its changes under it too, and Freeze sets frozen
	// under it.
	p.mu.Lock()
	if p.closed || p.frozen || p.self == nil || p.stale {
		// The sync applies them. Before the first sync has drained anything (self is set
		// under mu as it drains) that sync is on its way (the source's initial state
		// triggered it) and takes these too; later, a sync that has drained them since they
		// were signalled has applied them. A trigger in either case would be a sync for
		// nothing that spends the rate limit's burst.
		trigger := p.self != nil && p.tracker.HasPendingEndpoints()
		p.mu.Unlock()
		if trigger {
			p.runner.Trigger()
		}
		return
	}
	start := time.Now()
	ch := p.tracker.DrainEndpoints()
	needSync := false
	for svc, c := range ch.Endpoints {
		if c.Current == nil {
			delete(p.endpoints, svc)
		} else {
			p.endpoints[svc] = c.Current
		}
		ls := p.servicePortsLocked(svc)
		if len(ls) == 0 {
			needSync = needSync || c.Current != nil && p.tracker.HasPendingService(svc)
			continue
		}
		for _, l := range ls {
			p.refreshPortLocked(l, c.Current, p.self)
			switch st := p.portStateLocked(l); {
			case !l.stateOK || !l.isOpen() || !sameRules(&l.state, &st):
				l.stateOK = false // the sync recomputes it
				needSync = true
			default:
				// What changed (a Cluster-policy port's local endpoints) is only reported:
				// the next sync publishes it.
				l.state = st
			}
		}
	}
	if needSync {
		p.triggers = append(p.triggers, ch.Triggers...)
		ch.Triggers = nil
	}
	p.mu.Unlock()
	if needSync {
		if p.opts.OnQueued != nil {
			p.opts.OnQueued(time.Now())
		}
		p.runner.Trigger()
	}
	if p.opts.OnEndpointsProgrammed != nil && len(ch.Endpoints) > 0 {
		p.opts.OnEndpointsProgrammed(proxy.EndpointsResult{Start: start, Took: time.Since(start),
			EndpointChanges: len(ch.Endpoints), Triggers: ch.Triggers})
	}
	p.log.Debug().Int("endpoints", len(ch.Endpoints)).Bool("rulesChange", needSync).Dur("took", time.Since(start)).Msg("endpoints programmed")
}

// Sync runs one sync now, on the caller's goroutine. It is for tests and must not be called
// while Run is running.
func (p *Proxier) Sync() { p.sync(true) }

// sync applies pending changes; it runs on the runner's goroutine only. The periodic sync
// rewrites every portal rule, and so does any sync once SyncPeriod has passed since the last
// full one (triggered syncs restart the runner's period, so on a busy cluster the periodic one
// might never come) — unless it has changes to apply: then it writes them and has the runner
// run again for the full one (up to twice SyncPeriod since the last); the others write only
// what changed. It returns false when it did nothing
// (the source has not delivered its initial state, or the proxier is stopped or frozen), so the
// runner's rate limit does not count it.
func (p *Proxier) sync(periodic bool) bool {
	select {
	case <-p.synced:
	default:
		p.log.Debug().Msg("sync skipped: the source has not delivered its initial state yet")
		return false
	}
	p.syncMu.Lock()
	defer p.syncMu.Unlock()
	p.mu.Lock()
	stopped := p.closed || p.frozen
	p.mu.Unlock()
	if stopped {
		return false // the changes wait in the tracker
	}
	res := proxy.SyncResult{Start: time.Now()}
	node, err := p.opts.NodeAddrs()
	if err != nil {
		p.log.Warn().Err(err).Msg("listing node addresses; keeping the previous list")
		node = p.routing.nodeAddrs()
	}
	p.routing.setNodeAddrs(node)

	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return false
	}
	// Drained under mu, as programEndpoints drains and applies: no older change is applied
	// after a newer one.
	ch := p.tracker.Drain()
	res.ServiceChanges, res.EndpointChanges = len(ch.Services), len(ch.Endpoints)
	dirty := p.applyLocked(&ch)
	res.Triggers = append(p.triggers, ch.Triggers...)
	p.triggers = nil
	var opened []*listener
	res.Unservable, opened = p.openPendingLocked(dirty)
	p.holds.releaseAll() // the ports of service ports that are gone, or left closed
	p.holds = nil
	self := p.selfAddrsLocked(node, dirty)
	if periodic && (p.recheckGen != p.gen || !slices.Equal(p.recheckNode, node.List())) {
		// Endpoints are checked against the proxy's own addresses only when their service
		// changes: once a period, all of them, for addresses other services (or the node)
		// took since the last such check. (A pass over the listeners, not every service
		// marked dirty: at 10,000 service ports a map of them all was ~1 MB of garbage.)
		for _, l := range p.sorted {
			p.refreshPortLocked(l, p.endpoints[l.choose.sp.Load().Name.Service()], self)
		}
		p.recheckGen, p.recheckNode = p.gen, node.List()
	} else {
		for svc := range dirty {
			p.refreshServiceLocked(svc, self)
		}
	}
	if len(opened) > 0 {
		p.ensurePollerLocked()
	}
	for _, l := range opened { // now that the balancer knows their endpoints
		l.start(&p.listen)
	}
	if periodic || res.Start.Sub(p.lastSweep) >= p.opts.SyncPeriod {
		// Expired affinity entries are never used; sweeping frees their memory, in a pass over
		// every port: once a period, not on every partial sync (on a busy cluster the periodic
		// sync may never come, hence the clock).
		p.lb.Sweep()
		p.lastSweep = res.Start
	}
	res.Ports = p.portStatesLocked(dirty, periodic || p.stale || ch.ZoneChanged)
	p.stale = false
	p.last = res.Ports
	if p.opts.HoldPorts {
		p.holder.reconcile(res.Ports, node)
	}
	p.updateBudgetLocked()
	p.dropInheritedLocked()
	p.mu.Unlock()

	followUp := false
	if p.opts.Portals != nil {
		res.Kind = proxy.SyncPartial
		switch since := time.Since(p.lastFull); {
		case periodic:
			res.Kind = proxy.SyncFull
		case since >= p.opts.SyncPeriod && res.ServiceChanges+res.EndpointChanges > 0 && since < 2*p.opts.SyncPeriod:
			// A full sync is due by the clock, but changes are waiting: they go first, as a
			// partial sync (at 10,000 service ports tens of milliseconds, not a second), and
			// the full one follows as the next run.
			followUp = true
		case since >= p.opts.SyncPeriod:
			res.Kind = proxy.SyncFull
		}
		if res.Err = p.opts.Portals.Sync(context.Background(), res.Ports, node, res.Kind == proxy.SyncFull); res.Err != nil {
			p.log.Error().Err(res.Err).Msg("programming portals failed; retrying at the next sync")
		} else if res.Kind == proxy.SyncFull {
			p.lastFull = res.Start
		}
		if r, ok := p.opts.Portals.(retryingPortals); ok && p.runner != nil {
			if at, due := r.RetryDue(); due {
				p.runner.TriggerWithin(max(time.Until(at), 0))
			}
		}
	}
	res.Took = time.Since(res.Start)
	if p.opts.OnSynced != nil {
		p.opts.OnSynced(res)
	}
	p.log.Debug().Dur("took", res.Took).Stringer("kind", res.Kind).Int("services", res.ServiceChanges).
		Int("endpoints", res.EndpointChanges).Int("ports", len(res.Ports)).Msg("synced")
	if followUp && p.runner != nil {
		p.runner.Trigger()
	}
	return true
}

// applyLocked applies drained changes to the port and endpoint maps and returns the services
// whose ports or endpoints changed, and those whose listener is still to be opened.
func (p *Proxier) applyLocked(ch *proxy.Changes) map[types.NamespacedName]bool {
	dirty := make(map[types.NamespacedName]bool, max(len(ch.Services), len(ch.Endpoints)))
	if ch.ZoneChanged {
		// Before the ports: SetServicePort below then already works with the new zone.
		p.log.Info().Str("zone", ch.Zone).Msg("this node's zone changed; re-applying topology hints")
		p.lb.SetZone(ch.Zone)
	}
	var added []*listener
	for svc, c := range ch.Services {
		dirty[svc] = true
		for _, sp := range c.Previous {
			if c.Current.Get(sp.Name.Port) == nil {
				p.removePortLocked(sp.Name)
			}
		}
		for _, sp := range c.Current {
			p.upsertPortLocked(sp, &added)
		}
	}
	p.insertSortedLocked(added)
	for svc, c := range ch.Endpoints {
		dirty[svc] = true
		if c.Current == nil {
			delete(p.endpoints, svc)
		} else {
			p.endpoints[svc] = c.Current
		}
	}
	// Ports whose listener failed to open are retried on every sync.
	for name, l := range p.ports {
		if !l.isOpen() {
			dirty[name.Service()] = true
		}
	}
	return dirty
}

// upsertPortLocked creates the port's listener, or updates an existing one in place. A
// listener survives every change but one of protocol. A new listener goes into *added, not yet
// into p.sorted: the caller puts them all there at once (insertSortedLocked).
func (p *Proxier) upsertPortLocked(sp *proxy.ServicePort, added *[]*listener) {
	if l, ok := p.ports[sp.Name]; ok {
		if l.protocol() == sp.Protocol {
			l.choose.sp.Store(sp)
			p.gen++
			return
		}
		p.removePortLocked(sp.Name)
	}
	l := &listener{
		log:    &p.log,
		key:    sp.Name.String(),
		choose: chooser{lb: p.lb, routing: p.routing},
	}
	l.choose.sp.Store(sp)
	p.ports[sp.Name] = l
	p.gen++
	*added = append(*added, l)
}

// insertSortedLocked puts the new listeners ls (those still in p.ports) into p.sorted, in
// order: a few one by one, many in one merge. (One by one, a start's 10,000 moved half the
// list each: ~200 MB of memory moved.)
func (p *Proxier) insertSortedLocked(ls []*listener) {
	ls = slices.DeleteFunc(ls, func(l *listener) bool { return p.ports[l.choose.sp.Load().Name] != l })
	byKey := func(a, b *listener) int { return strings.Compare(a.key, b.key) }
	if len(ls) <= 16 {
		for _, l := range ls {
			if i, found := p.sortedIndexLocked(l.key); !found {
				p.sorted = slices.Insert(p.sorted, i, l)
			}
		}
		return
	}
	slices.SortFunc(ls, byKey)
	merged := make([]*listener, 0, len(p.sorted)+len(ls))
	old := p.sorted
	for len(old) > 0 && len(ls) > 0 {
		switch c := byKey(old[0], ls[0]); {
		case c < 0:
			merged, old = append(merged, old[0]), old[1:]
		case c > 0:
			merged, ls = append(merged, ls[0]), ls[1:]
		default: // never: a key is in p.ports once
			merged, old, ls = append(merged, ls[0]), old[1:], ls[1:]
		}
	}
	p.sorted = append(append(merged, old...), ls...)
}

func (p *Proxier) removePortLocked(name proxy.Name) {
	l, ok := p.ports[name]
	if !ok {
		return
	}
	delete(p.ports, name)
	if i, found := p.sortedIndexLocked(l.key); found {
		p.sorted = slices.Delete(p.sorted, i, i+1)
	}
	if p.self != nil {
		p.self.drop(l)
	}
	p.gen++
	delete(p.refused, name)
	delete(p.unservable, name)
	p.lb.DeleteServicePort(name)
	l.close(p.alloc, p.opts.Metrics)
	l.logInfo().Msg("closed proxy listener")
}

// updateBudgetLocked gives the data path what the file limit leaves after the reserve and the
// descriptors the listeners and held ports hold (a UDP listener also holds a conntrack socket).
func (p *Proxier) updateBudgetLocked() {
	if p.budget == nil {
		return
	}
	control := len(p.holder.held)
	for _, l := range p.ports {
		switch {
		case l.udp != nil:
			control += 2
		case l.tcp != nil:
			control++
		}
	}
	p.budget.SetLimit(p.opts.Limits.dataPathFDs() - control)
}

// Budget returns the data path's descriptor budget (nil without Limits.FileLimit), for metrics.
func (p *Proxier) Budget() *forward.Budget { return p.budget }

// openPendingLocked opens the listeners of the dirty services that are not open yet (every
// listener not open is dirty), as many as the descriptor limit leaves room for, in the order of
// their names, and returns how many it left closed for lack of descriptors (their portals
// reject; they are opened once descriptors free up) and the listeners it opened, which the
// caller starts once their endpoints are in the balancer.
func (p *Proxier) openPendingLocked(dirty map[types.NamespacedName]bool) (int, []*listener) {
	var pending []*listener
	for svc := range dirty {
		for _, l := range p.servicePortsLocked(svc) {
			if !l.isOpen() {
				pending = append(pending, l)
			}
		}
	}
	if len(pending) == 0 {
		p.noteUnservableLocked(nil)
		return 0, nil
	}
	room := p.listenerRoomLocked()
	total := 0
	for _, l := range pending {
		total += listenerFDs(l.protocol())
	}
	if total > room { // which ones are left closed goes by name (without a limit, none is)
		names := make(map[*listener]string, len(pending))
		for _, l := range pending {
			names[l] = l.choose.sp.Load().String()
		}
		slices.SortFunc(pending, func(a, b *listener) int { return strings.Compare(names[a], names[b]) })
	}
	var open, over []*listener
	for _, l := range pending {
		if need := listenerFDs(l.protocol()); need <= room {
			room -= need
			open = append(open, l)
		} else {
			over = append(over, l)
		}
	}
	opened := p.openAllLocked(open)
	p.noteUnservableLocked(over)
	return len(over), opened
}

// listenerFDs is what a listener holds: its socket, and for UDP a conntrack socket.
func listenerFDs(proto v1.Protocol) int {
	if proto == v1.ProtocolUDP {
		return 2
	}
	return 1
}

// listenerRoomLocked returns how many more descriptors listeners may take: what
// Limits.listenerFDs allows less what the open listeners and the held ports hold. Without a
// file limit, no bound.
func (p *Proxier) listenerRoomLocked() int {
	if p.budget == nil {
		return math.MaxInt
	}
	room := p.opts.Limits.listenerFDs() - len(p.holder.held)
	for _, l := range p.ports {
		if l.isOpen() {
			room -= listenerFDs(l.protocol())
		}
	}
	return max(room, 0)
}

// openAllLocked opens ls, in chunks of 64 on up to GOMAXPROCS goroutines at a time (the socket
// calls of 10,000 listeners take about half a second on one core), and returns those it opened.
func (p *Proxier) openAllLocked(ls []*listener) []*listener {
	p.takeInheritedLocked(ls)
	var opened atomic.Int64
	var g errgroup.Group
	g.SetLimit(runtime.GOMAXPROCS(0))
	for chunk := range slices.Chunk(ls, 64) {
		g.Go(func() error {
			for _, l := range chunk {
				if p.openLocked(l) {
					opened.Add(1)
				}
			}
			return nil
		})
	}
	_ = g.Wait() // the chunks return no error
	if n := opened.Load(); n > 0 {
		p.gen++
		p.log.Info().Int64("listeners", n).Int("servicePorts", len(p.ports)).Msg("opened proxy listeners")
	}
	out := make([]*listener, 0, opened.Load())
	for _, l := range ls {
		if l.isOpen() && !l.started {
			out = append(out, l)
		}
	}
	return out
}

// noteUnservableLocked logs the service ports the descriptor limit leaves without a listener:
// an error for each port once, when it becomes unservable, and a summary whenever their number
// changes; over is this sync's list (nil: none).
func (p *Proxier) noteUnservableLocked(over []*listener) {
	now := make(map[proxy.Name]bool, len(over))
	for _, l := range over {
		name := l.choose.sp.Load().Name
		now[name] = true
		if !p.unservable[name] {
			l.logError().Int("openFilesLimit", p.opts.Limits.FileLimit).
				Msg("service port not served: the open-files limit leaves no descriptor for its listener (its portals reject); raise the limit (RLIMIT_NOFILE) or lower --fd-reserve")
			p.problem(l, proxy.ReasonDescriptorLimit, fmt.Sprintf("the open-files limit (%d) leaves no descriptor for its listener: its traffic is rejected until descriptors free up (raise RLIMIT_NOFILE or lower --fd-reserve)", p.opts.Limits.FileLimit))
		}
	}
	for name := range p.unservable {
		if !now[name] {
			if l := p.ports[name]; l != nil && l.isOpen() {
				l.logInfo().Msg("service port served again: descriptors freed up for its listener")
			}
		}
	}
	if len(now) != len(p.unservable) {
		ev := p.log.Info()
		if len(now) > 0 {
			ev = p.log.Error()
		}
		lim := p.opts.Limits
		ev.Int("servicePorts", len(p.ports)).Int("unservable", len(now)).Int("openFilesLimit", lim.FileLimit).
			Int("reserve", lim.ReserveFDs()).Int("maxListenerDescriptors", lim.listenerFDs()).
			Msgf("the open-files limit lets the proxy serve %d of %d service ports", len(p.ports)-len(now), len(p.ports))
	}
	p.unservable = now
}

// refreshServiceLocked hands the current endpoints of svc's ports to the load balancer and the
// UDP sessions, leaving out endpoints that are the proxy itself (self).
func (p *Proxier) refreshServiceLocked(svc types.NamespacedName, self *selfAddrs) {
	eps := p.endpoints[svc]
	for _, l := range p.servicePortsLocked(svc) {
		p.refreshPortLocked(l, eps, self)
	}
}

// refreshPortLocked is refreshServiceLocked for one listener; eps are its service's endpoints.
// It allocates nothing when the balancer has the port's endpoints already.
func (p *Proxier) refreshPortLocked(l *listener, eps proxy.EndpointsByPort, self *selfAddrs) {
	sp := l.choose.sp.Load()
	name := sp.Name
	list, err := self.filter(sp, eps.Get(name.Port))
	p.noteRefusedLocked(name, err)
	if sp == l.balanced && slices.Equal(list, l.endpoints) {
		return // the periodic recheck found nothing new: the balancer has it all
	}
	p.lb.SetServicePort(sp, list)
	l.endpoints, l.balanced = list, sp
	l.endpointsChanged(list)
	if m := p.opts.Metrics; m != nil {
		m.KeepEndpoints(name, sp.Protocol, func(ep netip.AddrPort) bool {
			return slices.ContainsFunc(list, func(e proxy.Endpoint) bool { return e.Addr == ep })
		})
	}
}

// noteRefusedLocked logs the endpoints of a service port refused as the proxy itself, once per
// distinct refusal, and when they are gone.
func (p *Proxier) noteRefusedLocked(name proxy.Name, err error) {
	prev, had := p.refused[name]
	switch {
	case err == nil && had:
		delete(p.refused, name)
		p.log.Info().Stringer("servicePort", name).Msg("no endpoint refused any more")
	case err != nil && (!had || prev != err.Error()):
		p.refused[name] = err.Error()
		p.log.Error().Err(err).Msg("endpoints that point back at the proxy refused; the service port's other endpoints are used")
		if l := p.ports[name]; l != nil {
			p.problem(l, proxy.ReasonEndpointRefused, err.Error()+"; they are left out, the port's other endpoints are used")
		}
	}
}

// openLocked opens l and reports whether it did; it may run on several goroutines at once, for
// distinct listeners.
func (p *Proxier) openLocked(l *listener) bool {
	if prefs := p.opts.PreferredPorts; prefs != nil {
		sp := l.choose.sp.Load()
		p.holds.release(prefs.Port(sp.Name, sp.Protocol))
	}
	if err := l.open(&p.listen); err != nil {
		l.logError().Err(err).Msg("cannot open the proxy listener; retrying at the next sync")
		reason, msg := proxy.ReasonListenFailed, "cannot open its listener: "+err.Error()
		if errors.Is(err, portalloc.ErrExhausted) {
			reason, msg = proxy.ReasonProxyPortExhausted, "no port of --proxy-port-range "+p.alloc.Range().String()+" is free for its listener"
		}
		if l.problem != reason {
			l.problem = reason
			p.problem(l, reason, msg+": its traffic is rejected; retried at each sync")
		}
		return false
	}
	l.problem = ""
	l.logDebug().Int("proxyPort", l.proxyPort).Msg("opened proxy listener")
	return true
}

// problem reports a Problem of l's service port to Options.OnProblem.
func (p *Proxier) problem(l *listener, reason, msg string) {
	if p.opts.OnProblem == nil {
		return
	}
	sp := l.choose.sp.Load()
	p.opts.OnProblem(proxy.Problem{
		Service: types.NamespacedName{Namespace: sp.Name.Namespace, Name: sp.Name.Name},
		Reason:  reason,
		Message: fmt.Sprintf("port %q (%s %d): %s", sp.Name.Port, sp.Protocol, sp.Port, msg),
	})
}

// portStatesLocked returns every port's state, in the order of their names: recomputed for
// the ports of the dirty services, or of all services with all, and as the last sync left it
// for the others. (What a state depends on changes only with its service: its definition,
// endpoints and listener. A change of zone, or of listeners outside a sync, asks for all; so
// does the periodic sync, which thus repairs whatever this reasoning missed.) When every state
// is the last sync's, it returns the last sync's slice (p.last) itself, which nobody modifies:
// an idle periodic sync allocates nothing here (a new slice was ~0.6 MB at 10,000 ports).
func (p *Proxier) portStatesLocked(dirty map[types.NamespacedName]bool, all bool) []proxy.PortState {
	var out []proxy.PortState // nil while every state so far is p.last's
	same := len(p.last) == len(p.sorted)
	for i, l := range p.sorted {
		sp := l.choose.sp.Load()
		if all || !l.stateOK || dirty[sp.Name.Service()] {
			l.state, l.stateOK = p.portStateLocked(l), true
		}
		if out == nil && (!same || !sameState(&p.last[i], &l.state)) {
			if !same {
				i = 0 // the last sync's list had other ports: none of it is kept
			}
			out = append(make([]proxy.PortState, 0, len(p.sorted)), p.last[:i]...)
		}
		if out != nil {
			out = append(out, l.state)
		}
	}
	switch {
	case out != nil:
		return out
	case same && p.last != nil:
		return p.last
	}
	return []proxy.PortState{}
}

// portStateLocked returns l's state as of its balancer's endpoints.
func (p *Proxier) portStateLocked(l *listener) proxy.PortState {
	sp := l.choose.sp.Load()
	av := p.lb.Availability(sp.Name)
	st := proxy.PortState{
		ServicePort:    sp,
		ProxyPort:      l.proxyPort,
		LocalEndpoints: av.LocalEndpoints,
		LocalReady:     localReady(l.endpoints, p.opts.NodeName, l.state.LocalReady),
	}
	st.Internal, st.External = actions(av, l.isOpen())
	return st
}

// sameRules reports whether the portals' rules and the health checks are the same for states a
// and b of one port: the same actions and proxy port, and for a port with a Local external
// policy (whose health check counts the ready local endpoints) the same local endpoints.
func sameRules(a, b *proxy.PortState) bool {
	if a.ServicePort != b.ServicePort || a.ProxyPort != b.ProxyPort || a.Internal != b.Internal || a.External != b.External {
		return false
	}
	return !b.ServicePort.ExternalPolicyLocal || a.LocalEndpoints == b.LocalEndpoints && slices.Equal(a.LocalReady, b.LocalReady)
}

// sameState reports whether a and b are the same state (LocalReady compared by content).
func sameState(a, b *proxy.PortState) bool {
	return a.ServicePort == b.ServicePort && a.ProxyPort == b.ProxyPort && a.Internal == b.Internal &&
		a.External == b.External && a.LocalEndpoints == b.LocalEndpoints && slices.Equal(a.LocalReady, b.LocalReady)
}

// servicePortsLocked returns the listeners of svc's ports: a run of p.sorted, as their keys
// ("namespace/name:port") all start with "namespace/name:" (a namespace holds no "/", a name no
// ":"). A run of the sorted list rather than a map by service: ~100 bytes per service less. The
// caller must not change p.sorted while it uses the run.
func (p *Proxier) servicePortsLocked(svc types.NamespacedName) []*listener {
	prefix := svc.Namespace + "/" + svc.Name + ":"
	i, _ := p.sortedIndexLocked(prefix)
	j := i
	for j < len(p.sorted) && strings.HasPrefix(p.sorted[j].key, prefix) {
		j++
	}
	return p.sorted[i:j:j]
}

// sortedIndexLocked returns where the listener named key is, or would be, in p.sorted.
func (p *Proxier) sortedIndexLocked(key string) (int, bool) {
	return slices.BinarySearchFunc(p.sorted, key, func(l *listener, key string) int { return strings.Compare(l.key, key) })
}

// selfAddrsLocked returns the proxy's own addresses as of this sync (node is its snapshot of
// the node's addresses): updated for the listeners of the dirty services (a removed listener's
// are dropped as it goes), or rebuilt when stale or two ports share an address.
func (p *Proxier) selfAddrsLocked(node proxy.NodeAddrs, dirty map[types.NamespacedName]bool) *selfAddrs {
	if p.self == nil || p.self.collided || p.stale {
		p.self = newSelfAddrs(p.ports, node)
	} else {
		for svc := range dirty {
			for _, l := range p.servicePortsLocked(svc) {
				p.self.drop(l)
				p.self.add(l)
			}
		}
	}
	p.self.node = node
	return p.self
}

// actions decides what the portals do with new traffic of each class: reject it when no
// endpoint is usable at all (or there is no listener to send it to), drop a class whose Local
// policy leaves it no endpoint on this node, redirect it otherwise.
func actions(av loadbalancer.Availability, open bool) (internal, external proxy.Action) {
	if !open || !av.Any {
		return proxy.Reject, proxy.Reject
	}
	internal, external = proxy.Redirect, proxy.Redirect
	if !av.Internal {
		internal = proxy.Drop
	}
	if !av.External {
		external = proxy.Drop
	}
	return internal, external
}

// localReady returns the distinct IPs of the ready endpoints on node, in the order of eps: was
// itself (no allocation) when they are was's.
func localReady(eps []proxy.Endpoint, node string, was []netip.Addr) []netip.Addr {
	n := 0 // the IPs found so far are was[:n]
	for _, e := range eps {
		if node == "" || e.NodeName != node || !e.Ready || slices.Contains(was[:n], e.Addr.Addr()) {
			continue
		}
		if n == len(was) || was[n] != e.Addr.Addr() {
			n = -1
			break
		}
		n++
	}
	if n == len(was) {
		return was
	}
	var out []netip.Addr
	for _, e := range eps {
		if node != "" && e.NodeName == node && e.Ready && !slices.Contains(out, e.Addr.Addr()) {
			out = append(out, e.Addr.Addr())
		}
	}
	return out
}

// SetTransparentLocal turns transparent connections (Options.TransparentLocal) on or off for
// the connections accepted from then on: a start enables them once the reply routing is
// programmed, which it does after the first sync so as to serve sooner.
func (p *Proxier) SetTransparentLocal(on bool) { p.routing.transparentLocal.Store(on) }

// Ports returns the state of every service port as of the last sync, sorted by name.
func (p *Proxier) Ports() []proxy.PortState {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.last
}

// closeListeners stops accepting on every listener and releases held ports.
func (p *Proxier) closeListeners() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	p.closed = true
	p.holds.releaseAll()
	p.holds = nil
	for _, l := range p.ports {
		l.stopAccepting()
	}
	p.holder.closeAll()
	if p.listen.poller != nil {
		_ = p.listen.poller.Close() // no listener is watched any more
		p.listen.poller = nil
	}
}

// ensurePollerLocked creates the Poller of idle UDP listeners (listenConfig.poller) unless there
// is one; without it (epoll unavailable, no descriptor left) every read loop keeps a goroutine.
func (p *Proxier) ensurePollerLocked() {
	if p.listen.poller != nil || p.closed {
		return
	}
	poller, err := udp.NewPoller()
	if err != nil {
		p.log.Warn().Err(err).Msg("idle listeners keep a goroutine each")
		return
	}
	p.listen.poller = poller
}

// Shutdown waits for established connections to finish until ctx is done, then cuts the rest.
// Call it after Run has returned.
func (p *Proxier) Shutdown(ctx context.Context) error {
	p.closeListeners()
	p.mu.Lock()
	ls := make([]*listener, 0, len(p.ports))
	for _, l := range p.ports {
		ls = append(ls, l)
	}
	p.mu.Unlock()
	var errs []error
	for _, l := range ls {
		if err := l.shutdown(ctx); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", l.choose.sp.Load(), err))
		}
		l.release(p.alloc)
	}
	if loops := p.listen.loops; loops != nil {
		_ = loops.Close() // after the proxies: their connections have ended or been cut
	}
	return errors.Join(errs...)
}

// routing is what the choosers of all listeners share: this node's identity and addresses.
type routing struct {
	nodeName         string
	transparentLocal atomic.Bool // Options.TransparentLocal, or SetTransparentLocal
	clusterCIDRs     []netip.Prefix
	// node is the last sync's snapshot of the node's addresses.
	node atomic.Pointer[proxy.NodeAddrs]
}

func (r *routing) setNodeAddrs(a proxy.NodeAddrs) { r.node.Store(&a) }

func (r *routing) nodeAddrs() proxy.NodeAddrs {
	if a := r.node.Load(); a != nil {
		return *a
	}
	return proxy.NodeAddrs{}
}

// isNodeAddr reports whether a is a loopback address or one of the node's own addresses (as of
// the last sync).
func (r *routing) isNodeAddr(a netip.Addr) bool {
	a = a.Unmap()
	return a.IsLoopback() || r.nodeAddrs().Contains(a)
}

// inCluster reports whether a belongs to the cluster rather than to an outside client: a
// loopback address, one of the node's own addresses (as of the last sync), or a pod's address
// (Options.ClusterCIDRs).
func (r *routing) inCluster(a netip.Addr) bool {
	if r.isNodeAddr(a) {
		return true
	}
	a = a.Unmap()
	for _, c := range r.clusterCIDRs {
		if c.Contains(a) {
			return true
		}
	}
	return false
}
