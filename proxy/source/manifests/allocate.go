package manifests

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"maps"
	"net/netip"
	"slices"
	"sort"

	v1 "k8s.io/api/core/v1"
)

// Node ports are allocated from kube-apiserver's default --service-node-port-range.
const (
	NodePortMin = 30000
	NodePortMax = 32767
)

// Cluster IP and node port allocation.
//
// A service that needs a cluster IP (or a node port) and has none gets one derived from a hash
// (FNV-1a, 64 bit) of its key ("namespace/name" for cluster IPs, "namespace/name:portName" for
// node ports, "namespace/name#healthCheck" for health check node ports): offset = hash mod size,
// and the first free address (or port) from there on, wrapping around (linear probing).
//
// Order makes the result deterministic: addresses and ports given in manifests are reserved
// first; then services keep what they were given in the previous scan, if still free; then the
// rest are allocated in order of their key. So a running source never moves a service's address
// unless a manifest claims it explicitly, and a restart gives every service the same address
// unless two services' hashes collide (then the one sorting first gets the hashed slot).
//
// From a cluster IP range the network address and the first address (which the API server
// reserves for the "kubernetes" service) are never allocated, nor the IPv4 broadcast address.

// allocation is what was allocated, per service; it carries over from one scan to the next.
type allocation struct {
	ips   map[string]map[v1.IPFamily]netip.Addr // "ns/name" → family → address
	ports map[string]int32                      // node port key → port
	// done maps each service given to allocate (the decoded object) to its completed copy. A
	// service of type ClusterIP given again, and given the same addresses, gets the same copy:
	// no copy per service and scan, and an unchanged service stays the same object.
	done map[*v1.Service]*v1.Service
}

// allocProblem is a problem allocating for one service. fatal problems leave the service out
// (its last delivered version keeps serving); others are warnings.
type allocProblem struct {
	key   objKey
	fatal bool
	msg   string
}

// ipRange is the allocatable part of a service CIDR: size addresses from base+first on.
type ipRange struct {
	prefix netip.Prefix
	first  uint64
	size   uint64
}

func newIPRange(p netip.Prefix) (ipRange, error) {
	p = p.Masked()
	hostBits := p.Addr().BitLen() - p.Bits()
	var total uint64
	if hostBits >= 63 {
		total = 1 << 62 // more than any set of services can use
	} else {
		total = 1 << hostBits
	}
	r := ipRange{prefix: p, first: 2}
	reserved := uint64(2) // network address and the first address
	if p.Addr().Is4() {
		reserved++ // broadcast
	}
	if total <= reserved {
		return ipRange{}, fmt.Errorf("service CIDR %s is too small: no allocatable address", p)
	}
	r.size = total - reserved
	return r, nil
}

// addr returns the address at offset off (0 ≤ off < size).
func (r ipRange) addr(off uint64) netip.Addr {
	return addOffset(r.prefix.Addr(), r.first+off)
}

// addOffset returns a + off.
func addOffset(a netip.Addr, off uint64) netip.Addr {
	if a.Is4() {
		b := a.As4()
		v := binary.BigEndian.Uint32(b[:]) + uint32(off)
		binary.BigEndian.PutUint32(b[:], v)
		return netip.AddrFrom4(b)
	}
	b := a.As16()
	lo := binary.BigEndian.Uint64(b[8:])
	hi := binary.BigEndian.Uint64(b[:8])
	nlo := lo + off
	if nlo < lo {
		hi++
	}
	binary.BigEndian.PutUint64(b[8:], nlo)
	binary.BigEndian.PutUint64(b[:8], hi)
	return netip.AddrFrom16(b)
}

// allocatable reports whether a is an address allocate may hand out from r.
func (r ipRange) allocatable(a netip.Addr) bool {
	if !r.prefix.Contains(a) {
		return false
	}
	for off := uint64(0); off < r.first; off++ {
		if a == addOffset(r.prefix.Addr(), off) {
			return false
		}
	}
	return a != addOffset(r.prefix.Addr(), r.first+r.size) // IPv4 broadcast (or beyond a capped range)
}

func hash64(key string) uint64 {
	h := fnv.New64a()
	h.Write([]byte(key))
	return h.Sum64()
}

// probe returns the first offset from hash(key) mod size on for which free is true, trying at
// most limit+1 offsets; ok is false when none was free.
func probe(key string, size, limit uint64, free func(off uint64) bool) (uint64, bool) {
	start := hash64(key) % size
	tries := limit + 1
	if tries > size {
		tries = size
	}
	for i := uint64(0); i < tries; i++ {
		off := (start + i) % size
		if free(off) {
			return off, true
		}
	}
	return 0, false
}

func familyOf(a netip.Addr) v1.IPFamily {
	if a.Unmap().Is4() {
		return v1.IPv4Protocol
	}
	return v1.IPv6Protocol
}

// allocator allocates cluster IPs and node ports for one scan.
type allocator struct {
	ranges  map[v1.IPFamily]ipRange
	primary v1.IPFamily
}

func newAllocator(cidrs []netip.Prefix) (*allocator, error) {
	a := &allocator{ranges: map[v1.IPFamily]ipRange{}}
	for i, p := range cidrs {
		r, err := newIPRange(p)
		if err != nil {
			return nil, err
		}
		f := familyOf(p.Addr())
		if _, dup := a.ranges[f]; dup {
			return nil, fmt.Errorf("service CIDRs %v: more than one %s range", cidrs, f)
		}
		a.ranges[f] = r
		if i == 0 {
			a.primary = f
		}
	}
	if len(a.ranges) == 0 {
		return nil, fmt.Errorf("no service CIDR")
	}
	return a, nil
}

// svcPlan is what one service needs.
type svcPlan struct {
	key      objKey
	name     string // "ns/name"
	svc      *v1.Service
	families []v1.IPFamily // in order; the first len(explicit) have explicit addresses
	explicit []netip.Addr
	policy   v1.IPFamilyPolicy
	fatal    string
	got      familyAddrs // allocated addresses
}

// familyAddrs holds an address per IP family.
type familyAddrs map[v1.IPFamily]netip.Addr

// allocate fills in cluster IPs, IP families and node ports of services (sorted by key, already
// defaulted and validated) and returns the completed copies (nil for services with a fatal
// problem), the allocation to carry over, and the problems found.
func (a *allocator) allocate(svcs []*v1.Service, prev allocation) ([]*v1.Service, allocation, []allocProblem) {
	return a.allocateAgainst(svcs, prev, nil)
}

// allocateAgainst is allocate for some of the services, where taken holds what the others hold
// (nil: svcs are all of them). An address or port of taken that one of svcs claims explicitly
// is a problem: the full allocation would have moved its holder.
func (a *allocator) allocateAgainst(svcs []*v1.Service, prev allocation, taken *owners) ([]*v1.Service, allocation, []allocProblem) {
	var problems []allocProblem
	next := allocation{ips: map[string]map[v1.IPFamily]netip.Addr{}, ports: map[string]int32{}, done: make(map[*v1.Service]*v1.Service, len(svcs))}
	plans := make([]*svcPlan, len(svcs))
	used := map[netip.Addr]string{}
	if taken != nil {
		used = maps.Clone(taken.ips)
	}
	for i, svc := range svcs {
		p := a.plan(svc)
		plans[i] = p
		if p.fatal != "" {
			continue
		}
		for _, ip := range p.explicit {
			if other, dup := used[ip]; dup {
				problems = append(problems, allocProblem{key: p.key, msg: fmt.Sprintf("cluster IP %s is also used by Service %s", ip, other)})
			} else {
				used[ip] = p.name
			}
			if r, ok := a.ranges[familyOf(ip)]; !ok || !r.prefix.Contains(ip) {
				problems = append(problems, allocProblem{key: p.key, msg: fmt.Sprintf("cluster IP %s is outside the service CIDRs %s; serving it anyway (the API server would refuse it)", ip, a.cidrList())})
			}
		}
	}
	want := func(p *svcPlan) []v1.IPFamily { return p.families[len(p.explicit):] }
	// Keep last scan's addresses.
	for _, p := range plans {
		if p.fatal != "" {
			continue
		}
		for _, f := range want(p) {
			ip, ok := prev.ips[p.name][f]
			if !ok || !a.ranges[f].allocatable(ip) {
				continue
			}
			if _, taken := used[ip]; taken {
				continue
			}
			used[ip] = p.name
			p.got[f] = ip
		}
	}
	// Allocate the rest, in key order.
	for _, p := range plans {
		if p.fatal != "" {
			continue
		}
		for _, f := range want(p) {
			if _, ok := p.got[f]; ok {
				continue
			}
			r := a.ranges[f]
			off, ok := probe(p.name, r.size, uint64(len(used)), func(off uint64) bool {
				_, taken := used[r.addr(off)]
				return !taken
			})
			if !ok {
				p.fatal = fmt.Sprintf("service CIDR %s is exhausted: no cluster IP left", r.prefix)
				break
			}
			ip := r.addr(off)
			used[ip] = p.name
			p.got[f] = ip
		}
	}

	// Complete the copies.
	out := make([]*v1.Service, len(svcs))
	for i, p := range plans {
		if p.fatal != "" {
			problems = append(problems, allocProblem{key: p.key, fatal: true, msg: p.fatal})
			continue
		}
		addrs := make([]netip.Addr, len(p.families))
		for j, f := range p.families {
			addrs[j] = p.got[f]
			if j < len(p.explicit) {
				addrs[j] = p.explicit[j]
			}
		}
		if len(p.got) > 0 {
			next.ips[p.name] = p.got
		}
		out[i] = complete(p, addrs, prev.done[p.svc])
		next.done[p.svc] = out[i]
	}
	problems = append(problems, a.allocateNodePorts(out, plans, prev, next, taken)...)
	return out, next, problems
}

// complete returns p.svc completed with the cluster IPs addrs. For a service that needs no node
// ports (which are allocated on the copies afterwards): p.svc itself when it holds all of that
// already (an explicit cluster IP, defaulted when decoded), else last, the copy made by the
// previous allocation, when it has them. Otherwise a new copy.
func complete(p *svcPlan, addrs []netip.Addr, last *v1.Service) *v1.Service {
	if p.svc.Spec.Type == v1.ServiceTypeClusterIP && len(p.families) > 0 {
		if completed(p.svc, p, addrs) {
			return p.svc // nothing to fill in: no copy (one object per service)
		}
		if last != nil && sameAddrs(last.Spec.ClusterIPs, addrs) {
			return last
		}
	}
	svc := p.svc.DeepCopy()
	if len(p.families) > 0 {
		ips := make([]string, len(addrs))
		for i, a := range addrs {
			ips[i] = a.String()
		}
		svc.Spec.ClusterIP = ips[0]
		svc.Spec.ClusterIPs = ips
		svc.Spec.IPFamilies = append([]v1.IPFamily(nil), p.families...)
		policy := p.policy
		svc.Spec.IPFamilyPolicy = &policy
	}
	return svc
}

// completed reports whether svc holds already what complete would fill in: the cluster IPs
// addrs, p's families and policy.
func completed(svc *v1.Service, p *svcPlan, addrs []netip.Addr) bool {
	spec := &svc.Spec
	if len(addrs) == 0 || len(spec.ClusterIPs) != len(addrs) || spec.ClusterIP != spec.ClusterIPs[0] ||
		!slices.Equal(spec.IPFamilies, p.families) || spec.IPFamilyPolicy == nil || *spec.IPFamilyPolicy != p.policy {
		return false
	}
	for i, a := range addrs {
		if spec.ClusterIPs[i] != a.String() { // as written by complete: canonical
			return false
		}
	}
	return true
}

// sameAddrs reports whether the cluster IPs ips are addrs.
func sameAddrs(ips []string, addrs []netip.Addr) bool {
	if len(ips) != len(addrs) {
		return false
	}
	for i, s := range ips {
		if a, err := netip.ParseAddr(s); err != nil || a != addrs[i] {
			return false
		}
	}
	return true
}

func (a *allocator) cidrList() string {
	var s []string
	for _, f := range []v1.IPFamily{a.primary, other(a.primary)} {
		if r, ok := a.ranges[f]; ok {
			s = append(s, r.prefix.String())
		}
	}
	return fmt.Sprint(s)
}

func other(f v1.IPFamily) v1.IPFamily {
	if f == v1.IPv4Protocol {
		return v1.IPv6Protocol
	}
	return v1.IPv4Protocol
}

// plan works out the IP families a service gets, as the API server does: spec.ipFamilies, else
// the families of the given cluster IPs, else the primary family; dual-stack policies add the
// other family when the cluster has it.
func (a *allocator) plan(svc *v1.Service) *svcPlan {
	p := &svcPlan{key: objKey{Kind: kindService, Namespace: svc.Namespace, Name: svc.Name}, name: svc.Namespace + "/" + svc.Name, svc: svc, got: familyAddrs{}}
	if svc.Spec.Type == v1.ServiceTypeExternalName || svc.Spec.ClusterIP == v1.ClusterIPNone {
		return p // no cluster IP
	}
	p.policy = v1.IPFamilyPolicySingleStack
	if svc.Spec.IPFamilyPolicy != nil {
		p.policy = *svc.Spec.IPFamilyPolicy
	}
	for _, s := range svc.Spec.ClusterIPs {
		ip, err := netip.ParseAddr(s)
		if err != nil {
			p.fatal = fmt.Sprintf("invalid cluster IP %q", s) // validation catches this first
			return p
		}
		p.explicit = append(p.explicit, ip.Unmap())
	}
	fams := append([]v1.IPFamily(nil), svc.Spec.IPFamilies...)
	for i, ip := range p.explicit {
		f := familyOf(ip)
		if i < len(fams) && fams[i] != f {
			p.fatal = fmt.Sprintf("spec.clusterIPs[%d] %s is not of family spec.ipFamilies[%d] %s", i, ip, i, fams[i])
			return p
		}
		if i >= len(fams) {
			fams = append(fams, f)
		}
	}
	if len(fams) == 0 {
		fams = []v1.IPFamily{a.primary}
	}
	dual := len(a.ranges) == 2
	switch p.policy {
	case v1.IPFamilyPolicySingleStack:
		if len(fams) > 1 {
			p.fatal = "two IP families (spec.ipFamilies or spec.clusterIPs) but spec.ipFamilyPolicy is SingleStack"
			return p
		}
	case v1.IPFamilyPolicyRequireDualStack:
		if !dual {
			p.fatal = "spec.ipFamilyPolicy is RequireDualStack but the service CIDRs " + a.cidrList() + " are single-stack"
			return p
		}
		fallthrough
	case v1.IPFamilyPolicyPreferDualStack:
		if dual && len(fams) == 1 {
			fams = append(fams, other(fams[0]))
		}
	}
	for i, f := range fams {
		if _, ok := a.ranges[f]; ok || i < len(p.explicit) {
			p.families = append(p.families, f)
			continue
		}
		if i > 0 && p.policy == v1.IPFamilyPolicyPreferDualStack {
			continue // preferred, not required
		}
		p.fatal = fmt.Sprintf("needs an %s cluster IP but there is no %s service CIDR (have %s)", f, f, a.cidrList())
		return p
	}
	return p
}

// nodePortNeed is one node port a service needs.
type nodePortNeed struct {
	key  string // allocation key
	set  func(int32)
	plan *svcPlan
}

// allocateNodePorts fills in node ports and health check node ports on out (the completed
// copies; nil entries are skipped) in place.
func (a *allocator) allocateNodePorts(out []*v1.Service, plans []*svcPlan, prev, next allocation, taken *owners) []allocProblem {
	var problems []allocProblem
	used := map[int32]string{}
	if taken != nil {
		used = maps.Clone(taken.ports)
	}
	reserve := func(p *svcPlan, port int32, what string) {
		if other, dup := used[port]; dup && other != p.name {
			problems = append(problems, allocProblem{key: p.key, msg: fmt.Sprintf("%s %d is also used by Service %s", what, port, other)})
		}
		used[port] = p.name
		if port < NodePortMin || port > NodePortMax {
			problems = append(problems, allocProblem{key: p.key, msg: fmt.Sprintf("%s %d is outside %d-%d; serving it anyway", what, port, NodePortMin, NodePortMax)})
		}
	}
	var needs []nodePortNeed
	for i, svc := range out {
		if svc == nil {
			continue
		}
		p := plans[i]
		spec := &svc.Spec
		nodePorts := spec.Type == v1.ServiceTypeNodePort ||
			(spec.Type == v1.ServiceTypeLoadBalancer && (spec.AllocateLoadBalancerNodePorts == nil || *spec.AllocateLoadBalancerNodePorts))
		for j := range spec.Ports {
			port := &spec.Ports[j]
			switch {
			case port.NodePort != 0 && (spec.Type == v1.ServiceTypeNodePort || spec.Type == v1.ServiceTypeLoadBalancer):
				reserve(p, port.NodePort, fmt.Sprintf("spec.ports[%d].nodePort", j))
			case port.NodePort == 0 && nodePorts:
				needs = append(needs, nodePortNeed{key: p.name + ":" + port.Name, plan: p, set: func(v int32) { port.NodePort = v }})
			}
		}
		if spec.Type == v1.ServiceTypeLoadBalancer && spec.ExternalTrafficPolicy == v1.ServiceExternalTrafficPolicyLocal {
			if spec.HealthCheckNodePort != 0 {
				reserve(p, spec.HealthCheckNodePort, "spec.healthCheckNodePort")
			} else {
				needs = append(needs, nodePortNeed{key: p.name + "#healthCheck", plan: p, set: func(v int32) { spec.HealthCheckNodePort = v }})
			}
		}
	}
	sort.SliceStable(needs, func(i, j int) bool { return needs[i].key < needs[j].key })
	done := make([]bool, len(needs))
	for i, n := range needs {
		if v, ok := prev.ports[n.key]; ok && v >= NodePortMin && v <= NodePortMax {
			if _, taken := used[v]; !taken {
				used[v] = n.plan.name
				n.set(v)
				next.ports[n.key] = v
				done[i] = true
			}
		}
	}
	const size = NodePortMax - NodePortMin + 1
	for i, n := range needs {
		if done[i] {
			continue
		}
		off, ok := probe(n.key, size, uint64(len(used)), func(off uint64) bool {
			_, taken := used[int32(NodePortMin+off)]
			return !taken
		})
		if !ok {
			problems = append(problems, allocProblem{key: n.plan.key, msg: fmt.Sprintf("node port range %d-%d is exhausted; %s gets none", NodePortMin, NodePortMax, n.key)})
			continue
		}
		v := int32(NodePortMin + off)
		used[v] = n.plan.name
		n.set(v)
		next.ports[n.key] = v
	}
	return problems
}

// sameAllocation reports whether a and b, two completed copies of the same service (as allocate
// returns them), were given the same cluster IPs, IP families and node ports: the only fields
// allocate sets, so then they are equal.
func sameAllocation(a, b *v1.Service) bool {
	sa, sb := &a.Spec, &b.Spec
	if sa.ClusterIP != sb.ClusterIP || !slices.Equal(sa.ClusterIPs, sb.ClusterIPs) || !slices.Equal(sa.IPFamilies, sb.IPFamilies) ||
		(sa.IPFamilyPolicy == nil) != (sb.IPFamilyPolicy == nil) || (sa.IPFamilyPolicy != nil && *sa.IPFamilyPolicy != *sb.IPFamilyPolicy) ||
		sa.HealthCheckNodePort != sb.HealthCheckNodePort || len(sa.Ports) != len(sb.Ports) {
		return false
	}
	for i := range sa.Ports {
		if sa.Ports[i].NodePort != sb.Ports[i].NodePort {
			return false
		}
	}
	return true
}
