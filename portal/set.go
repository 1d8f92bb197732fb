package portal

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"slices"
	"strings"
	"sync"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/portal/conntrack"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/portal/transparent"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// Set programs the portals of every IP family the node has: it turns the proxier's port states
// into each family's Portals and hands them to that family's Manager, and owns the reply
// routing of transparent connections (package portal/transparent).
type Set struct {
	log      zerolog.Logger
	families []familyPortals
	// prepared: the first Sync has removed what an earlier run left (prepare); only Sync, which
	// the proxier calls from one goroutine, touches it. True from the start for a successor.
	prepared bool

	// trMu serialises the transparent routing's changes (EnableTransparent, a full Sync's
	// restore, prepare's clean-up) and guards familyPortals.ensureTransparent.
	trMu sync.Mutex

	mu        sync.Mutex                 // guards conflicts
	conflicts map[iptables.Family]string // the last sync's address conflicts, logged once
}

type familyPortals struct {
	family  iptables.Family
	manager *Manager
	// transparent delivers replies to transparent sockets; always set (to clean up), programmed
	// only when ensureTransparent.
	transparent       *transparent.Rules
	ensureTransparent bool
	// cache is what the last Sync made of its ports for this family (Sync's goroutine only).
	cache portalCache
}

// SetOptions configures a Set.
type SetOptions struct {
	// BindAddress is the proxy listeners' bind address (--bind-address); unspecified or the
	// zero value: every address, portals in both families.
	BindAddress netip.Addr
	// NodePortAddresses and ClusterCIDRs are Config's.
	NodePortAddresses []netip.Prefix
	ClusterCIDRs      []netip.Prefix
	// NoLocalhostNodePorts is Config's: false serves NodePorts on 127.0.0.1, as kube-proxy's
	// default does.
	NoLocalhostNodePorts bool
	// Log receives the portals' logs; the zero value logs nothing.
	Log zerolog.Logger
	// Successor: this proxy is about to take over from one that runs (package handover).
	// NewSet then removes nothing, the transparent routing included: the running proxy's
	// rules and connections are about to become this one's.
	Successor bool
}

// NewSet builds a portal manager per IP family the node has an address in. It changes no rule:
// the rules of ours that an earlier run left (a crash, a SIGKILL) stay, so the proxy ports they
// name (SurvivingProxyPorts) serve again as soon as the listeners are open on them, before any
// rule is written. The first Sync (prepare) removes what no Sync rewrites (Manager.PruneStale;
// should that fail, every rule of ours, as Manager.Cleanup does) and, unless EnableTransparent
// came first, what an earlier run left of the reply routing of transparent connections (no
// transparent connection outlives the process that made it unless it hands it over), then
// rewrites every one of our chains atomically, which removes the rules of service ports that
// are gone. A successor's Set (SetOptions.Successor) removes nothing: the running proxy's
// rules and connections are about to become this one's.
func NewSet(ctx context.Context, opts SetOptions) (*Set, error) {
	log := opts.Log
	mode, _, err := iptables.DetectMode()
	if err != nil {
		return nil, fmt.Errorf("detect iptables backend: %w", err)
	}
	set := &Set{log: log, prepared: opts.Successor}
	for _, w := range LoopbackNodePortWarnings(opts.NodePortAddresses, opts.NoLocalhostNodePorts) {
		log.Warn().Msg(w)
	}
	// Stale UDP flows (a changed portal, a restart) are deleted with the conntrack tool.
	var flows FlowDeleter
	if path, err := exec.LookPath("conntrack"); err == nil {
		flows = &conntrack.Tool{Path: path}
	} else {
		log.Warn().Err(err).Msg("no conntrack tool (Debian package conntrack): UDP flows tracked before a portal changed keep their old destination while their clients keep sending")
	}
	for _, fam := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
		bind := opts.BindAddress
		if bind.IsUnspecified() {
			bind = netip.Addr{}
		} else if bind.IsValid() && bind.Is4() != (fam == iptables.IPv4) {
			continue // listeners bound to one address serve only its family
		}
		host, ok := hostIP(fam)
		if !ok && !bind.IsValid() {
			if fam == iptables.IPv4 {
				return nil, errors.New("portals: the node has no IPv4 address for traffic from the node itself; set --bind-address")
			}
			log.Info().Msg("the node has no IPv6 address: IPv6 portals disabled")
			continue
		}
		run, err := iptables.New(iptables.Options{Family: fam, Mode: mode})
		if err != nil {
			if fam == iptables.IPv6 {
				log.Warn().Err(err).Msg("ip6tables unusable: IPv6 portals disabled")
				continue
			}
			return nil, fmt.Errorf("portals: %w", err)
		}
		m, err := NewManager(Options{
			Config: Config{Family: fam, BindIP: bind, HostIP: host, NodePortAddresses: opts.NodePortAddresses, ClusterCIDRs: opts.ClusterCIDRs,
				NoLocalhostNodePorts: opts.NoLocalhostNodePorts},
			Runner: run,
			Logger: log,
			Flows:  flows,
		})
		if err != nil {
			return nil, err
		}
		tr, err := transparent.New(transparent.Options{Runner: run, Log: log})
		if err != nil {
			return nil, err
		}
		log.Info().Str("family", fam.String()).Str("backend", string(mode)).Str("hostIP", host.String()).Msg("portals ready")
		set.families = append(set.families, familyPortals{family: fam, manager: m, transparent: tr})
	}
	return set, nil
}

// Sync programs every family's portals for ports; node is the sync's snapshot of the node's
// addresses. A full sync rewrites every rule and restores the routing of transparent
// connections; the others write only the rules that changed.
func (s *Set) Sync(ctx context.Context, ports []proxy.PortState, node proxy.NodeAddrs, full bool) error {
	if !s.prepared {
		if err := s.prepare(ctx); err != nil {
			return err
		}
		s.prepared = true
	}
	var errs []error
	for i := range s.families {
		f := &s.families[i]
		sync := f.manager.Update
		if full {
			sync = f.manager.Sync
		}
		portals, conflicts := claimExternal(f.cache.toPortals(f.family, ports))
		s.noteConflicts(f.family, conflicts)
		if err := sync(portals, node.List()); err != nil {
			errs = append(errs, fmt.Errorf("%v portals: %w", f.family, err))
		}
		if full {
			if err := s.restoreTransparent(ctx, f); err != nil {
				errs = append(errs, fmt.Errorf("%v: %w", f.family, err))
			}
		}
	}
	return errors.Join(errs...)
}

// prepare removes, before the first Sync writes a rule, what an earlier run left that no Sync
// rewrites, and its reply routing of transparent connections unless EnableTransparent wants it.
func (s *Set) prepare(ctx context.Context) error {
	for i := range s.families {
		f := &s.families[i]
		if err := pruneStale(f.manager, s.log); err != nil {
			return fmt.Errorf("removing stale %v portals: %w", f.family, err)
		}
		s.trMu.Lock()
		var err error
		if !f.ensureTransparent {
			err = f.transparent.Cleanup(ctx)
		}
		s.trMu.Unlock()
		if err != nil {
			return fmt.Errorf("removing stale %v routing of transparent connections: %w", f.family, err)
		}
	}
	return nil
}

// restoreTransparent restores a family's reply routing of transparent connections, if enabled.
func (s *Set) restoreTransparent(ctx context.Context, f *familyPortals) error {
	s.trMu.Lock()
	defer s.trMu.Unlock()
	if !f.ensureTransparent {
		return nil
	}
	return f.transparent.Ensure(ctx)
}

// EnableTransparent programs, in every family, the reply routing of transparent connections
// (package portal/transparent), and has Sync restore it from then on. Call it before the
// proxier starts. On error no family's routing is restored by Sync; what was programmed stays
// until CleanupTransparent.
func (s *Set) EnableTransparent(ctx context.Context) error {
	s.trMu.Lock()
	defer s.trMu.Unlock()
	for i := range s.families {
		f := &s.families[i]
		if err := f.transparent.Ensure(ctx); err != nil {
			for j := range s.families {
				s.families[j].ensureTransparent = false // all or nothing: Sync restores none
			}
			return fmt.Errorf("%v routing of transparent connections (--transparent-local=false turns them off): %w", f.family, err)
		}
		f.ensureTransparent = true
	}
	s.log.Info().Msg("transparent connections for Local services enabled")
	return nil
}

// CleanupTransparent removes every family's routing of transparent connections. Call it after
// the connections have drained (Cleanup leaves it in place for them).
func (s *Set) CleanupTransparent(ctx context.Context) error {
	s.trMu.Lock()
	defer s.trMu.Unlock()
	var errs []error
	for _, f := range s.families {
		if err := f.transparent.Cleanup(ctx); err != nil {
			errs = append(errs, fmt.Errorf("%v: %w", f.family, err))
		}
	}
	return errors.Join(errs...)
}

// Cleanup removes every family's portals.
func (s *Set) Cleanup(context.Context) error {
	var errs []error
	for _, f := range s.families {
		if err := f.manager.Cleanup(); err != nil {
			errs = append(errs, fmt.Errorf("%v portals: %w", f.family, err))
		}
	}
	return errors.Join(errs...)
}

// portalCache is what toPortals made of one sync's ports in one family, for the next sync: a
// port whose state the portal depends on is the same takes its portal from here (no comment
// string, protocol or source ranges made again), and when the proxier hands over the very
// slice of states it did last time (it does when no state changed, as in an idle periodic
// sync) the portals are the cached ones, without a copy. At 10,000 service ports building them
// all again was ~2.2 MB of garbage per sync; the cache holds ~1.7 MB, the portals of the last
// sync, which were garbage at the next. The portals are handed to the Manager, which neither
// keeps nor modifies them, and claimExternal copies them before it changes one. The zero value
// is an empty cache.
type portalCache struct {
	ports   []proxy.PortState // the proxier's states (never modified once handed over)
	portals []Portal          // toPortals of ports
}

// toPortals is toPortals(fam, ports), taking what it can from the cache and leaving its result
// there.
func (c *portalCache) toPortals(fam iptables.Family, ports []proxy.PortState) []Portal {
	if len(ports) == len(c.ports) && (len(ports) == 0 || &ports[0] == &c.ports[0]) && c.portals != nil {
		return c.portals
	}
	out := make([]Portal, 0, len(ports))
	// old and j walk the last sync's states, k its portals, alongside ports (all in name order).
	old, j, k := c.ports, 0, 0
	for i := range ports {
		st := &ports[i]
		for j < len(old) && old[j].ServicePort.Name.Compare(st.ServicePort.Name) < 0 {
			if hasPortal(fam, &old[j]) {
				k++
			}
			j++
		}
		if j < len(old) && samePortal(&old[j], st) {
			if hasPortal(fam, st) {
				out = append(out, c.portals[k])
				k++
			}
			j++
			continue
		}
		if p, ok := newPortal(fam, st); ok {
			out = append(out, p)
		}
	}
	c.ports, c.portals = ports, out
	return out
}

// samePortal reports whether a port's portal made from state a is the one made from b.
func samePortal(a, b *proxy.PortState) bool {
	return a.ServicePort == b.ServicePort && a.ProxyPort == b.ProxyPort && a.Internal == b.Internal && a.External == b.External
}

// hasPortal reports whether st has a portal in fam (see toPortals).
func hasPortal(fam iptables.Family, st *proxy.PortState) bool {
	return clusterIP(fam, st.ServicePort).IsValid() || st.ProxyPort > 0
}

// clusterIP returns sp's ClusterIP of fam; the zero Addr when it has none.
func clusterIP(fam iptables.Family, sp *proxy.ServicePort) netip.Addr {
	for _, ip := range sp.ClusterIPs {
		if ip.Is4() == (fam == iptables.IPv4) {
			return ip
		}
	}
	return netip.Addr{}
}

// newPortal returns st's portal in fam, and false when it has none (see toPortals).
func newPortal(fam iptables.Family, st *proxy.PortState) (Portal, bool) {
	sp := st.ServicePort
	p := Portal{
		Comment:   sp.Name.String(),
		Protocol:  protocol(sp.Protocol),
		Port:      sp.Port,
		ProxyPort: st.ProxyPort,
		Internal:  st.Internal,
		External:  st.External,
	}
	cip := clusterIP(fam, sp)
	if !cip.IsValid() {
		return p, st.ProxyPort > 0
	}
	p.ClusterIP = cip
	p.ExternalIPs = sp.ExternalIPs
	p.LoadBalancerIPs = sp.LoadBalancerIPs
	p.LoadBalancerSourceRanges = sourceRanges(fam, sp.LoadBalancerSourceRanges)
	p.NodePort = sp.NodePort
	return p, true
}

// protocol returns a Portal's protocol for proto: "tcp", "udp", "sctp", allocating nothing for
// those; another value in lower case (which Validate rejects).
func protocol(proto v1.Protocol) string {
	switch proto {
	case v1.ProtocolTCP:
		return "tcp"
	case v1.ProtocolUDP:
		return "udp"
	case v1.ProtocolSCTP:
		return "sctp"
	}
	return strings.ToLower(string(proto))
}

// claimExternal gives each external or load-balancer IP:port (per protocol) to the first portal
// that has it, in the order of portals (the proxier's: by service port name), and leaves it out
// of the others, returning one conflict per address left out. It does not modify portals: with
// a conflict it returns a copy. Two rules for one address would
// otherwise both be written and the first in the chain would win: a full sync (sorted) and a
// partial one (a changed portal's rules appended last) would then disagree on the winner.
func claimExternal(portals []Portal) ([]Portal, []string) {
	type key struct {
		proto string
		ap    netip.AddrPort
	}
	owner := map[key]string{}
	var conflicts []string
	claim := func(p *Portal, ips []netip.Addr, what string) []netip.Addr {
		out := ips
		for i, ip := range ips {
			k := key{p.Protocol, netip.AddrPortFrom(ip.Unmap(), uint16(p.Port))}
			first, taken := owner[k]
			if !taken || first == p.Comment { // the portal's own address, listed twice: both kept
				owner[k] = p.Comment
				if len(out) < len(ips) {
					out = append(out, ip)
				}
				continue
			}
			if len(out) == len(ips) {
				out = append([]netip.Addr(nil), ips[:i]...)
			}
			conflicts = append(conflicts, fmt.Sprintf("service port %s: %s %s/%s is also %s's, which has it (the first by name)", p.Comment, what, k.ap, p.Protocol, first))
		}
		return out
	}
	copied := false // portals are the caller's until a claim changes one: then a copy's
	for i := range portals {
		p := portals[i]
		ext := claim(&p, p.ExternalIPs, "external IP")
		lb := claim(&p, p.LoadBalancerIPs, "load-balancer IP")
		if len(ext) == len(p.ExternalIPs) && len(lb) == len(p.LoadBalancerIPs) {
			continue // claim returns its input when it keeps every address
		}
		if !copied {
			portals, copied = slices.Clone(portals), true
		}
		portals[i].ExternalIPs, portals[i].LoadBalancerIPs = ext, lb
	}
	return portals, conflicts
}

// noteConflicts logs the family's address conflicts when they differ from the last sync's.
func (s *Set) noteConflicts(fam iptables.Family, conflicts []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := strings.Join(conflicts, "\n")
	if s.conflicts == nil {
		s.conflicts = map[iptables.Family]string{}
	}
	if s.conflicts[fam] == now {
		return
	}
	s.conflicts[fam] = now
	for _, c := range conflicts {
		s.log.Error().Str("family", fam.String()).Msg(c)
	}
}

// sourceRanges returns a service port's loadBalancerSourceRanges for one family, as kube-proxy
// reads them: the ranges of the family; none (every source) when the service has only ranges of
// the other family. A list of nothing but unparsable entries (see proxy.ServicePort) stays
// as it is, which lets no source in.
func sourceRanges(fam iptables.Family, all []netip.Prefix) []netip.Prefix {
	var out []netip.Prefix
	valid := false
	for _, p := range all {
		if !p.IsValid() {
			continue
		}
		valid = true
		if p.Addr().Unmap().Is4() == (fam == iptables.IPv4) {
			out = append(out, p)
		}
	}
	if !valid {
		return all
	}
	return out
}

// CleanupAll removes every chain and jump of ours in both families, and the routing of
// transparent connections (--cleanup).
func CleanupAll(ctx context.Context, log zerolog.Logger) error {
	mode, _, err := iptables.DetectMode()
	if err != nil {
		return fmt.Errorf("detect iptables backend: %w", err)
	}
	var errs []error
	for _, fam := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
		run, err := iptables.New(iptables.Options{Family: fam, Mode: mode})
		if err != nil {
			if fam == iptables.IPv6 {
				log.Warn().Err(err).Msg("ip6tables unusable: nothing to clean up for IPv6")
				continue
			}
			return err
		}
		// Cleanup needs no addresses: give the manager a placeholder host IP of the family.
		host := netip.MustParseAddr("127.0.0.1")
		if fam == iptables.IPv6 {
			host = netip.IPv6Loopback()
		}
		m, err := NewManager(Options{Config: Config{Family: fam, HostIP: host}, Runner: run, Logger: log})
		if err != nil {
			return err
		}
		if err := m.Cleanup(); err != nil {
			errs = append(errs, fmt.Errorf("%v: %w", fam, err))
		}
		tr, err := transparent.New(transparent.Options{Runner: run, Log: log})
		if err != nil {
			return err
		}
		if err := tr.Cleanup(ctx); err != nil {
			errs = append(errs, fmt.Errorf("%v: %w", fam, err))
		}
	}
	return errors.Join(errs...)
}

// hostIP returns the node's primary address of a family: the source address the kernel would
// use on its default route (a UDP "connect" sends no packet), else its first global address.
func hostIP(fam iptables.Family) (netip.Addr, bool) {
	probe := "192.0.2.1:9" // TEST-NET-1: only a route lookup, nothing is sent
	network := "udp4"
	if fam == iptables.IPv6 {
		probe, network = "[2001:db8::1]:9", "udp6"
	}
	if c, err := net.Dial(network, probe); err == nil {
		defer c.Close()
		if ap, err := netip.ParseAddrPort(c.LocalAddr().String()); err == nil && ap.Addr().IsGlobalUnicast() {
			return ap.Addr().Unmap(), true
		}
	}
	addrs, err := proxy.ListNodeAddrs()
	if err != nil {
		return netip.Addr{}, false
	}
	for _, a := range addrs.List() {
		if a.Is4() == (fam == iptables.IPv4) && a.IsGlobalUnicast() {
			return a, true
		}
	}
	return netip.Addr{}, false
}

// TryTransparent turns on transparent connections for Local services (EnableTransparent) and
// reports whether it could; see enableTransparent for what happens when it cannot.
func (s *Set) TryTransparent(ctx context.Context) bool {
	return enableTransparent(ctx, s, s.log)
}

// transparentRouting is what enableTransparent needs of a Set.
type transparentRouting interface {
	EnableTransparent(ctx context.Context) error
	CleanupTransparent(ctx context.Context) error
}

// enableTransparent turns on transparent connections for Local services and reports whether it
// could. When the kernel or the node cannot have them (no xt_socket match, the mark or routing
// table taken, no privilege), the proxy still serves everything: it warns, removes whatever part
// of the routing was programmed, and endpoints see the node's address, as in the original
// userspace mode.
func enableTransparent(ctx context.Context, r transparentRouting, log zerolog.Logger) bool {
	err := r.EnableTransparent(ctx)
	if err == nil {
		return true
	}
	log.Warn().Err(err).Msg("transparent connections disabled: endpoints of Local services see the node's address, not the client's")
	if cerr := r.CleanupTransparent(ctx); cerr != nil {
		log.Warn().Err(cerr).Msg("removing the partly programmed routing of transparent connections")
	}
	return false
}

// pruneStale removes from one family what an earlier run left that no Sync rewrites
// (Manager.PruneStale); if that fails, it removes every rule of ours (Manager.Cleanup), as a
// start did before proxy ports were reused: service ports then get new proxy ports.
func pruneStale(m *Manager, log zerolog.Logger) error {
	err := m.PruneStale()
	if err == nil {
		return nil
	}
	log.Warn().Err(err).Msg("cannot prune the rules an earlier run left; removing all of them (no proxy port is reused)")
	return m.Cleanup()
}
