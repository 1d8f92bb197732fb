package portal

import (
	"bytes"
	"cmp"
	"hash/maphash"
	"maps"
	"math"
	"net/netip"
	"slices"
	"strconv"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/iptables"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// natChains and filterChains list our chains per table: each chain of portal rules (see
// sectionChains) before its recent chain (Cleanup deletes them in this order).
func natChains() []string {
	return []string{ChainPortalsContainer, ChainPortalsHost, ChainNodePortContainer, ChainNodePortHost,
		recentChain(ChainPortalsContainer), recentChain(ChainPortalsHost), recentChain(ChainNodePortContainer), recentChain(ChainNodePortHost)}
}

func filterChains() []string {
	return []string{ChainNodePortNonLocal, ChainPortalsFilter, ChainProxyPorts,
		recentChain(ChainNodePortNonLocal), recentChain(ChainPortalsFilter)}
}

// sectionChains are the chains of portal rules, in the order of the layout's sections (see
// renderer.sections).
var sectionChains = [numSections]string{ChainPortalsContainer, ChainPortalsHost, ChainNodePortContainer, ChainNodePortHost,
	ChainNodePortNonLocal, ChainPortalsFilter}

// recentChain names the chain that holds the rules partial updates added to chain c since the
// last full write (see planByPortal); c's last rule before the canary jumps to it. Appending a
// rule to a chain costs iptables-nft-restore a read of the chain's rules: at 10,000 service
// ports ~17 ms for the two nat chains of a ClusterIP, against ~3 ms for a short chain.
func recentChain(c string) string { return c + "-NEW" }

// recentJumps appends, for the chains of sections [from, to), the jump from each to its recent
// chain.
func recentJumps(b []byte, from, to int) []byte {
	for _, c := range sectionChains[from:to] {
		b = append(append(append(append(append(b, "-A "...), c...), " -j "...), recentChain(c)...), '\n')
	}
	return b
}

// renderOrder returns the valid portals in render's order.
func renderOrder(portals []Portal) []*Portal {
	order := make([]*Portal, 0, len(portals))
	for i := range portals {
		if portals[i].Validate() == nil {
			order = append(order, &portals[i])
		}
	}
	if !slices.IsSortedFunc(order, comparePortals) { // the proxier's are, in name order
		slices.SortFunc(order, comparePortals)
	}
	return order
}

// render returns the iptables-restore input (the lines between "*table" and "COMMIT") that sets
// our nat and filter chains to exactly what the portals, in order (see renderOrder), need, with
// each portal's addresses by value and those not in cfg.Family left out; it does no I/O. With
// lay, it also records what each portal contributed (see layout); lay.counts is left nil when a
// count does not fit.
func render(cfg Config, host Host, order []*Portal, lay *layout) (nat, filter []byte) {
	r := newRenderer(cfg, host)
	// Sizes from a count keep appends from copying (~170 bytes a rule).
	var addrs, nodePorts int
	for _, p := range order {
		addrs += 1 + len(p.LoadBalancerIPs) + len(p.ExternalIPs)
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
	if lay != nil {
		lay.counts = make([]uint16, 0, len(order)*numSections)
	}
	for _, p := range order {
		if lay == nil {
			r.portal(p)
			continue
		}
		var before [numSections]int
		for s, sec := range r.sections() {
			before[s] = len(*sec)
		}
		r.portal(p)
		for s, sec := range r.sections() {
			n := bytes.Count((*sec)[before[s]:], newline)
			if n > math.MaxUint16 || lay.counts == nil {
				lay.counts = nil
				continue
			}
			lay.counts = append(lay.counts, uint16(n))
		}
	}
	r.pp = r.guardRules(make([]byte, 0, 200+100*len(order)/guardBucket))
	if lay != nil {
		lay.guards = maphash.Bytes(portalSeed, r.pp)
	}
	nat = declare(make([]byte, 0, len(r.pc)+len(r.ph)+len(r.nc)+len(r.nh)+640), natChains())
	nat = append(append(append(append(nat, r.pc...), r.ph...), r.nc...), r.nh...)
	nat = recentJumps(nat, 0, natSections)
	filter = declare(make([]byte, 0, len(r.nl)+len(r.pf)+len(r.pp)+400), filterChains())
	filter = append(append(append(filter, r.nl...), r.pf...), r.pp...)
	filter = recentJumps(filter, natSections, numSections)
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
	bindAll     bool         // listeners on all addresses: REDIRECT from containers
	hostDst     netip.Addr   // DNAT destination in HOST chains
	nodeIPs     []netip.Addr // the node addresses that serve NodePorts, unless allNodeIPs
	allNodeIPs  bool
	notLoopback []byte         // " ! -d LOOPBACK" when loopback addresses serve no NodePorts
	podCIDRs    []netip.Prefix // Config.ClusterCIDRs of this family
	reject      []byte         // the REJECT target for UDP in this family
	rejectTCP   []byte         // the REJECT target for TCP: a reset, not subject to ICMP rate limits
	drop        []byte
	accept      []byte
	pc, ph      []byte           // KUBE-PORTALS-CONTAINER, KUBE-PORTALS-HOST
	nc, nh      []byte           // KUBE-NODEPORT-CONTAINER, KUBE-NODEPORT-HOST
	nl, pf      []byte           // KUBE-NODEPORT-NON-LOCAL, KUBE-PORTALS-FILTER
	pp          []byte           // KUBE-PORTALS-PROXY-PORTS
	guarded     map[string][]int // per protocol: the proxy ports KUBE-PORTALS-PROXY-PORTS guards
	comment     string           // per portal: the quoted comment
	containerTg []byte           // per portal: "-j REDIRECT --to-ports N" or "-j DNAT --to-destination bind:N"
	hostTg      []byte           // per portal: "-j DNAT --to-destination host:N"
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
		if c, ok := prefixIn(cfg.Family, c); ok {
			r.podCIDRs = append(r.podCIDRs, anySource(c))
		}
	}
	r.reject = []byte("-j REJECT --reject-with icmp-port-unreachable")
	r.rejectTCP = []byte("-j REJECT --reject-with tcp-reset")
	if r.v6 {
		r.reject = []byte("-j REJECT --reject-with icmp6-port-unreachable")
	}
	r.drop = []byte("-j DROP")
	r.accept = []byte("-j ACCEPT")
	// Loopback addresses serve NodePorts as in kube-proxy's iptables mode: IPv4's unless
	// Config.NoLocalhostNodePorts, IPv6's never.
	switch {
	case r.v6:
		r.notLoopback = []byte(" ! -d ::1/128")
	case cfg.NoLocalhostNodePorts:
		r.notLoopback = []byte(" ! -d 127.0.0.0/8")
	}
	if r.notLoopback != nil {
		r.nodeIPs = slices.DeleteFunc(r.nodeIPs, netip.Addr.IsLoopback)
	}
	return r
}

// nodePortRule appends the rule of a NodePort on node address ip: on every local address when
// ip is the zero Addr, but for the loopback addresses that serve no NodePorts (notLoopback).
func (r *renderer) nodePortRule(b []byte, chain string, src netip.Prefix, ip netip.Addr, p *Portal, target []byte) []byte {
	if ip.IsValid() || r.notLoopback == nil {
		return r.ruleFrom(b, chain, src, ip, p, p.NodePort, "", target)
	}
	b = r.matchTail(append(r.matchHead(b, chain, src), r.notLoopback...), p, p.NodePort)
	b = append(append(b, ' '), target...)
	return append(b, '\n')
}

// nodePortPodRules is nodePortRule per cluster CIDR, for traffic from pods (see podRules).
func (r *renderer) nodePortPodRules(b []byte, chain string, ip netip.Addr, p *Portal, target []byte) []byte {
	for _, src := range r.podCIDRs {
		b = r.nodePortRule(b, chain, src, ip, p, target)
	}
	return b
}

// match appends "-A chain [-s src] [-d addr/len] -p P -m comment --comment "C" -m P --dport port",
// the order iptables-save prints these matches in.
func (r *renderer) match(b []byte, chain string, src netip.Prefix, dst netip.Addr, p *Portal, port int) []byte {
	return r.matchTail(r.appendDst(r.matchHead(b, chain, src), dst), p, port)
}

// matchHead appends "-A chain [-s src]", the start of match.
func (r *renderer) matchHead(b []byte, chain string, src netip.Prefix) []byte {
	b = append(b, "-A "...)
	b = append(b, chain...)
	if src.IsValid() {
		b = append(b, " -s "...)
		b = src.AppendTo(b)
	}
	return b
}

// matchTail appends "-p P -m comment --comment "C" -m P --dport port", the end of match.
func (r *renderer) matchTail(b []byte, p *Portal, port int) []byte {
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

// guardBucket is how many consecutive port numbers one rule of KUBE-PORTALS-PROXY-PORTS covers:
// multiport takes at most 15 ports.
const guardBucket = 15

// guardComment is the comment of the rules of KUBE-PORTALS-PROXY-PORTS.
const guardComment = `"proxy ports of kube-userspace-proxy"`

// guardRules appends the rules of KUBE-PORTALS-PROXY-PORTS: per protocol, one rule per block of
// guardBucket port numbers that holds proxy ports, listing them (multiport). A port per rule made
// this chain a third of all rules (at 10,000 service ports, 0.23 of 0.78 s of iptables-nft-restore,
// and as many rules for every new connection to traverse); a fixed block per rule keeps a partial
// sync's change to the one rule of the ports added or removed. The listener bound to one address
// leaves the port free on the others, for other programs: only that address is guarded.
func (r *renderer) guardRules(b []byte) []byte {
	var dst netip.Addr
	if !r.bindAll {
		dst = r.hostDst
	}
	for _, proto := range slices.Sorted(maps.Keys(r.guarded)) {
		ports := r.guarded[proto]
		slices.Sort(ports)
		ports = slices.Compact(ports)
		for len(ports) > 0 {
			n := 1
			for n < len(ports) && ports[n]/guardBucket == ports[0]/guardBucket {
				n++
			}
			b = r.appendDst(append(b, "-A "+ChainProxyPorts...), dst)
			b = append(b, " -p "...)
			b = append(b, proto...)
			b = append(b, " -m comment --comment "+guardComment+" -m multiport --dports "...)
			for i, port := range ports[:n] {
				if i > 0 {
					b = append(b, ',')
				}
				b = strconv.AppendInt(b, int64(port), 10)
			}
			b = append(b, " -m conntrack ! --ctstate DNAT "...)
			b = append(b, r.deny(proxy.Reject, proto)...)
			b = append(b, '\n')
			ports = ports[n:]
		}
	}
	return b
}

// appendDst appends " -d dst/32" (or /128), nothing for the zero dst.
func (r *renderer) appendDst(b []byte, dst netip.Addr) []byte {
	if !dst.IsValid() {
		return b
	}
	b = append(b, " -d "...)
	b = dst.AppendTo(b)
	if r.v6 {
		return append(b, "/128"...)
	}
	return append(b, "/32"...)
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
func (r *renderer) deny(a proxy.Action, protocol string) []byte {
	switch {
	case a == proxy.Drop:
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
	hostShortCircuit := p.External == proxy.Drop && p.ProxyPort > 0
	if p.Internal == proxy.Redirect || p.External == proxy.Redirect || hostShortCircuit {
		r.setTargets(p)
	}

	// The proxy port serves only traffic a portal rule sent there: conntrack marks what a
	// REDIRECT or DNAT (in PREROUTING or OUTPUT) rewrote, and anything else, from elsewhere or
	// from the node itself, is refused as if nothing listened. A listener bound to one address
	// leaves the port free on the others, for other programs: only that address is guarded.
	r.guard(p)

	// ClusterIP.
	if cip := p.ClusterIP.Unmap(); inFamily(r.cfg.Family, cip) {
		if p.Internal == proxy.Redirect {
			r.pc = r.rule(r.pc, ChainPortalsContainer, cip, p, p.Port, "", r.containerTg)
			r.ph = r.rule(r.ph, ChainPortalsHost, cip, p, p.Port, "", r.hostTg)
		} else {
			r.pf = r.rule(r.pf, ChainPortalsFilter, cip, p, p.Port, "", r.deny(p.Internal, p.Protocol))
		}
	}

	// Load-balancer IPs: like the ClusterIP, but external traffic, and only from the source
	// ranges when there are any: traffic from elsewhere is not redirected and meets a DROP in
	// the filter table, as in kube-proxy's KUBE-PROXY-FIREWALL.
	lbIPs := r.addrs(p.LoadBalancerIPs)
	var ranges []netip.Prefix
	restricted := len(p.LoadBalancerSourceRanges) > 0 && len(lbIPs) > 0
	if restricted {
		ranges = r.sourceRanges(p.LoadBalancerSourceRanges)
		restricted = len(ranges) != 1 || ranges[0].IsValid() // a /0 lets every source in
	}
	for _, ip := range lbIPs {
		srcs := []netip.Prefix{{}} // any source
		if restricted {
			srcs = ranges
			if r.allowFromNode(ranges) {
				srcs = append(slices.Clip(srcs), netip.PrefixFrom(ip, ip.BitLen()))
			}
		}
		if p.External == proxy.Redirect {
			for _, src := range srcs {
				r.pc = r.ruleFrom(r.pc, ChainPortalsContainer, src, ip, p, p.Port, "", r.containerTg)
			}
			for _, src := range srcs {
				r.ph = r.ruleFrom(r.ph, ChainPortalsHost, src, ip, p, p.Port, "", r.hostTg)
			}
			if restricted {
				r.pf = r.rule(r.pf, ChainPortalsFilter, ip, p, p.Port, "", r.drop)
			}
			continue
		}
		r.pf = r.rule(r.pf, ChainPortalsFilter, ip, p, p.Port, "", r.deny(p.External, p.Protocol))
		if hostShortCircuit {
			for _, src := range srcs {
				r.ph = r.ruleFrom(r.ph, ChainPortalsHost, src, ip, p, p.Port, "", r.hostTg)
			}
			for _, pod := range r.podCIDRs {
				for _, src := range srcs {
					if both, ok := intersect(pod, src); ok {
						r.pc = r.ruleFrom(r.pc, ChainPortalsContainer, both, ip, p, p.Port, "", r.containerTg)
					}
				}
			}
		}
	}

	// External IPs: as in kube-proxy, traffic from containers and from the node itself is served
	// whatever the address, whether it is one of the node's, routed to it, or neither (no
	// physdev or addrtype match): a pod's packets to an external IP of no node reach the proxy
	// instead of the network.
	for _, ip := range r.addrs(p.ExternalIPs) {
		if p.External != proxy.Redirect {
			r.pf = r.rule(r.pf, ChainPortalsFilter, ip, p, p.Port, "", r.deny(p.External, p.Protocol))
			if hostShortCircuit {
				r.ph = r.rule(r.ph, ChainPortalsHost, ip, p, p.Port, "", r.hostTg)
				r.pc = r.podRules(r.pc, ChainPortalsContainer, ip, p, p.Port, r.containerTg)
			}
			continue
		}
		r.pc = r.rule(r.pc, ChainPortalsContainer, ip, p, p.Port, "", r.containerTg)
		r.ph = r.rule(r.ph, ChainPortalsHost, ip, p, p.Port, "", r.hostTg)
	}

	// NodePort.
	if p.NodePort == 0 {
		return
	}
	if p.External != proxy.Redirect {
		if r.allNodeIPs {
			r.pf = r.rule(r.pf, ChainPortalsFilter, netip.Addr{}, p, p.NodePort, "-m addrtype --dst-type LOCAL", r.deny(p.External, p.Protocol))
		}
		for _, ip := range r.nodeIPs {
			r.pf = r.rule(r.pf, ChainPortalsFilter, ip, p, p.NodePort, "", r.deny(p.External, p.Protocol))
		}
		if hostShortCircuit {
			if r.allNodeIPs {
				r.nh = r.nodePortRule(r.nh, ChainNodePortHost, netip.Prefix{}, netip.Addr{}, p, r.hostTg)
				r.nc = r.nodePortPodRules(r.nc, ChainNodePortContainer, netip.Addr{}, p, r.containerTg)
				r.nl = r.podAccepts(r.nl, netip.Addr{}, p)
			}
			for _, ip := range r.nodeIPs {
				r.nh = r.nodePortRule(r.nh, ChainNodePortHost, netip.Prefix{}, ip, p, r.hostTg)
				r.nc = r.nodePortPodRules(r.nc, ChainNodePortContainer, ip, p, r.containerTg)
				r.nl = r.podAccepts(r.nl, ip, p)
			}
		}
		return
	}
	if r.allNodeIPs {
		r.nc = r.nodePortRule(r.nc, ChainNodePortContainer, netip.Prefix{}, netip.Addr{}, p, r.containerTg)
		r.nh = r.nodePortRule(r.nh, ChainNodePortHost, netip.Prefix{}, netip.Addr{}, p, r.hostTg)
		r.nl = r.rule(r.nl, ChainNodePortNonLocal, netip.Addr{}, p, p.ProxyPort, r.fromNodePort(netip.Addr{}, p.NodePort), r.accept)
	}
	for _, ip := range r.nodeIPs {
		r.nc = r.nodePortRule(r.nc, ChainNodePortContainer, netip.Prefix{}, ip, p, r.containerTg)
		r.nh = r.nodePortRule(r.nh, ChainNodePortHost, netip.Prefix{}, ip, p, r.hostTg)
		r.nl = r.rule(r.nl, ChainNodePortNonLocal, netip.Addr{}, p, p.ProxyPort, r.fromNodePort(ip, p.NodePort), r.accept)
	}
}

// guard records p's proxy port for the guards of KUBE-PORTALS-PROXY-PORTS (see guardRules).
func (r *renderer) guard(p *Portal) {
	if p.ProxyPort > 0 {
		if r.guarded == nil {
			r.guarded = map[string][]int{}
		}
		r.guarded[p.Protocol] = append(r.guarded[p.Protocol], p.ProxyPort)
	}
}

// sections returns the renderer's per-portal outputs in the order of the layout's sections:
// nat's chains, then filter's (KUBE-PORTALS-PROXY-PORTS, which holds no portal's rules, aside).
func (r *renderer) sections() [numSections]*[]byte {
	return [numSections]*[]byte{&r.pc, &r.ph, &r.nc, &r.nh, &r.nl, &r.pf}
}

// fromNodePort returns the conntrack match of KUBE-NODEPORT-NON-LOCAL: traffic a NodePort rule
// redirected (REDIRECT and DNAT both set conntrack's DNAT status) from nodePort on nodeIP (on
// any address when nodeIP is the zero Addr), whatever address it was redirected to.
func (r *renderer) fromNodePort(nodeIP netip.Addr, nodePort int) string {
	s := "-m conntrack --ctstate DNAT"
	if nodeIP.IsValid() {
		s += " --ctorigdst " + nodeIP.String()
	}
	return s + " --ctorigdstport " + strconv.Itoa(nodePort)
}

// podAccepts appends the KUBE-NODEPORT-NON-LOCAL rules for the pod traffic that a Drop portal's
// NodePort still redirects (see Config.ClusterCIDRs).
func (r *renderer) podAccepts(b []byte, nodeIP netip.Addr, p *Portal) []byte {
	for _, src := range r.podCIDRs {
		b = r.ruleFrom(b, ChainNodePortNonLocal, src, netip.Addr{}, p, p.ProxyPort, r.fromNodePort(nodeIP, p.NodePort), r.accept)
	}
	return b
}

// sourceRanges returns the valid prefixes of our family in ps (IPv4-mapped ones unmapped), masked,
// sorted, without duplicates; just the zero Prefix (any source: no -s match) when one is a /0.
func (r *renderer) sourceRanges(ps []netip.Prefix) []netip.Prefix {
	var out []netip.Prefix
	for _, p := range ps {
		if p, ok := prefixIn(r.cfg.Family, p); ok {
			if p.Bits() == 0 {
				return []netip.Prefix{{}} // every source
			}
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b netip.Prefix) int {
		return cmp.Or(a.Addr().Compare(b.Addr()), cmp.Compare(a.Bits(), b.Bits()))
	})
	return slices.Compact(out)
}

// anySource returns p, or the zero Prefix (no -s match) for a /0, which iptables-save would not
// print.
func anySource(p netip.Prefix) netip.Prefix {
	if p.Bits() == 0 {
		return netip.Prefix{}
	}
	return p
}

// allowFromNode reports whether one of the source ranges holds the node's address (kube-proxy's
// nodeIP: the host IP, or the bind IP when set).
func (r *renderer) allowFromNode(ranges []netip.Prefix) bool {
	for _, p := range ranges {
		if p.Contains(r.hostDst) {
			return true
		}
	}
	return false
}

// intersect returns the addresses two prefixes share, which is one of them or nothing; the zero
// Prefix stands for every address.
func intersect(a, b netip.Prefix) (netip.Prefix, bool) {
	switch {
	case !b.IsValid():
		return a, true
	case !a.IsValid():
		return b, true
	case a.Bits() <= b.Bits() && a.Contains(b.Addr()):
		return b, true
	case b.Bits() <= a.Bits() && b.Contains(a.Addr()):
		return a, true
	}
	return netip.Prefix{}, false
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
