package loadbalancer

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// Errors returned by Next, wrapped with the operation and the service port; test them with
// errors.Is.
var (
	// ErrUnknownServicePort: the service port was never set, or has been deleted.
	ErrUnknownServicePort = errors.New("unknown service port")
	// ErrNoEndpoints: the service port has no usable endpoint at all. The proxy rejects the
	// traffic (TCP RST, ICMP port unreachable).
	ErrNoEndpoints = errors.New("no usable endpoints")
	// ErrNoLocalEndpoints: the traffic is subject to a Local policy and this node has no usable
	// endpoint, but other nodes do. The proxy drops the traffic.
	ErrNoLocalEndpoints = errors.New("no usable local endpoints")
)

// Options configures a RoundRobin. The zero value is usable.
type Options struct {
	// NodeName is this node's name, compared with Endpoint.NodeName for Local traffic policies
	// and with node hints. Empty means no endpoint is local: Local classes then never have
	// usable endpoints, and node hints never apply.
	NodeName string
	// Zone is this node's zone (its topology.kubernetes.io/zone label) until SetZone changes it.
	// Empty means unknown: zone hints never apply.
	Zone string
	// Log receives debug logs of topology decisions (why hints were used or ignored); the zero
	// value logs nothing.
	Log zerolog.Logger
	// Now returns the current time, for session affinity. Nil means time.Now.
	Now func() time.Time
	// Rand shuffles the endpoints of each service port. Nil means a source seeded at random.
	// It is used only inside SetServicePort (never concurrently) and must not be used by the
	// caller after New.
	Rand *rand.Rand
	// MaxAffinityEntries bounds the ClientIP affinity entries of each service port (a client
	// counts once per selection rule it has used: cluster-wide, Local). A new client at the
	// bound evicts the least recently used one, which then gets a new pick, like a client whose
	// entry expired. Zero or less means DefaultMaxAffinityEntries.
	MaxAffinityEntries int
	// OnAffinityEvicted, if set, is called once for each affinity entry evicted by the bound
	// (not for those that expire or whose endpoint leaves), with the service port's name and
	// protocol; metrics.Metrics.AffinityEvicted fits. It is called from Next with the service
	// port's lock held: it must be quick and must not call the RoundRobin. It is not called
	// for a service port once DeleteServicePort has returned.
	OnAffinityEvicted func(name proxy.Name, protocol v1.Protocol)
}

// RoundRobin picks endpoints for the service ports it has been given, round robin from a random
// start, with optional ClientIP session affinity. Create it with New. All methods are safe for
// concurrent use.
type RoundRobin struct {
	now func() time.Time
	log zerolog.Logger
	// epoch is now() at New: affinity entries keep their times as durations since it.
	epoch       time.Time
	maxAffinity int
	onEvicted   func(proxy.Name, v1.Protocol)

	// writeMu serialises SetServicePort, DeleteServicePort and SetZone. It guards the following
	// fields, and every port's order and topologyNote fields.
	writeMu sync.Mutex
	rand    *rand.Rand
	node    Node // Name is fixed; Zone changes with SetZone
	// restore holds affinity entries handed over by a predecessor, per port not yet set
	// (RestoreAffinity).
	restore map[proxy.Name][]AffinityEntry

	// mu guards ports (the map, not the ports). Held only for lookups and single inserts or
	// deletes, never across other work, so that a waiting writer never stalls Next for long.
	// (A sync.Map avoids the shared reader count but measured ~25 ns slower per Next here.)
	mu    sync.RWMutex
	ports map[proxy.Name]*port
}

// New returns a RoundRobin with no service ports.
func New(opts Options) *RoundRobin {
	lb := &RoundRobin{
		now:         opts.Now,
		log:         opts.Log,
		maxAffinity: opts.MaxAffinityEntries,
		onEvicted:   opts.OnAffinityEvicted,
		rand:        opts.Rand,
		node:        Node{Name: opts.NodeName, Zone: opts.Zone},
		ports:       map[proxy.Name]*port{},
	}
	if lb.now == nil {
		lb.now = time.Now
	}
	lb.epoch = lb.now()
	if lb.maxAffinity <= 0 {
		lb.maxAffinity = DefaultMaxAffinityEntries
	}
	if lb.rand == nil {
		lb.rand = rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
	}
	return lb
}

// Pools: the two selection rules. A traffic class uses one of them.
const (
	poolCluster = iota // every node's endpoints, narrowed by topology hints
	poolLocal          // this node's endpoints only (hints never apply)
	numPools
)

// Traffic classes.
const (
	classInternal = iota // ClusterIP traffic: internalTrafficPolicy
	classExternal        // NodePort, external IP, load-balancer IP traffic: externalTrafficPolicy
	numClasses
)

// port is the balancer's state for one service port. It is kept to 80 bytes: there is one per
// service port.
type port struct {
	// snap is what Next reads; replaced (never modified) by SetServicePort, SetZone and
	// DeleteServicePort (which turns affinity off), under mu.
	snap atomic.Pointer[snapshot]

	// order is every endpoint in rotation order, and topologyNote the last topology decision
	// logged (nil for none, as for most ports). Guarded by RoundRobin.writeMu, as is the choice
	// of snapshot (the port's current configuration is snap's sp).
	order        rotation
	topologyNote *string

	// held holds the endpoints that could not be reached lately (unreachable.go); nil when none
	// is, as for most ports. Replaced (never modified) under mu.
	held atomic.Pointer[holds]

	// errs holds Next's errors for this port, built by its first failing pick (rare: most ports
	// never need them) and then reused, so that later failing picks do not allocate.
	errs atomic.Pointer[portErrors]

	// mu guards the following fields. Snapshots are stored under it too, so that a holder of
	// mu sees a snapshot consistent with the affinity table.
	mu sync.Mutex
	// affinity holds the last endpoint chosen for each client IP under each pool, at most
	// RoundRobin.maxAffinity of them; nil when empty, and once DeleteServicePort has turned
	// the port's affinity off.
	affinity *affinityTable
}

// snapshot is an immutable view of a port's configuration and usable endpoints. It is kept small
// (one 32-byte allocation): there is one per service port.
type snapshot struct {
	sp    *proxy.ServicePort // the configuration it was built from
	pools [numPools]*pool
	class [numClasses]uint8 // the pool (poolCluster, poolLocal) each traffic class uses
	// affinity is sp.SessionAffinity, here so that Next does not read sp.
	affinity bool
}

// timeout returns the port's affinity timeout.
func (s *snapshot) timeout() time.Duration {
	if s.sp.AffinityTimeout <= 0 {
		return proxy.DefaultAffinityTimeout
	}
	return s.sp.AffinityTimeout
}

// rotation is endpoints in rotation order without a copy of them: eps is the endpoint list
// given to SetServicePort, kept as it is (it may hold endpoints outside the rotation), and perm
// the rotation as indexes into it; a nil perm is all of eps in its own order. An index costs 4
// bytes per endpoint where a copy of the endpoint cost 88 (and a port's two rules, its address
// families and its rotation order would each have had one). perm is a pointer so that a
// rotation of a list in its own order (a port of one endpoint, the most common at scale) costs
// 8 bytes more than the list, not 24, in the port and in each pool.
type rotation struct {
	eps  []proxy.Endpoint
	perm *[]uint32
}

// len returns the number of endpoints in the rotation.
func (r *rotation) len() int {
	if r.perm != nil {
		return len(*r.perm)
	}
	return len(r.eps)
}

// at returns the endpoint at position i of the rotation.
func (r *rotation) at(i int) *proxy.Endpoint {
	if r.perm != nil {
		return &r.eps[(*r.perm)[i]]
	}
	return &r.eps[i]
}

// indexOf returns the index into eps of position i of the rotation.
func (r *rotation) indexOf(i int) uint32 {
	if r.perm != nil {
		return (*r.perm)[i]
	}
	return uint32(i)
}

// equal reports whether r and o are the same positions of the same list.
func (r *rotation) equal(o *rotation) bool {
	n := r.len()
	if n != o.len() || n > 0 && &r.eps[0] != &o.eps[0] {
		return false
	}
	for i := range n {
		if r.indexOf(i) != o.indexOf(i) {
			return false
		}
	}
	return true
}

// sameEndpoints reports whether r and o hold equal endpoints in the same order (of any lists).
func (r *rotation) sameEndpoints(o *rotation) bool {
	n := r.len()
	if n != o.len() {
		return false
	}
	for i := range n {
		if *r.at(i) != *o.at(i) {
			return false
		}
	}
	return true
}

// pool is the usable endpoint list of one selection rule, with its rotation. Everything but next
// is immutable once published. The pools of a port's two rules are one pool when both lists are
// the same single endpoint (a rotation of one needs no counter of its own), and an empty list is
// the shared emptyPool.
type pool struct {
	rotation               // usable endpoints, in rotation order; may be port.order
	next     atomic.Uint64 // rotation counter: the next pick is at(next % len())
	// extra holds what few pools need (nil for the others, so a pool is 48 bytes).
	extra *poolExtra
}

// poolExtra is what a pool has only when it is long or dual-stack.
type poolExtra struct {
	index map[netip.AddrPort]int // position of each endpoint in the rotation; nil up to indexedPool endpoints
	// families, when the pool holds endpoints of both address families, is it narrowed to each
	// family (familyIPv4, familyIPv6), each with its own rotation: traffic keeps its address
	// family, as with kube-proxy's per-family proxiers. Nil otherwise; a client then gets
	// whatever family the pool has (a userspace proxy can bridge them).
	families *[2]*pool
}

// families returns the pool narrowed to each address family, nil when it is not dual-stack.
func (pl *pool) families() *[2]*pool {
	if pl.extra == nil {
		return nil
	}
	return pl.extra.families
}

// emptyPool is every pool without endpoints. Its counter is never used.
var emptyPool = new(pool)

// indexedPool is the most endpoints a pool finds an address among by scanning eps; longer pools
// have an index. A Go map allocates a group of 8 slots (~350 bytes here) even for one endpoint,
// and up to ~20 endpoints a scan is as fast as a map lookup (~5 ns for a few, ~12 for 16).
const indexedPool = 16

// newPool returns a pool of r (rotation at 0) with its index when it needs one; emptyPool when
// r is empty.
func newPool(r rotation) *pool {
	n := r.len()
	if n == 0 {
		return emptyPool
	}
	pl := &pool{rotation: r}
	if n > indexedPool {
		pl.extra = &poolExtra{index: make(map[netip.AddrPort]int, n)}
		for i := range n {
			pl.extra.index[r.at(i).Addr] = i
		}
	}
	return pl
}

// find returns the position of the endpoint a in the rotation.
func (pl *pool) find(a netip.AddrPort) (int, bool) {
	if pl.extra != nil && pl.extra.index != nil {
		i, ok := pl.extra.index[a]
		return i, ok
	}
	for i := range pl.len() {
		if pl.at(i).Addr == a {
			return i, true
		}
	}
	return 0, false
}

// Address families of families.
const (
	familyIPv4 = iota
	familyIPv6
)

func familyOf(a netip.Addr) int {
	if a.Unmap().Is4() {
		return familyIPv4
	}
	return familyIPv6
}

// forClient returns the pool that traffic from client picks from: the one of client's address
// family when pl has both families, pl itself otherwise (or when client is unknown).
func (pl *pool) forClient(client netip.Addr) *pool {
	fs := pl.families()
	if fs == nil || !client.IsValid() {
		return pl
	}
	return fs[familyOf(client)]
}

// splitFamilies sets pl's families when pl has endpoints of both families, carrying each family's
// rotation over from old (the same rule's previous pool; nil for a new port).
func (pl *pool) splitFamilies(old *pool) {
	// Most pools are of one family: find out without allocating.
	first := familyOf(pl.at(0).Addr.Addr())
	mixed := false
	for i := 1; i < pl.len() && !mixed; i++ {
		mixed = familyOf(pl.at(i).Addr.Addr()) != first
	}
	if !mixed {
		return
	}
	var byFamily [2][]uint32
	for i := range pl.len() {
		f := familyOf(pl.at(i).Addr.Addr())
		byFamily[f] = append(byFamily[f], pl.indexOf(i))
	}
	if len(byFamily[familyIPv4]) == 0 || len(byFamily[familyIPv6]) == 0 {
		return
	}
	if pl.extra == nil {
		pl.extra = &poolExtra{}
	}
	pl.extra.families = new([2]*pool)
	for f, perm := range byFamily {
		sub := newPool(rotation{eps: pl.eps, perm: &perm})
		if old != nil {
			prev := old
			if fs := old.families(); fs != nil {
				prev = fs[f]
			}
			sub.next.Store(carryPosition(prev, sub))
		}
		pl.extra.families[f] = sub
	}
}

// pick returns the next endpoint in rotation. The pool must not be empty.
func (pl *pool) pick() proxy.Endpoint {
	i := pl.next.Add(1) - 1
	if pm := pl.perm; pm != nil {
		perm := *pm
		return pl.eps[perm[i%uint64(len(perm))]]
	}
	return pl.eps[i%uint64(len(pl.eps))]
}

// SetServicePort adds sp or replaces it and its endpoints; eps are the endpoints for sp (their
// order does not matter, duplicates of an address are ignored). A nil sp is ignored.
//
// The rotation position is kept when the usable endpoints did not change, and carried over to the
// surviving endpoints when they did. Affinity entries are dropped when their endpoint is no longer
// in eps, and all of them when sp turns affinity off; a changed affinity timeout applies at once,
// to existing entries too. sp must not be modified afterwards (ServicePorts are immutable), nor
// eps (it may be kept as the rotation order: the proxy's endpoint lists are never changed in
// place).
func (lb *RoundRobin) SetServicePort(sp *proxy.ServicePort, eps []proxy.Endpoint) {
	if sp == nil {
		return
	}
	lb.writeMu.Lock()
	defer lb.writeMu.Unlock()

	lb.mu.RLock()
	p := lb.ports[sp.Name]
	lb.mu.RUnlock()
	isNew := p == nil
	if isNew {
		p = &port{}
	}

	old := p.snap.Load()
	order, present, added, changed := lb.mergeOrder(&p.order, eps)
	s := &snapshot{sp: sp, affinity: sp.SessionAffinity}
	var choice topologyChoice
	if old != nil && !changed && order.equal(&p.order) {
		s.pools = old.pools
		choice = topologyFor(&order, lb.node) // what buildPools found for the same order
	} else {
		// Also when only the list changed (equal endpoints in a new list): the pools then move
		// to it, continuing their rotations, and the old list is not kept alive by them.
		s.pools, choice = buildPools(&order, lb.node, old)
	}
	s.class[classInternal] = uint8(poolFor(sp.InternalPolicyLocal))
	s.class[classExternal] = uint8(poolFor(sp.ExternalPolicyLocal))
	lb.noteTopologyLocked(p, s, choice)

	p.mu.Lock()
	switch {
	case p.affinity == nil:
	case !s.affinity:
		p.affinity = nil
	case order.len() < p.order.len()+added: // some endpoint left
		p.affinity.removeFunc(func(e *affinityEntry) bool {
			_, ok := present.index(e.ep)
			return !ok
		})
		p.affinity = p.affinity.compact()
	}
	if order.len() < p.order.len()+added {
		p.keepHeldLocked(present)
	}
	if isNew {
		lb.restoreAffinityLocked(p, s, present)
	}
	p.snap.Store(s)
	p.mu.Unlock()
	p.order = order

	if isNew {
		lb.mu.Lock()
		lb.ports[sp.Name] = p
		lb.mu.Unlock()
	}
}

// SetZone changes this node's zone (its topology.kubernetes.io/zone label; "" when it has none)
// and re-applies the topology hints of every service port under it. Rotation positions carry
// over as they do when endpoints change; affinity entries are kept but not used while their
// endpoint is outside the traffic's usable set.
func (lb *RoundRobin) SetZone(zone string) {
	lb.writeMu.Lock()
	defer lb.writeMu.Unlock()
	if zone == lb.node.Zone {
		return
	}
	lb.node.Zone = zone
	lb.mu.RLock()
	var ports []*port // none without affinity: no allocation (a slice of every port was 80 KB at 10,000)
	for _, p := range lb.ports {
		ports = append(ports, p)
	}
	lb.mu.RUnlock()
	for _, p := range ports {
		if !slices.ContainsFunc(p.order.eps, func(e proxy.Endpoint) bool { return !e.ZoneHints.Empty() }) {
			continue // the zone cannot change what this port uses
		}
		old := p.snap.Load()
		s := *old
		var choice topologyChoice
		s.pools, choice = buildPools(&p.order, lb.node, old)
		p.mu.Lock()
		p.snap.Store(&s)
		p.mu.Unlock()
		lb.noteTopologyLocked(p, &s, choice)
	}
}

// noteTopologyLocked logs, at debug level, the topology decision c for p's new snapshot s when it
// differs from the last one logged for p: which hints are used, or why hints (or the service's
// request for topology) are ignored. Ports that neither ask for topology nor have hinted
// endpoints stay quiet. lb.writeMu must be held.
func (lb *RoundRobin) noteTopologyLocked(p *port, s *snapshot, c topologyChoice) {
	asked := s.sp.Topology != proxy.TopologyNone
	var note string
	switch {
	case s.class[classInternal] != poolCluster && s.class[classExternal] != poolCluster:
		if asked || c.hinted {
			note = "hints not used: both traffic policies are Local"
		}
	case c.mode != topologyNone:
		note = "using " + c.mode.String()
		if c.ignored != "" {
			note += " (ignored " + c.ignored + ")"
		}
	case c.ignored != "":
		note = "hints ignored, every endpoint used: " + c.ignored
	case asked && !c.hinted:
		note = "service asks for topology but no ready endpoint has hints: every endpoint used"
	}
	last := ""
	if p.topologyNote != nil {
		last = *p.topologyNote
	}
	if note == last {
		return
	}
	p.topologyNote = nil
	if note != "" {
		p.topologyNote = &note
	}
	if note == "" {
		note = "no topology hints: every endpoint used"
	}
	lb.log.Debug().Str("servicePort", s.sp.String()).Str("node", lb.node.Name).Str("zone", lb.node.Zone).
		Str("topologyRequest", string(s.sp.Topology)).Msg("topology: " + note)
}

// Availability says which traffic of one service port has a usable endpoint (see filter), as of
// the port's last SetServicePort or SetZone. The zero value (an unknown port) has none.
type Availability struct {
	// Any is true when some endpoint is usable by traffic not subject to a Local policy.
	Any bool
	// Internal and External are true when ClusterIP traffic, and NodePort, externalIP and
	// load-balancer IP traffic, have a usable endpoint under the port's traffic policies.
	Internal, External bool
	// LocalEndpoints counts the endpoints on this node that traffic under a Local policy may use
	// (the ready local ones, or when there are none the serving and terminating local ones).
	LocalEndpoints int
}

// Availability returns the availability of the service port name.
func (lb *RoundRobin) Availability(name proxy.Name) Availability {
	lb.mu.RLock()
	p := lb.ports[name]
	lb.mu.RUnlock()
	if p == nil {
		return Availability{}
	}
	s := p.snap.Load()
	return Availability{
		Any:            s.pools[poolCluster].len() > 0,
		Internal:       s.pools[s.class[classInternal]].len() > 0,
		External:       s.pools[s.class[classExternal]].len() > 0,
		LocalEndpoints: s.pools[poolLocal].len(),
	}
}

// DeleteServicePort forgets a service port, its endpoints and its affinity entries. Next then
// fails with ErrUnknownServicePort. Deleting an unknown port does nothing.
func (lb *RoundRobin) DeleteServicePort(name proxy.Name) {
	lb.writeMu.Lock()
	defer lb.writeMu.Unlock()
	lb.mu.Lock()
	p := lb.ports[name]
	delete(lb.ports, name)
	lb.mu.Unlock()
	if p == nil {
		return
	}
	// A Next that found p before the delete may still be running: from here on it records no
	// affinity (the snapshot it reloads under p.mu has affinity off), so it evicts nothing and
	// reports no eviction.
	p.mu.Lock()
	if s := p.snap.Load(); s.affinity {
		off := *s
		off.affinity = false
		p.snap.Store(&off)
	}
	p.affinity = nil
	p.held.Store(nil)
	p.mu.Unlock()
}

// Next picks the endpoint for a new connection or flow of the service port name from client.
// external is true for traffic that arrived via a NodePort, an external IP or a load-balancer IP
// (externalTrafficPolicy applies), false for ClusterIP traffic (internalTrafficPolicy applies).
// resetAffinity is true when dialling the endpoint previously returned for this client failed:
// the client's affinity is forgotten and a different endpoint is returned if there is one.
//
// A client gets endpoints of its own address family while the usable endpoints include any
// (a dual-stack service: IPv4 traffic to IPv4 pods, IPv6 to IPv6, each family in its own
// rotation), and the other family's otherwise.
//
// Errors wrap ErrUnknownServicePort, ErrNoEndpoints or ErrNoLocalEndpoints. An invalid client
// address gets no affinity.
func (lb *RoundRobin) Next(name proxy.Name, client netip.Addr, external, resetAffinity bool) (proxy.Endpoint, error) {
	lb.mu.RLock()
	p := lb.ports[name]
	lb.mu.RUnlock()
	if p == nil {
		return proxy.Endpoint{}, fmt.Errorf("pick endpoint for %s: %w", name, ErrUnknownServicePort)
	}
	class := classInternal
	if external {
		class = classExternal
	}
	s := p.snap.Load()
	pl := s.pools[s.class[class]].forClient(client)
	if pl.len() == 0 {
		return proxy.Endpoint{}, p.errNoEndpoints(s, class)
	}
	if !s.affinity || !client.IsValid() {
		if h := p.held.Load(); h != nil {
			return lb.pickAvailable(p, pl, h), nil
		}
		return pl.pick(), nil
	}
	return lb.nextAffine(p, class, client.Unmap(), resetAffinity)
}

// portErrors are Next's errors for one port.
type portErrors struct {
	noEndpoints, noLocal error
}

// errNoEndpoints returns Next's error for traffic of class whose pool in snapshot s has no
// endpoint: ErrNoLocalEndpoints for the local rule while other nodes have usable endpoints,
// ErrNoEndpoints otherwise, wrapped with the operation and the port's name. The same error is
// returned each time for the port (it is built by the first call).
func (p *port) errNoEndpoints(s *snapshot, class int) error {
	errs := p.errs.Load()
	if errs == nil {
		op := "pick endpoint for " + s.sp.Name.String()
		errs = &portErrors{
			noEndpoints: fmt.Errorf("%s: %w", op, ErrNoEndpoints),
			noLocal:     fmt.Errorf("%s: %w", op, ErrNoLocalEndpoints),
		}
		if !p.errs.CompareAndSwap(nil, errs) {
			errs = p.errs.Load()
		}
	}
	if s.class[class] == poolLocal && s.pools[poolCluster].len() > 0 {
		return errs.noLocal
	}
	return errs.noEndpoints
}

// nextAffine is Next for a port with session affinity. A hit allocates nothing.
func (lb *RoundRobin) nextAffine(p *port, class int, client netip.Addr, reset bool) (proxy.Endpoint, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	// Reload: SetServicePort may have replaced the snapshot since Next read it.
	s := p.snap.Load()
	id := s.class[class]
	pl := s.pools[id].forClient(client)
	if pl.len() == 0 {
		return proxy.Endpoint{}, p.errNoEndpoints(s, class)
	}
	h := p.held.Load()
	if !s.affinity {
		if h != nil {
			return lb.pickAvailable(p, pl, h), nil
		}
		return pl.pick(), nil
	}
	now := lb.now().Sub(lb.epoch)
	t := p.affinity
	var (
		at     int32
		found  bool
		failed netip.AddrPort
	)
	if t != nil {
		at, found = t.get(int(id), client)
	}
	if found {
		e := &t.entries[at]
		if reset {
			failed = e.ep
		} else if now-e.used < s.timeout() {
			if i, usable := pl.find(e.ep); usable && (h == nil || p.available(h, e.ep, now)) {
				t.use(at, e.ep, now)
				return *pl.at(i), nil
			}
			h = p.held.Load() // available may have changed them
		}
	}
	pick := pl.pick
	if h != nil {
		pick = func() proxy.Endpoint { return lb.pickAvailable(p, pl, h) }
	}
	ep := pick()
	if ep.Addr == failed && pl.len() > 1 {
		ep = pick()
	}
	switch {
	case found:
		t.use(at, ep.Addr, now)
	case t == nil:
		p.affinity = newAffinityTable(lb.maxAffinity)
		p.affinity.add(int(id), client, ep.Addr, now)
	default:
		if t.add(int(id), client, ep.Addr, now) && lb.onEvicted != nil {
			lb.onEvicted(s.sp.Name, s.sp.Protocol)
		}
	}
	return ep, nil
}

// Sweep drops the affinity entries that have not been used for their port's affinity timeout,
// and moves a port's table to smaller storage when it has shrunk to a quarter of its size or
// less. Expired entries are never used even before they are swept; sweeping only frees their
// memory. Finding them takes O(expired entries) per port, as they are the least recently used
// ones (if Options.Now goes backwards, some may be left to be evicted or swept later).
func (lb *RoundRobin) Sweep() {
	now := lb.now().Sub(lb.epoch)
	lb.mu.RLock()
	var ports []*port // none without affinity: no allocation (a slice of every port was 80 KB at 10,000)
	for _, p := range lb.ports {
		if p.snap.Load().affinity {
			ports = append(ports, p)
		}
	}
	lb.mu.RUnlock()
	for _, p := range ports {
		p.sweep(now)
	}
}

// sweep is Sweep for p; now is the time since RoundRobin.epoch.
func (p *port) sweep(now time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.affinity == nil {
		return
	}
	p.affinity.expire(now - p.snap.Load().timeout())
	p.affinity = p.affinity.compact()
}

func poolFor(local bool) int {
	if local {
		return poolLocal
	}
	return poolCluster
}

// buildPools computes the usable lists of both selection rules from order, carrying each rule's
// rotation position over from old (nil for a new port), and returns them with the topology
// decision for the cluster-wide rule: it follows the topology hints of order for node; the local
// rule never does. A list that is all of order is order itself, and the local list is the
// cluster-wide one when they are equal.
func buildPools(order *rotation, node Node, old *snapshot) ([numPools]*pool, topologyChoice) {
	choice := topologyFor(order, node)
	cluster := usableOf(order, node, false, choice.mode)
	local := usableOf(order, node, true, topologyNone)
	same := local.equal(&cluster)
	if same {
		local = cluster
	}
	var pools [numPools]*pool
	for id, r := range [numPools]rotation{cluster, local} {
		if id == poolLocal && same && r.len() == 1 {
			pools[id] = pools[poolCluster] // the same single endpoint: no rotation to keep apart
			continue
		}
		pl := newPool(r)
		if pl != emptyPool {
			var prev *pool
			if old != nil {
				prev = old.pools[id]
				pl.next.Store(carryPosition(prev, pl))
			}
			pl.splitFamilies(prev)
		}
		pools[id] = pl
	}
	return pools, choice
}

// usableOf returns the rotation of filter(nil, order, node, local, mode), or order itself when
// every endpoint of it is usable.
func usableOf(order *rotation, node Node, local bool, mode topologyMode) rotation {
	for i := range order.len() {
		e := order.at(i)
		if !e.Ready || (local && !isLocal(e, node.Name)) || !availableForTopology(e, mode, node) {
			perm := filter(nil, order, node, local, mode)
			if len(perm) == 0 {
				return rotation{}
			}
			return rotation{eps: order.eps, perm: &perm}
		}
	}
	return *order
}

// carryPosition returns the rotation counter for pl that continues old's rotation: the next pick
// is the endpoint old would have picked next, or if that one is gone, the first one after it in
// old's order that is still usable; 0 when none is.
func carryPosition(old, pl *pool) uint64 {
	n := uint64(old.len())
	if n == 0 || pl.len() == 0 {
		return 0
	}
	at := old.next.Load() % n
	for k := range n {
		if i, ok := pl.find(old.at(int((at + k) % n)).Addr); ok {
			return uint64(i)
		}
	}
	return 0
}

// mergeOrder returns the rotation order for eps given the previous one: endpoints still present
// keep their relative order (with their current conditions) and new endpoints are interleaved at
// uniformly random positions, so the first order is a uniform shuffle. The order is a rotation of
// eps itself (indexes, no copy of an endpoint). present holds the addresses in eps, nAdded how
// many of them are new; changed reports whether order differs from prev (addresses, order or
// conditions).
func (lb *RoundRobin) mergeOrder(prev *rotation, eps []proxy.Endpoint) (order rotation, present endpointSet, nAdded int, changed bool) {
	present = newEndpointSet(eps)
	kept := make([]uint32, 0, len(eps))
	var takenSmall [indexedPool]bool
	var taken []bool
	if len(eps) > indexedPool {
		taken = make([]bool, len(eps))
	} else {
		taken = takenSmall[:len(eps)]
	}
	for k := range prev.len() {
		if i, ok := present.index(prev.at(k).Addr); ok {
			kept = append(kept, uint32(i))
			taken[i] = true
		}
	}
	var added []uint32
	for i, e := range eps {
		if first, _ := present.index(e.Addr); !taken[i] && first == i {
			added = append(added, uint32(i))
		}
	}
	if len(added) == 0 {
		order = rotation{eps: eps, perm: identityOrNil(kept, len(eps))}
		return order, present, 0, !order.sameEndpoints(prev)
	}
	lb.rand.Shuffle(len(added), func(i, j int) { added[i], added[j] = added[j], added[i] })
	// A uniformly random interleaving: take from kept with probability (kept left)/(total left).
	perm := make([]uint32, 0, len(kept)+len(added))
	k, a := 0, 0
	for k < len(kept) || a < len(added) {
		if lb.rand.IntN(len(kept)-k+len(added)-a) < len(kept)-k {
			perm = append(perm, kept[k])
			k++
		} else {
			perm = append(perm, added[a])
			a++
		}
	}
	return rotation{eps: eps, perm: identityOrNil(perm, len(eps))}, present, len(added), true
}

// identityOrNil returns nil when perm is 0, 1, … n-1 (all of a list of n in its own order: a
// port of one endpoint, the most common at scale, keeps no index), perm otherwise.
func identityOrNil(perm []uint32, n int) *[]uint32 {
	if len(perm) != n {
		return &perm
	}
	for i, v := range perm {
		if v != uint32(i) {
			return &perm
		}
	}
	return nil
}

// endpointSet finds the first position of an address in a list of endpoints: by scanning for
// up to indexedPool endpoints (a Go map allocates a group of 8 slots even for one entry, and
// SetServicePort makes a set on every call), through an index beyond.
type endpointSet struct {
	eps []proxy.Endpoint
	idx map[netip.AddrPort]int
}

func newEndpointSet(eps []proxy.Endpoint) endpointSet {
	s := endpointSet{eps: eps}
	if len(eps) > indexedPool {
		s.idx = make(map[netip.AddrPort]int, len(eps))
		for i, e := range eps {
			if _, dup := s.idx[e.Addr]; !dup {
				s.idx[e.Addr] = i
			}
		}
	}
	return s
}

// index returns the position of a's first endpoint, and whether there is one.
func (s endpointSet) index(a netip.AddrPort) (int, bool) {
	if s.idx != nil {
		i, ok := s.idx[a]
		return i, ok
	}
	for i, e := range s.eps {
		if e.Addr == a {
			return i, true
		}
	}
	return 0, false
}
