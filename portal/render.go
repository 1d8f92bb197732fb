package portal

import (
	"net/netip"
	"slices"
	"strconv"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
)

// natChains and filterChains list our chains per table.
func natChains() []string {
	return []string{ChainPortalsContainer, ChainPortalsHost, ChainNodePortContainer, ChainNodePortHost}
}

func filterChains() []string { return []string{ChainNodePortNonLocal, ChainPortalsFilter} }

// Render returns the iptables-restore input (the lines between "*table" and "COMMIT") that sets
// our nat and filter chains to exactly what portals need. Output is deterministic: portals are
// ordered by Comment, Protocol and ports, and each portal's addresses by value. Portals that fail
// Validate, and addresses not in cfg.Family, are left out. Render does no I/O.
func Render(cfg Config, host Host, portals []Portal) (nat, filter []byte) {
	r := newRenderer(cfg, host)
	order := make([]*Portal, 0, len(portals))
	for i := range portals {
		if portals[i].Validate() == nil {
			order = append(order, &portals[i])
		}
	}
	slices.SortFunc(order, comparePortals)
	// Sizes from a count keep appends from copying (~170 bytes a rule).
	var addrs, nodePorts int
	for _, p := range order {
		addrs += 1 + len(p.LoadBalancerIPs) + 2*len(p.ExternalIPs)
		if p.NodePort != 0 {
			nodePorts++
		}
	}
	perNodePort := 1 + len(r.nodeIPs)
	r.pc = make([]byte, 0, 170*addrs)
	r.ph = make([]byte, 0, 170*addrs)
	r.nc = make([]byte, 0, 170*nodePorts*perNodePort)
	r.nh = make([]byte, 0, 170*nodePorts*perNodePort)
	r.nl = make([]byte, 0, 170*nodePorts)
	r.pf = make([]byte, 0, 1024)
	for _, p := range order {
		r.portal(p)
	}
	nat = declare(make([]byte, 0, len(r.pc)+len(r.ph)+len(r.nc)+len(r.nh)+256), natChains())
	nat = append(append(append(append(nat, r.pc...), r.ph...), r.nc...), r.nh...)
	filter = declare(make([]byte, 0, len(r.nl)+len(r.pf)+128), filterChains())
	filter = append(append(filter, r.nl...), r.pf...)
	return nat, filter
}

// declare appends a ":CHAIN - [0:0]" line per chain: in iptables-restore --noflush input it creates
// the chain or flushes it, so each payload replaces exactly the contents of our chains.
func declare(b []byte, chains []string) []byte {
	for _, c := range chains {
		b = append(b, ':')
		b = append(b, c...)
		b = append(b, " - [0:0]\n"...)
	}
	return b
}

type renderer struct {
	cfg         Config
	host        Host
	v6          bool
	bindAll     bool       // listeners on all addresses: REDIRECT from containers
	hostDst     netip.Addr // DNAT destination in HOST chains
	nodeIPs     []netip.Addr
	allNodeIPs  bool
	podCIDRs    []netip.Prefix // Config.ClusterCIDRs of this family
	reject      []byte         // the REJECT target for UDP in this family
	rejectTCP   []byte         // the REJECT target for TCP: a reset, not subject to ICMP rate limits
	drop        []byte
	accept      []byte
	pc, ph      []byte // KUBE-PORTALS-CONTAINER, KUBE-PORTALS-HOST
	nc, nh      []byte // KUBE-NODEPORT-CONTAINER, KUBE-NODEPORT-HOST
	nl, pf      []byte // KUBE-NODEPORT-NON-LOCAL, KUBE-PORTALS-FILTER
	comment     string // per portal: the quoted comment
	containerTg []byte // per portal: "-j REDIRECT --to-ports N" or "-j DNAT --to-destination bind:N"
	hostTg      []byte // per portal: "-j DNAT --to-destination host:N"
}

func newRenderer(cfg Config, host Host) *renderer {
	r := &renderer{cfg: cfg, host: host, v6: cfg.Family == iptables.IPv6}
	r.bindAll = !cfg.BindIP.IsValid() || cfg.BindIP.IsUnspecified()
	r.hostDst = cfg.HostIP.Unmap()
	if !r.bindAll {
		r.hostDst = cfg.BindIP.Unmap()
	}
	r.nodeIPs, r.allNodeIPs = NodePortIPs(cfg.Family, cfg.NodePortAddresses, host.NodeIPs)
	for _, c := range cfg.ClusterCIDRs {
		if inFamily(cfg.Family, c.Addr()) {
			r.podCIDRs = append(r.podCIDRs, c.Masked())
		}
	}
	r.reject = []byte("-j REJECT --reject-with icmp-port-unreachable")
	r.rejectTCP = []byte("-j REJECT --reject-with tcp-reset")
	if r.v6 {
		r.reject = []byte("-j REJECT --reject-with icmp6-port-unreachable")
	}
	r.drop = []byte("-j DROP")
	r.accept = []byte("-j ACCEPT")
	return r
}

// match appends "-A chain [-s src] [-d addr/len] -p P -m comment --comment "C" -m P --dport port",
// the order iptables-save prints these matches in.
func (r *renderer) match(b []byte, chain string, src netip.Prefix, dst netip.Addr, p *Portal, port int) []byte {
	b = append(b, "-A "...)
	b = append(b, chain...)
	if src.IsValid() {
		b = append(b, " -s "...)
		b = src.AppendTo(b)
	}
	if dst.IsValid() {
		b = append(b, " -d "...)
		b = dst.AppendTo(b)
		if r.v6 {
			b = append(b, "/128"...)
		} else {
			b = append(b, "/32"...)
		}
	}
	b = append(b, " -p "...)
	b = append(b, p.Protocol...)
	b = append(b, " -m comment --comment "...)
	b = append(b, r.comment...)
	b = append(b, " -m "...)
	b = append(b, p.Protocol...)
	b = append(b, " --dport "...)
	b = strconv.AppendInt(b, int64(port), 10)
	return b
}

// rule appends one complete rule: match, then extra matches (may be ""), then the target.
func (r *renderer) rule(b []byte, chain string, dst netip.Addr, p *Portal, port int, extra string, target []byte) []byte {
	return r.ruleFrom(b, chain, netip.Prefix{}, dst, p, port, extra, target)
}

// podRules appends, per cluster CIDR, a rule for traffic from pods (see Config.ClusterCIDRs).
func (r *renderer) podRules(b []byte, chain string, dst netip.Addr, p *Portal, port int, target []byte) []byte {
	for _, src := range r.podCIDRs {
		b = r.ruleFrom(b, chain, src, dst, p, port, "", target)
	}
	return b
}

// ruleFrom is rule with a source match (none when src is the zero Prefix).
func (r *renderer) ruleFrom(b []byte, chain string, src netip.Prefix, dst netip.Addr, p *Portal, port int, extra string, target []byte) []byte {
	b = r.match(b, chain, src, dst, p, port)
	if extra != "" {
		b = append(b, ' ')
		b = append(b, extra...)
	}
	b = append(b, ' ')
	b = append(b, target...)
	return append(b, '\n')
}

func (r *renderer) appendAddrPort(b []byte, a netip.Addr, port int) []byte {
	if r.v6 {
		b = append(b, '[')
		b = a.AppendTo(b)
		b = append(b, ']')
	} else {
		b = a.AppendTo(b)
	}
	b = append(b, ':')
	return strconv.AppendInt(b, int64(port), 10)
}

func (r *renderer) setTargets(p *Portal) {
	r.containerTg = r.containerTg[:0]
	if r.bindAll {
		r.containerTg = append(r.containerTg, "-j REDIRECT --to-ports "...)
		r.containerTg = strconv.AppendInt(r.containerTg, int64(p.ProxyPort), 10)
	} else {
		r.containerTg = append(r.containerTg, "-j DNAT --to-destination "...)
		r.containerTg = r.appendAddrPort(r.containerTg, r.hostDst, p.ProxyPort)
	}
	r.hostTg = append(r.hostTg[:0], "-j DNAT --to-destination "...)
	r.hostTg = r.appendAddrPort(r.hostTg, r.hostDst, p.ProxyPort)
}

// deny returns the filter target for a (non-redirect) action and protocol. TCP is refused with a
// reset: ICMP errors are rate-limited per destination (and share their budget with ICMP
// redirects), so under a burst of connections some would wait for a SYN timeout instead.
func (r *renderer) deny(a Action, protocol string) []byte {
	switch {
	case a == Drop:
		return r.drop
	case protocol == "tcp":
		return r.rejectTCP
	}
	return r.reject
}

func (r *renderer) portal(p *Portal) {
	r.comment = iptables.Quote(p.Comment)
	// A Drop external action (Local policy, no local endpoint) still sends the node's own traffic
	// to the proxy, which gives it cluster-wide endpoints, as kube-proxy's "src-type LOCAL"
	// short-circuit does: only traffic from elsewhere is dropped. The HOST chains see only
	// locally generated packets, and their DNAT happens before the filter drop rules look. Traffic
	// from pods (Config.ClusterCIDRs) is redirected in the CONTAINER chains likewise, before the
	// filter table could drop it.
	hostShortCircuit := p.External == Drop && p.ProxyPort > 0
	if p.Internal == Redirect || p.External == Redirect || hostShortCircuit {
		r.setTargets(p)
	}

	// ClusterIP.
	if cip := p.ClusterIP.Unmap(); inFamily(r.cfg.Family, cip) {
		if p.Internal == Redirect {
			r.pc = r.rule(r.pc, ChainPortalsContainer, cip, p, p.Port, "", r.containerTg)
			r.ph = r.rule(r.ph, ChainPortalsHost, cip, p, p.Port, "", r.hostTg)
		} else {
			r.pf = r.rule(r.pf, ChainPortalsFilter, cip, p, p.Port, "", r.deny(p.Internal, p.Protocol))
		}
	}

	// Load-balancer IPs: like the ClusterIP, but external traffic.
	for _, ip := range r.addrs(p.LoadBalancerIPs) {
		if p.External == Redirect {
			r.pc = r.rule(r.pc, ChainPortalsContainer, ip, p, p.Port, "", r.containerTg)
			r.ph = r.rule(r.ph, ChainPortalsHost, ip, p, p.Port, "", r.hostTg)
		} else {
			r.pf = r.rule(r.pf, ChainPortalsFilter, ip, p, p.Port, "", r.deny(p.External, p.Protocol))
			if hostShortCircuit {
				r.ph = r.rule(r.ph, ChainPortalsHost, ip, p, p.Port, "", r.hostTg)
				r.pc = r.podRules(r.pc, ChainPortalsContainer, ip, p, p.Port, r.containerTg)
			}
		}
	}

	// External IPs: from containers, traffic not bridged in (physdev) and traffic to a local
	// external IP; from the node, only to a local external IP (others reach the real address).
	for _, ip := range r.addrs(p.ExternalIPs) {
		if p.External != Redirect {
			r.pf = r.rule(r.pf, ChainPortalsFilter, ip, p, p.Port, "", r.deny(p.External, p.Protocol))
			if hostShortCircuit {
				r.ph = r.rule(r.ph, ChainPortalsHost, ip, p, p.Port, "-m addrtype --dst-type LOCAL", r.hostTg)
				r.pc = r.podRules(r.pc, ChainPortalsContainer, ip, p, p.Port, r.containerTg)
			}
			continue
		}
		if r.host.NoPhysdev {
			r.pc = r.rule(r.pc, ChainPortalsContainer, ip, p, p.Port, "", r.containerTg)
		} else {
			r.pc = r.rule(r.pc, ChainPortalsContainer, ip, p, p.Port, "-m physdev ! --physdev-is-in", r.containerTg)
			r.pc = r.rule(r.pc, ChainPortalsContainer, ip, p, p.Port, "-m addrtype --dst-type LOCAL", r.containerTg)
		}
		r.ph = r.rule(r.ph, ChainPortalsHost, ip, p, p.Port, "-m addrtype --dst-type LOCAL", r.hostTg)
	}

	// NodePort.
	if p.NodePort == 0 {
		return
	}
	if p.External != Redirect {
		if r.allNodeIPs {
			r.pf = r.rule(r.pf, ChainPortalsFilter, netip.Addr{}, p, p.NodePort, "-m addrtype --dst-type LOCAL", r.deny(p.External, p.Protocol))
		}
		for _, ip := range r.nodeIPs {
			r.pf = r.rule(r.pf, ChainPortalsFilter, ip, p, p.NodePort, "", r.deny(p.External, p.Protocol))
		}
		if hostShortCircuit {
			if r.allNodeIPs {
				r.nh = r.rule(r.nh, ChainNodePortHost, netip.Addr{}, p, p.NodePort, "", r.hostTg)
				r.nc = r.podRules(r.nc, ChainNodePortContainer, netip.Addr{}, p, p.NodePort, r.containerTg)
			}
			for _, ip := range r.nodeIPs {
				r.nh = r.rule(r.nh, ChainNodePortHost, ip, p, p.NodePort, "", r.hostTg)
				r.nc = r.podRules(r.nc, ChainNodePortContainer, ip, p, p.NodePort, r.containerTg)
			}
		}
		return
	}
	if !r.allNodeIPs && len(r.nodeIPs) == 0 {
		return
	}
	if r.allNodeIPs {
		r.nc = r.rule(r.nc, ChainNodePortContainer, netip.Addr{}, p, p.NodePort, "", r.containerTg)
		r.nh = r.rule(r.nh, ChainNodePortHost, netip.Addr{}, p, p.NodePort, "", r.hostTg)
	}
	for _, ip := range r.nodeIPs {
		r.nc = r.rule(r.nc, ChainNodePortContainer, ip, p, p.NodePort, "", r.containerTg)
		r.nh = r.rule(r.nh, ChainNodePortHost, ip, p, p.NodePort, "", r.hostTg)
	}
	r.nl = r.rule(r.nl, ChainNodePortNonLocal, netip.Addr{}, p, p.ProxyPort, "-m state --state NEW", r.accept)
}

// addrs returns the addresses of our family in ips, unmapped, sorted, without duplicates.
func (r *renderer) addrs(ips []netip.Addr) []netip.Addr {
	if len(ips) == 1 {
		a := ips[0].Unmap()
		if inFamily(r.cfg.Family, a) {
			return []netip.Addr{a}
		}
		return nil
	}
	var out []netip.Addr
	for _, a := range ips {
		if a = a.Unmap(); inFamily(r.cfg.Family, a) {
			out = append(out, a)
		}
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return slices.Compact(out)
}
