package proxy

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/loadbalancer"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/portal"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/portalloc"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/serviceport"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/syncrunner"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/tracker"
)

// PortState is one service port as the portals need it.
type PortState struct {
	ServicePort *serviceport.ServicePort
	// ProxyPort is the port of the proxy's listener; 0 while it could not be opened (the portals
	// then reject the port's traffic rather than redirect it nowhere).
	ProxyPort int
	// Internal applies to ClusterIP traffic, External to NodePort, externalIP and LB IP traffic.
	Internal, External portal.Action
	// LocalEndpoints counts the endpoints on this node that external Local traffic may use.
	LocalEndpoints int
	// LocalReady lists the distinct IPs of this port's ready endpoints on this node. The
	// healthCheckNodePort server counts these per service, as kube-proxy does: an endpoint that
	// is only serving and terminating still receives traffic but no longer makes the node
	// healthy, so load balancers drain the node while its connections finish.
	LocalReady []netip.Addr
}

// Portals programs the rules that send service traffic to the proxy's listeners.
type Portals interface {
	// Sync makes the rules match ports exactly (the complete desired state). With full set it
	// rewrites every rule, repairing whatever someone else changed; otherwise it may write only
	// what changed since its last successful sync.
	Sync(ctx context.Context, ports []PortState, full bool) error
}

// SyncObserver is told about every sync; the metrics and health servers implement it.
type SyncObserver interface {
	// SyncDone reports a finished sync: when it started, how long it took, the time of the oldest
	// change it applied (zero if none), and its error.
	SyncDone(start time.Time, took time.Duration, oldestChange time.Time, err error)
	// ChangeQueued reports that a change is waiting for the next sync.
	ChangeQueued(at time.Time)
	// PortsSynced hands the new state of all service ports after a sync.
	PortsSynced(ports []PortState)
}

// SyncModeObserver is optionally implemented by a SyncObserver that tells full portal syncs from
// partial ones (kube-proxy's kubeproxy_sync_{full,partial}_proxy_rules_duration_seconds). It is
// called before SyncDone, for syncs that programmed portals.
type SyncModeObserver interface {
	SyncModeDone(full bool, took time.Duration)
}

// ChangeCounter is optionally implemented by a SyncObserver that counts the changes each sync
// applied (kube-proxy's sync_proxy_rules_{service,endpoint}_changes_total metrics). It is called
// before SyncDone with the number of services whose definition changed and the number of
// services whose endpoints changed since the previous sync.
type ChangeCounter interface {
	ChangesApplied(services, endpoints int)
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
	// Portals programs rules; nil means none (--portal-mode none: only the listeners).
	Portals Portals
	// HoldPorts, when set, holds NodePorts and local portal IP:ports with real sockets.
	HoldPorts bool
	// Observer, if set, is told about syncs.
	Observer SyncObserver
	// Metrics, if set, receives per-service-port traffic events.
	Metrics TrafficMetrics
	// LocalAddrs lists the node's own addresses (for holding local portal IPs); nil means the
	// addresses of all interfaces.
	LocalAddrs func() ([]netip.Addr, error)
	// TransparentLocal dials endpoints from the client's own address (forward.Target.Transparent)
	// for external traffic of externalTrafficPolicy: Local services to endpoints on this node
	// (NodeName), so they see the real client. It needs the reply routing of package
	// portal/transparent. False dials from the node's address, as the userspace proxy always did.
	TransparentLocal bool
	// ClusterCIDRs are the pods' addresses (kube-proxy's --cluster-cidr). Pods reaching a
	// NodePort, externalIP or load-balancer IP of an externalTrafficPolicy: Local service are
	// served by any endpoint, as the node itself is: their traffic is in-cluster, and kube-proxy
	// sends it to the cluster-wide endpoints too. Empty: only the node's own traffic is.
	ClusterCIDRs []netip.Prefix
}

// Proxier runs the sync loop and owns every listener. Create it with New, feed its Tracker from a
// source, and call Run.
type Proxier struct {
	opts    Options
	log     zerolog.Logger
	tracker *tracker.Tracker
	lb      *loadbalancer.RoundRobin
	alloc   *portalloc.Allocator
	runner  *syncrunner.Runner

	syncedOnce sync.Once
	synced     chan struct{} // closed when the source's initial state is in

	// The following fields are owned by the sync goroutine (Run); mu guards them against readers
	// such as Ports and Close.
	mu        sync.Mutex
	ports     map[serviceport.Name]*listener
	endpoints map[types.NamespacedName]tracker.Endpoints
	holder    *holder
	closed    bool
	// zone is this node's zone as last drained from the tracker ("" unknown).
	zone string
	// localAddrs is the set of the node's own addresses, refreshed at every sync and read per
	// connection by listener.Choose (traffic the node itself sends ignores a Local external
	// policy, as in kube-proxy).
	localAddrs atomic.Pointer[map[netip.Addr]bool]
	// syncs counts finished syncs (for tests).
	syncs int
	// lastFull is when the last successful full portal sync started; sync goroutine only.
	lastFull time.Time
}

// New returns a Proxier. Nothing runs until Run.
// syncBurst is how many syncs may follow each other before MinSyncPeriod applies: 2, as in
// kube-proxy's iptables mode, so that a Service and its EndpointSlice created together are both
// programmed at once.
const syncBurst = 2

func New(opts Options) *Proxier {
	if opts.MinSyncPeriod <= 0 {
		opts.MinSyncPeriod = time.Second
	}
	if opts.SyncPeriod <= 0 {
		opts.SyncPeriod = 30 * time.Second
	}
	if !opts.BindAddress.IsValid() {
		opts.BindAddress = netip.IPv6Unspecified()
	}
	p := &Proxier{
		opts:      opts,
		log:       opts.Log,
		lb:        loadbalancer.New(loadbalancer.Options{NodeName: opts.NodeName, Log: opts.Log}),
		alloc:     portalloc.NewAllocator(opts.PortRange, nil),
		synced:    make(chan struct{}),
		ports:     map[serviceport.Name]*listener{},
		endpoints: map[types.NamespacedName]tracker.Endpoints{},
	}
	p.holder = newHolder(opts.Log, opts.LocalAddrs)
	p.runner = syncrunner.New(p.sync, opts.MinSyncPeriod, opts.SyncPeriod, syncBurst)
	p.tracker = tracker.New(tracker.Options{
		Log: opts.Log,
		OnChange: func() {
			if opts.Observer != nil {
				opts.Observer.ChangeQueued(time.Now())
			}
			p.runner.Trigger()
		},
		OnSynced: func() {
			p.syncedOnce.Do(func() { close(p.synced) })
			p.runner.Trigger()
		},
	})
	return p
}

// Tracker returns the source.Handler to feed with Services and EndpointSlices.
func (p *Proxier) Tracker() *tracker.Tracker { return p.tracker }

// Synced is closed once the source has delivered its initial state.
func (p *Proxier) Synced() <-chan struct{} { return p.synced }

// Run runs the sync loop until ctx is done, then closes every listener (established connections
// are left to Shutdown) and returns.
func (p *Proxier) Run(ctx context.Context) {
	p.runner.Run(ctx)
	p.closeListeners()
}

// Sync runs one sync now, on the caller's goroutine. It is for tests and must not be called
// while Run is running.
func (p *Proxier) Sync() { p.sync(true) }

// sync applies pending changes; it runs on the runner's goroutine only. The periodic sync
// rewrites every portal rule, and so does any sync once SyncPeriod has passed since the last
// full one (triggered syncs restart the runner's period, so on a busy cluster the periodic one
// might never come); the others write only what changed.
func (p *Proxier) sync(periodic bool) {
	select {
	case <-p.synced:
	default:
		p.log.Debug().Msg("sync skipped: the source has not delivered its initial state yet")
		return
	}
	start := time.Now()
	ch := p.tracker.Drain()

	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	dirty := p.applyLocked(&ch)
	// Ports whose listener failed to open are retried on every sync.
	for name, l := range p.ports {
		if l.proxyPort == 0 {
			dirty[name.Service()] = true
		}
	}
	for svc := range dirty {
		p.refreshServiceLocked(svc)
	}
	p.lb.Sweep()
	p.refreshLocalAddrs()
	states := p.portStatesLocked()
	if p.opts.HoldPorts {
		p.holder.reconcile(states)
	}
	p.syncs++
	p.mu.Unlock()

	var err error
	programmed, full := false, false
	if p.opts.Portals != nil {
		programmed = true
		full = periodic || time.Since(p.lastFull) >= p.opts.SyncPeriod
		if err = p.opts.Portals.Sync(context.Background(), states, full); err != nil {
			p.log.Error().Err(err).Msg("programming portals failed; retrying at the next sync")
		} else if full {
			p.lastFull = start
		}
	}
	took := time.Since(start)
	if p.opts.Observer != nil {
		if cc, ok := p.opts.Observer.(ChangeCounter); ok {
			cc.ChangesApplied(len(ch.Services), len(ch.Endpoints))
		}
		if sm, ok := p.opts.Observer.(SyncModeObserver); ok && programmed {
			sm.SyncModeDone(full, took)
		}
		p.opts.Observer.PortsSynced(states)
		p.opts.Observer.SyncDone(start, took, ch.Oldest, err)
	}
	p.log.Debug().Dur("took", took).Int("services", len(ch.Services)).Int("endpoints", len(ch.Endpoints)).
		Int("ports", len(states)).Msg("synced")
}

// applyLocked applies drained changes to the port and endpoint maps and returns the services
// whose ports or endpoints changed.
func (p *Proxier) applyLocked(ch *tracker.Changes) map[types.NamespacedName]bool {
	dirty := map[types.NamespacedName]bool{}
	if ch.ZoneChanged {
		// Before the ports: SetServicePort below then already works with the new zone.
		p.log.Info().Str("zone", ch.Zone).Str("previousZone", p.zone).Msg("this node's zone changed; re-applying topology hints")
		p.zone = ch.Zone
		p.lb.SetZone(ch.Zone)
	}
	for svc, c := range ch.Services {
		dirty[svc] = true
		for portName, sp := range c.Previous {
			if c.Current[portName] == nil {
				p.removePortLocked(sp.Name)
			}
		}
		for _, sp := range c.Current {
			p.upsertPortLocked(sp)
		}
	}
	for svc, c := range ch.Endpoints {
		dirty[svc] = true
		if c.Current == nil {
			delete(p.endpoints, svc)
		} else {
			p.endpoints[svc] = c.Current
		}
	}
	return dirty
}

// upsertPortLocked creates the port's listener, or updates an existing one in place. A
// listener survives every change but one of protocol.
func (p *Proxier) upsertPortLocked(sp *serviceport.ServicePort) {
	if l, ok := p.ports[sp.Name]; ok {
		if l.protocol() == sp.Protocol {
			l.sp.Store(sp)
			return
		}
		p.removePortLocked(sp.Name)
	}
	l := &listener{proxier: p, log: p.log.With().Str("servicePort", sp.String()).Logger()}
	l.sp.Store(sp)
	p.ports[sp.Name] = l
	p.openLocked(l)
}

func (p *Proxier) openLocked(l *listener) {
	if err := l.open(p.alloc, p.opts.BindAddress, p.opts.UDPTimeout, p.opts.Metrics); err != nil {
		l.log.Error().Err(err).Msg("cannot open the proxy listener; retrying at the next sync")
		return
	}
	l.log.Info().Int("proxyPort", l.proxyPort).Msg("opened proxy listener")
}

func (p *Proxier) removePortLocked(name serviceport.Name) {
	l, ok := p.ports[name]
	if !ok {
		return
	}
	delete(p.ports, name)
	p.lb.DeleteServicePort(name)
	l.close(p.alloc)
	l.log.Info().Msg("closed proxy listener")
}

// refreshServiceLocked hands the current ports and endpoints of svc to the load balancer and the
// UDP sessions, and retries listeners that failed to open.
func (p *Proxier) refreshServiceLocked(svc types.NamespacedName) {
	eps := p.endpoints[svc]
	for name, l := range p.ports {
		if name.Service() != svc {
			continue
		}
		if l.proxyPort == 0 {
			p.openLocked(l)
		}
		list := eps[name.Port]
		p.lb.SetServicePort(l.sp.Load(), list)
		l.endpointsChanged(list)
	}
}

// portStatesLocked returns the desired portal state of every service port, sorted by name.
func (p *Proxier) portStatesLocked() []PortState {
	out := make([]PortState, 0, len(p.ports))
	for name, l := range p.ports {
		sp := l.sp.Load()
		eps := p.endpoints[name.Service()][name.Port]
		st := PortState{ServicePort: sp, ProxyPort: l.proxyPort}
		st.Internal, st.External = actions(sp, eps, loadbalancer.Node{Name: p.opts.NodeName, Zone: p.zone})
		st.LocalEndpoints = loadbalancer.LocalEndpoints(sp, eps, p.opts.NodeName)
		st.LocalReady = localReady(eps, p.opts.NodeName)
		if l.proxyPort == 0 {
			st.Internal, st.External = portal.Reject, portal.Reject
		}
		out = append(out, st)
	}
	sortPortStates(out)
	return out
}

// actions decides what the portals do with new traffic of each class.
func actions(sp *serviceport.ServicePort, eps []serviceport.Endpoint, node loadbalancer.Node) (internal, external portal.Action) {
	cluster := *sp
	cluster.InternalPolicyLocal, cluster.ExternalPolicyLocal = false, false
	if len(loadbalancer.Usable(&cluster, eps, node, false)) == 0 {
		return portal.Reject, portal.Reject
	}
	internal, external = portal.Redirect, portal.Redirect
	if len(loadbalancer.Usable(sp, eps, node, false)) == 0 {
		internal = portal.Drop
	}
	if len(loadbalancer.Usable(sp, eps, node, true)) == 0 {
		external = portal.Drop
	}
	return internal, external
}

// localReady returns the distinct IPs of the ready endpoints on node, in the order of eps.
func localReady(eps []serviceport.Endpoint, node string) []netip.Addr {
	var out []netip.Addr
	for _, e := range eps {
		if node != "" && e.NodeName == node && e.Ready && !slices.Contains(out, e.Addr.Addr()) {
			out = append(out, e.Addr.Addr())
		}
	}
	return out
}

// refreshLocalAddrs re-reads the node's addresses for isLocalAddr. On error the previous set is
// kept.
func (p *Proxier) refreshLocalAddrs() {
	list := p.opts.LocalAddrs
	if list == nil {
		list = interfaceAddrs
	}
	addrs, err := list()
	if err != nil {
		p.log.Warn().Err(err).Msg("listing node addresses; keeping the previous list")
		return
	}
	set := make(map[netip.Addr]bool, len(addrs))
	for _, a := range addrs {
		set[a.Unmap()] = true
	}
	p.localAddrs.Store(&set)
}

// isLocalAddr reports whether a is a loopback address or one of the node's own addresses (as of
// the last sync).
// isClusterAddr reports whether a is a pod's address (Options.ClusterCIDRs).
func (p *Proxier) isClusterAddr(a netip.Addr) bool {
	a = a.Unmap()
	for _, c := range p.opts.ClusterCIDRs {
		if c.Contains(a) {
			return true
		}
	}
	return false
}

func (p *Proxier) isLocalAddr(a netip.Addr) bool {
	a = a.Unmap()
	if a.IsLoopback() {
		return true
	}
	set := p.localAddrs.Load()
	return set != nil && (*set)[a]
}

// Ports returns the current state of every service port, sorted by name.
func (p *Proxier) Ports() []PortState {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.portStatesLocked()
}

// closeListeners stops accepting on every listener and releases held ports.
func (p *Proxier) closeListeners() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	p.closed = true
	for _, l := range p.ports {
		l.stopAccepting()
	}
	p.holder.closeAll()
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
			errs = append(errs, fmt.Errorf("%s: %w", l.sp.Load(), err))
		}
		l.release(p.alloc)
	}
	return errors.Join(errs...)
}

func sortPortStates(s []PortState) {
	sort.Slice(s, func(i, j int) bool {
		a, b := s[i].ServicePort, s[j].ServicePort
		if a.Name != b.Name {
			return a.Name.String() < b.Name.String()
		}
		return a.Protocol < b.Protocol
	})
}
