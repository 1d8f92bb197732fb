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
//	filter KUBE-NODEPORT-NON-LOCAL from INPUT, first         ACCEPT new connections to NodePorts' proxy ports
//	filter KUBE-PORTALS-FILTER     from INPUT, FORWARD, OUTPUT, first (ctstate NEW)
//	                                                         REJECT / DROP for portals without usable endpoints
//
// and, beyond upstream, --nodeport-addresses (Config.NodePortAddresses), the reject/drop chain,
// and redirects of pod traffic (Config.ClusterCIDRs) to Local services' external addresses.
// After each sync a Manager with Options.Flows deletes the conntrack entries of UDP flows whose
// portal changed (portal/conntrack), so that they meet the new rules.
package portal

import (
	"cmp"
	"fmt"
	"net"
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
	// chainProbe is a short-lived chain used to find out whether the kernel has the physdev match.
	chainProbe = "KUBE-PORTALS-PROBE"
)

// Tables.
const (
	tableNAT    = "nat"
	tableFilter = "filter"
)

// Action says what happens to new traffic to a portal.
type Action int

// Actions.
const (
	// Redirect sends new traffic to the proxy's listener (the zero value).
	Redirect Action = iota
	// Reject refuses new traffic: TCP connections get a reset, UDP datagrams an ICMP port
	// unreachable; the client sees "connection refused" at once. For service ports without any
	// endpoint.
	Reject
	// Drop silently drops new traffic. For externalTrafficPolicy (or internalTrafficPolicy) Local
	// with no endpoint on this node.
	Drop
)

// String returns "redirect", "reject" or "drop".
func (a Action) String() string {
	switch a {
	case Redirect:
		return "redirect"
	case Reject:
		return "reject"
	case Drop:
		return "drop"
	}
	return fmt.Sprintf("Action(%d)", int(a))
}

// Portal is one service port in one IP family. Addresses of the other family are ignored.
type Portal struct {
	// Comment names the service port in every rule: "namespace/name:port"
	// (serviceport.Name.String()).
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
	// NodePort is the service's node port; 0 for none.
	NodePort int
	// ProxyPort is the port of the proxy's listener for this service port. It may be 0 only when
	// neither Internal nor External is Redirect.
	ProxyPort int
	// Internal is what to do with new traffic to ClusterIP.
	Internal Action
	// External is what to do with new traffic to the NodePort, externalIPs and load-balancer IPs.
	External Action
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
	case p.Internal < Redirect || p.Internal > Drop:
		return bad("internal", "unknown action %d", int(p.Internal))
	case p.External < Redirect || p.External > Drop:
		return bad("external", "unknown action %d", int(p.External))
	case (p.Internal == Redirect || p.External == Redirect) && (p.ProxyPort < 1 || p.ProxyPort > 65535):
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
}

// Host is what a Manager finds out about the node when it syncs. Render takes it as an argument so
// rendering stays a pure function.
type Host struct {
	// NodeIPs are the node's addresses (any family; Render filters them by Config.Family and
	// Config.NodePortAddresses). Unused when NodePortAddresses selects every address.
	NodeIPs []netip.Addr
	// NoPhysdev is true when the kernel lacks the physdev match: externalIP rules for traffic
	// from containers then match on the destination alone.
	NoPhysdev bool
}

// NodePortIPs returns the addresses NodePorts are served on: all is true when every local address
// serves them (see Config.NodePortAddresses), otherwise ips are the addresses of family in addrs
// that lie inside one of the prefixes, sorted, without duplicates (possibly none).
func NodePortIPs(family iptables.Family, prefixes []netip.Prefix, addrs []netip.Addr) (ips []netip.Addr, all bool) {
	var mine []netip.Prefix
	for _, p := range prefixes {
		p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()).Masked()
		if !p.IsValid() || !inFamily(family, p.Addr()) {
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

// InterfaceAddrs returns the addresses of all the node's interfaces (net.InterfaceAddrs).
func InterfaceAddrs() ([]netip.Addr, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return nil, fmt.Errorf("list interface addresses: %w", err)
	}
	out := make([]netip.Addr, 0, len(addrs))
	for _, a := range addrs {
		var ip net.IP
		switch v := a.(type) {
		case *net.IPNet:
			ip = v.IP
		case *net.IPAddr:
			ip = v.IP
		default:
			continue
		}
		if addr, ok := netip.AddrFromSlice(ip); ok {
			out = append(out, addr.Unmap())
		}
	}
	return out, nil
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
	return cmp.Or(
		strings.Compare(a.Comment, b.Comment),
		strings.Compare(a.Protocol, b.Protocol),
		cmp.Compare(a.Port, b.Port),
		cmp.Compare(a.NodePort, b.NodePort),
		a.ClusterIP.Compare(b.ClusterIP),
		cmp.Compare(a.ProxyPort, b.ProxyPort),
	)
}
