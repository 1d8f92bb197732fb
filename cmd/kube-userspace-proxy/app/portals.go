package app

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"strings"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/portal"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/portal/conntrack"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/portal/transparent"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// portalSet programs the portals of every IP family the node has (proxy.Portals).
type portalSet struct {
	log      zerolog.Logger
	families []familyPortals
}

type familyPortals struct {
	family  iptables.Family
	manager *portal.Manager
	// transparent delivers replies to transparent sockets; always set (to clean up), programmed
	// only when ensureTransparent.
	transparent       *transparent.Rules
	ensureTransparent bool
}

var _ proxy.Portals = (*portalSet)(nil)

// newPortals builds a portal manager per IP family the node has an address in, and removes
// stale rules of ours (old proxy ports are dead), including what an earlier run left of the
// reply routing of transparent connections (EnableTransparent programs it).
func newPortals(ctx context.Context, v *Validated, log zerolog.Logger) (*portalSet, error) {
	mode, _, err := iptables.DetectMode()
	if err != nil {
		return nil, fmt.Errorf("detect iptables backend: %w", err)
	}
	set := &portalSet{log: log}
	// Stale UDP flows (a changed portal, a restart) are deleted with the conntrack tool.
	var flows portal.FlowDeleter
	if path, err := exec.LookPath("conntrack"); err == nil {
		flows = conntrack.Tool{Path: path}
	} else {
		log.Warn().Err(err).Msg("no conntrack tool (Debian package conntrack): UDP flows tracked before a portal changed keep their old destination while their clients keep sending")
	}
	for _, fam := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
		bind := v.BindAddress
		if bind.IsUnspecified() {
			bind = netip.Addr{}
		} else if bind.Is4() != (fam == iptables.IPv4) {
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
		m, err := portal.NewManager(portal.Options{
			Config: portal.Config{Family: fam, BindIP: bind, HostIP: host, NodePortAddresses: v.NodePortAddresses, ClusterCIDRs: v.ClusterCIDRs},
			Runner: run,
			Logger: log,
			Flows:  flows,
		})
		if err != nil {
			return nil, err
		}
		if err := m.Cleanup(); err != nil {
			return nil, fmt.Errorf("removing stale %v portals: %w", fam, err)
		}
		tr, err := transparent.New(transparent.Options{Runner: run, Log: log})
		if err != nil {
			return nil, err
		}
		if err := tr.Cleanup(ctx); err != nil {
			return nil, fmt.Errorf("removing stale %v routing of transparent connections: %w", fam, err)
		}
		log.Info().Str("family", fam.String()).Str("backend", string(mode)).Str("hostIP", host.String()).Msg("portals ready")
		set.families = append(set.families, familyPortals{family: fam, manager: m, transparent: tr})
	}
	return set, nil
}

// Sync programs every family's portals. A full sync rewrites every rule and restores the
// routing of transparent connections; the others write only the rules that changed.
func (s *portalSet) Sync(ctx context.Context, ports []proxy.PortState, full bool) error {
	var errs []error
	for _, f := range s.families {
		sync := f.manager.Update
		if full {
			sync = f.manager.Sync
		}
		if err := sync(toPortals(f.family, ports)); err != nil {
			errs = append(errs, fmt.Errorf("%v portals: %w", f.family, err))
		}
		if full && f.ensureTransparent {
			if err := f.transparent.Ensure(ctx); err != nil {
				errs = append(errs, fmt.Errorf("%v: %w", f.family, err))
			}
		}
	}
	return errors.Join(errs...)
}

// EnableTransparent programs, in every family, the reply routing of transparent connections
// (package portal/transparent), and has Sync restore it from then on. Call it before the
// proxier starts. On error no family's routing is restored by Sync; what was programmed stays
// until CleanupTransparent.
func (s *portalSet) EnableTransparent(ctx context.Context) error {
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
func (s *portalSet) CleanupTransparent(ctx context.Context) error {
	var errs []error
	for _, f := range s.families {
		if err := f.transparent.Cleanup(ctx); err != nil {
			errs = append(errs, fmt.Errorf("%v: %w", f.family, err))
		}
	}
	return errors.Join(errs...)
}

// Cleanup removes every family's portals.
func (s *portalSet) Cleanup(context.Context) error {
	var errs []error
	for _, f := range s.families {
		if err := f.manager.Cleanup(); err != nil {
			errs = append(errs, fmt.Errorf("%v portals: %w", f.family, err))
		}
	}
	return errors.Join(errs...)
}

// toPortals converts the proxier's port states into one family's portals: a service port has
// portals in a family when it has a ClusterIP of that family.
func toPortals(fam iptables.Family, ports []proxy.PortState) []portal.Portal {
	out := make([]portal.Portal, 0, len(ports))
	for _, st := range ports {
		sp := st.ServicePort
		var cip netip.Addr
		for _, ip := range sp.ClusterIPs {
			if ip.Is4() == (fam == iptables.IPv4) {
				cip = ip
				break
			}
		}
		if !cip.IsValid() {
			continue
		}
		out = append(out, portal.Portal{
			Comment:         sp.Name.String(),
			Protocol:        strings.ToLower(string(sp.Protocol)),
			Port:            sp.Port,
			ClusterIP:       cip,
			ExternalIPs:     sp.ExternalIPs,
			LoadBalancerIPs: sp.LoadBalancerIPs,
			NodePort:        sp.NodePort,
			ProxyPort:       st.ProxyPort,
			Internal:        st.Internal,
			External:        st.External,
		})
	}
	return out
}

// cleanupPortals removes every chain and jump of ours in both families, and the routing of
// transparent connections (--cleanup).
func cleanupPortals(ctx context.Context, log zerolog.Logger) error {
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
		m, err := portal.NewManager(portal.Options{Config: portal.Config{Family: fam, HostIP: host}, Runner: run, Logger: log})
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
	addrs, err := portal.InterfaceAddrs()
	if err != nil {
		return netip.Addr{}, false
	}
	for _, a := range addrs {
		if a.Is4() == (fam == iptables.IPv4) && a.IsGlobalUnicast() {
			return a, true
		}
	}
	return netip.Addr{}, false
}

// transparentRouting is what enableTransparent needs of a portalSet.
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
