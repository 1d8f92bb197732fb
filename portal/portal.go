// Package portal decides which iptables rules the proxy's service ports need and programs them.
//
// A Portal describes one service port in one IP family: the addresses and ports clients use
// (ClusterIP, externalIPs, load-balancer IPs, NodePort), the port of the proxy's listener, and what
// to do with new traffic (redirect it to the listener, reject it, or drop it). Render turns a list
// of portals into the full contents of the chains this package owns, as iptables-restore input; a
// Manager applies that with one iptables-restore per table and keeps the jumps into the chains in
// place (Sync), or writes only the rules that changed since (Update). The package knows nothing
// about sockets.
//
// The rules are those of kube-proxy's userspace mode (Kubernetes v1.25), every rule commented with
// the service port's name:
//
//	nat    KUBE-PORTALS-CONTAINER  from PREROUTING, first    ClusterIP, LB IPs, externalIPs -> REDIRECT (or DNAT to the bind IP)
//	nat    KUBE-PORTALS-HOST       from OUTPUT, first        same addresses -> DNAT to host IP:proxy port
//	nat    KUBE-NODEPORT-CONTAINER from PREROUTING, last     NodePorts (dst-type LOCAL) -> REDIRECT
//	nat    KUBE-NODEPORT-HOST      from OUTPUT, last         NodePorts (dst-type LOCAL) -> DNAT
//	filter KUBE-NODEPORT-NON-LOCAL from INPUT, first         ACCEPT what a NodePort rule redirected to its proxy port
//	filter KUBE-PORTALS-FILTER     from INPUT, FORWARD, OUTPUT, first (ctstate NEW)
//	                                                         REJECT / DROP for portals without usable endpoints
//	filter KUBE-PORTALS-PROXY-PORTS from INPUT, first (ctstate NEW)
//	                                                         REJECT what reaches a proxy port without a portal rule
//	both   KUBE-…-NEW              from each chain above but KUBE-PORTALS-PROXY-PORTS, before the canary
//	                                                         the rules Update added since the last full write
//	both   KUBE-PORTALS-CANARY     from each chain above, last   nothing (see below)
//
// NodePorts on loopback addresses follow kube-proxy's iptables mode: 127.0.0.0/8 serves them
// unless Config.NoLocalhostNodePorts (`! -d 127.0.0.0/8` in the NodePort rules), ::1 never
// (`! -d ::1/128`). No route_localnet is needed: the rules DNAT to a local address.
//
// ExternalIPs follow kube-proxy's iptables mode too, not the userspace mode: one CONTAINER and one
// HOST rule per address, matching the destination alone, so traffic from pods (bridged in or not)
// and from the node itself is served whether or not the address is the node's. The userspace
// mode matched only traffic not bridged in (physdev) or to a local address (addrtype), and a pod
// behind a bridge reaching an externalIP of no node was routed to the real address instead.
//
// Update appends a changed portal's rules to its chain's recent chain (KUBE-PORTALS-CONTAINER-NEW,
// …), not to the chain: iptables-nft-restore reads every rule of the chain it appends to (at
// 10,000 service ports ~17 ms for the long chains, ~1.5 ms for a short one); the next full write
// folds them back. It renders only the portals whose digest it has not written (incremental.go).
// A restarted proxy's first Sync writes nothing when the earlier run's rules are the ones it would
// write (adopt.go).
//
// and, beyond upstream, --nodeport-addresses (Config.NodePortAddresses), the reject/drop chain,
// redirects of pod traffic (Config.ClusterCIDRs) to Local services' external addresses, and
// loadBalancerSourceRanges (Portal.LoadBalancerSourceRanges): load-balancer IP rules in the
// CONTAINER and HOST chains match only sources inside the ranges (`-s`), and KUBE-PORTALS-FILTER
// DROPs new traffic to the load-balancer IP that no rule redirected, as kube-proxy's
// KUBE-PROXY-FIREWALL does.
//
// Only redirected traffic reaches a proxy port. Conntrack sets its DNAT status on every flow a
// REDIRECT or DNAT rewrote, in PREROUTING as in OUTPUT, so KUBE-PORTALS-PROXY-PORTS refuses
// (TCP reset, ICMP port unreachable) new flows to a proxy port without it: a client that
// connects to node-IP:proxy-port directly, past externalTrafficPolicy and transparent mode, is
// turned away as if nothing listened there (as with kube-proxy's iptables mode), and so is the
// node itself on loopback (with Config.BindIP set, only that address is guarded: the port
// number is free for other programs on the others). KUBE-NODEPORT-NON-LOCAL, upstream's hole for default-deny host
// firewalls, accepts only flows whose original destination was the NodePort
// (--ctorigdstport), on the node addresses --nodeport-addresses selects (--ctorigdst) when it
// is set; it accepts nothing for ClusterIPs, externalIPs or load-balancer IPs (upstream's
// port-only match accepted every new connection to the proxy port).
//
// Each chain of ours ends in a jump to KUBE-PORTALS-CANARY, an empty chain of the same table.
// A Manager rewrites every rule only when there is reason to: the first sync, a failed or
// partial write since the last, changed rules, a change someone else made to ours, and at least
// once per Options.RewritePeriod (an hour). The periodic Sync of an idle proxy only checks that
// its rules are in place and writes nothing. With iptables-nft the check is one listing per
// built-in chain we jump from, and one of each canary chain, whose reference count drops when
// someone flushes or deletes one of our chains (a rule deleted inside a chain is repaired by
// the hourly rewrite); with iptables-legacy, where every listing reads a whole table, it is
// one iptables-save per table, compared rule by rule with what was written.
//
// After each sync a Manager with Options.Flows deletes the conntrack entries of UDP flows whose
// portal changed (portal/conntrack), so that they meet the new rules: exactly those whose
// original destination is the changed address and port (for a NodePort, each node address it
// is served on), all of a sync's in one run of the conntrack tool, which is killed when it
// takes too long.
package portal

import (
	"cmp"
	"errors"
	"fmt"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"net/netip"
	"slices"
	"strings"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
)

// Chains this package owns.
const (
	ChainPortalsContainer  = "KUBE-PORTALS-CONTAINER"
	ChainPortalsHost       = "KUBE-PORTALS-HOST"
	ChainNodePortContainer = "KUBE-NODEPORT-CONTAINER"
	ChainNodePortHost      = "KUBE-NODEPORT-HOST"
	ChainNodePortNonLocal  = "KUBE-NODEPORT-NON-LOCAL"
	ChainPortalsFilter     = "KUBE-PORTALS-FILTER"
	ChainProxyPorts        = "KUBE-PORTALS-PROXY-PORTS"
	// chainProbe is the scratch chain in which older versions tried the physdev match; Cleanup
	// and PruneStale still delete one left behind.
	chainProbe = "KUBE-PORTALS-PROBE"
)

// Tables.
const (
	tableNAT    = "nat"
	tableFilter = "filter"
)

// Portal is one service port in one IP family. Addresses of the other family are ignored.
type Portal struct {
	// Comment names the service port in every rule: "namespace/name:port"
	// (proxy.Name.String()).
	Comment string
	// Protocol is "tcp" or "udp".
	Protocol string
	// Port is the service port (spec.ports[].port).
	Port int
	// ClusterIP is the service's cluster IP in this family; the zero Addr for none.
	ClusterIP netip.Addr
	// ExternalIPs are spec.externalIPs.
	ExternalIPs []netip.Addr
	// LoadBalancerIPs are the load balancer's ingress IPs.
	LoadBalancerIPs []netip.Addr
	// LoadBalancerSourceRanges, when not empty, are the only sources whose traffic to the
	// LoadBalancerIPs is served (spec.loadBalancerSourceRanges); new traffic to them from other
	// sources is dropped, as kube-proxy does. Only valid prefixes of the portal's family match
	// anything: a list without one lets no source in. Nil: every source. The node's own traffic
	// is a source like any other; when a range holds Config.HostIP (Config.BindIP when set),
	// traffic from the load-balancer IPs themselves is let in too (a VIP the node holds is the
	// source of the node's own packets to it).
	LoadBalancerSourceRanges []netip.Prefix
	// NodePort is the service's node port; 0 for none.
	NodePort int
	// ProxyPort is the port of the proxy's listener for this service port. It may be 0 only when
	// neither Internal nor External is Redirect.
	ProxyPort int
	// Internal is what to do with new traffic to ClusterIP.
	Internal proxy.Action
	// External is what to do with new traffic to the NodePort, externalIPs and load-balancer IPs.
	External proxy.Action
}

// Validate reports the first invalid field of p, naming the portal and the field.
func (p Portal) Validate() error {
	bad := func(field, format string, args ...any) error {
		return fmt.Errorf("portal %q: %s: %s", p.Comment, field, fmt.Sprintf(format, args...))
	}
	switch {
	case p.Protocol != "tcp" && p.Protocol != "udp":
		return bad("protocol", "%q is not tcp or udp", p.Protocol)
	case p.Port < 1 || p.Port > 65535:
		return bad("port", "%d out of range 1..65535", p.Port)
	case p.NodePort < 0 || p.NodePort > 65535:
		return bad("nodePort", "%d out of range 0..65535", p.NodePort)
	case p.Internal < proxy.Redirect || p.Internal > proxy.Drop:
		return bad("internal", "unknown action %d", int(p.Internal))
	case p.External < proxy.Redirect || p.External > proxy.Drop:
		return bad("external", "unknown action %d", int(p.External))
	case (p.Internal == proxy.Redirect || p.External == proxy.Redirect) && (p.ProxyPort < 1 || p.ProxyPort > 65535):
		return bad("proxyPort", "%d out of range 1..65535", p.ProxyPort)
	}
	return nil
}

// Config is what rendering needs to know about the proxy and the node.
type Config struct {
	// Family is the IP family of the rules (and of the Runner that applies them).
	Family iptables.Family
	// BindIP is the address the proxy's listeners are bound to. The zero Addr or the unspecified
	// address mean all addresses: traffic from containers is then REDIRECTed (to the primary
	// address of the interface it came in on); otherwise it is DNATed to BindIP.
	BindIP netip.Addr
	// HostIP is where traffic the node itself sends to a portal is DNATed when BindIP is
	// unspecified (REDIRECT would break replies to locally generated UDP). Required then.
	HostIP netip.Addr
	// NodePortAddresses (kube-proxy's --nodeport-addresses) limits NodePorts to the node's
	// addresses inside these prefixes. Empty, no prefix of this family, or a /0 prefix of this
	// family mean every local address (matched with `-m addrtype --dst-type LOCAL`).
	NodePortAddresses []netip.Prefix
	// ClusterCIDRs (kube-proxy's --cluster-cidr) are the pods' addresses. Traffic from them to a
	// NodePort, externalIP or load-balancer IP of an externalTrafficPolicy: Local service without
	// a local endpoint is not dropped but sent to the proxy, which serves it from any endpoint,
	// as kube-proxy does for pod traffic it detects as local. Prefixes of the other family are
	// ignored.
	ClusterCIDRs []netip.Prefix
	// NoLocalhostNodePorts (kube-proxy's iptables.localhostNodePorts: false) keeps NodePorts off
	// the IPv4 loopback addresses: the node's own traffic to 127.0.0.1:NodePort is not redirected.
	// False serves it, as kube-proxy's default does. IPv6's loopback address never serves
	// NodePorts, as in kube-proxy's iptables mode.
	NoLocalhostNodePorts bool
}

// Host is what a Manager finds out about the node when it syncs. Render takes it as an argument so
// rendering stays a pure function.
type Host struct {
	// NodeIPs are the node's addresses (any family; Render filters them by Config.Family and
	// Config.NodePortAddresses). Unused when NodePortAddresses selects every address.
	NodeIPs []netip.Addr
}

// NodePortIPs returns the addresses NodePorts are served on: all is true when every local address
// serves them (see Config.NodePortAddresses), otherwise ips are the addresses of family in addrs
// that lie inside one of the prefixes, sorted, without duplicates (possibly none).
func NodePortIPs(family iptables.Family, prefixes []netip.Prefix, addrs []netip.Addr) (ips []netip.Addr, all bool) {
	var mine []netip.Prefix
	for _, p := range prefixes {
		p, ok := prefixIn(family, p)
		if !ok {
			continue
		}
		if p.Bits() == 0 {
			return nil, true
		}
		mine = append(mine, p)
	}
	if len(mine) == 0 {
		return nil, true
	}
	for _, a := range addrs {
		a = a.Unmap()
		if !inFamily(family, a) {
			continue
		}
		for _, p := range mine {
			if p.Contains(a) {
				ips = append(ips, a)
				break
			}
		}
	}
	slices.SortFunc(ips, netip.Addr.Compare)
	return slices.Compact(ips), false
}

// LoopbackNodePortWarnings says which loopback addresses --nodeport-addresses (prefixes) selects
// that serve no NodePorts all the same (see Config.NoLocalhostNodePorts), as kube-proxy logs them.
// A /0 prefix means every address, loopback's as far as it serves: nothing to warn about.
func LoopbackNodePortWarnings(prefixes []netip.Prefix, noLocalhost bool) []string {
	var out []string
	for _, p := range prefixes {
		switch p = p.Masked(); {
		case p.Bits() == 0:
		case noLocalhost && p.Contains(netip.AddrFrom4([4]byte{127, 0, 0, 1})):
			out = append(out, fmt.Sprintf("--nodeport-addresses %s holds localhost, but --iptables-localhost-nodeports=false: no NodePort on 127.0.0.0/8", p))
		case p.Contains(netip.IPv6Loopback()):
			out = append(out, fmt.Sprintf("--nodeport-addresses %s holds ::1, which never serves NodePorts (as in kube-proxy)", p))
		}
	}
	return out
}

// NodePortListenAddrs returns where a server for NodePort traffic listens (healthCheckNodePort
// servers): nil (every address) when prefixes is empty; otherwise, per family that has a prefix,
// the unspecified address when the family's prefix is /0, else the addresses of node inside the
// prefixes. It fails when no address matches.
func NodePortListenAddrs(prefixes []netip.Prefix, node []netip.Addr) ([]netip.Addr, error) {
	if len(prefixes) == 0 {
		return nil, nil
	}
	var out []netip.Addr
	for _, fam := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
		if !slices.ContainsFunc(prefixes, func(p netip.Prefix) bool { _, ok := prefixIn(fam, p); return ok }) {
			continue
		}
		ips, all := NodePortIPs(fam, prefixes, node)
		switch {
		case all && fam == iptables.IPv4:
			out = append(out, netip.IPv4Unspecified())
		case all:
			out = append(out, netip.IPv6Unspecified())
		default:
			out = append(out, ips...)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("no node address matches --nodeport-addresses")
	}
	return out, nil
}

// prefixIn returns p masked, as a prefix of family f, and whether it is one: an IPv4-mapped IPv6
// prefix of at least 96 bits ("::ffff:10.244.0.0/112") is the IPv4 prefix it maps
// (10.244.0.0/16), as addresses are unmapped everywhere.
func prefixIn(f iptables.Family, p netip.Prefix) (netip.Prefix, bool) {
	if !p.IsValid() {
		return netip.Prefix{}, false
	}
	p = p.Masked()
	if a := p.Addr(); a.Is4In6() && p.Bits() >= 96 {
		p = netip.PrefixFrom(a.Unmap(), p.Bits()-96)
	}
	if a := p.Addr(); f == iptables.IPv6 && !a.Is6() || f == iptables.IPv4 && !a.Is4() {
		return netip.Prefix{}, false
	}
	return p, true
}

func inFamily(f iptables.Family, a netip.Addr) bool {
	if !a.IsValid() {
		return false
	}
	if f == iptables.IPv6 {
		return a.Is6() && !a.Is4In6()
	}
	return a.Is4() || a.Is4In6()
}

// comparePortals orders portals for deterministic output.
func comparePortals(a, b *Portal) int {
	if c := strings.Compare(a.Comment, b.Comment); c != 0 {
		return c // almost always: only a port's protocols share a comment
	}
	return cmp.Or(
		strings.Compare(a.Protocol, b.Protocol),
		cmp.Compare(a.Port, b.Port),
		cmp.Compare(a.NodePort, b.NodePort),
		a.ClusterIP.Compare(b.ClusterIP),
		cmp.Compare(a.ProxyPort, b.ProxyPort),
	)
}
