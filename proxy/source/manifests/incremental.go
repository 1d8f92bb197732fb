package manifests

import (
	"net/netip"
	"slices"
	"sort"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/source"
)

// The incremental merge.
//
// A full merge (merge) looks at every object of every file: at 10,000 services ~100 ms, most of
// the time from one changed file to the delivery of its one new service. When the last merge
// found no problem at all (no object in two files, no allocation warning), the next one only
// needs the objects whose version changed: scan notes their keys (touched), and mergeChanged
// merges just those, allocating their cluster IPs and node ports against what the other
// services hold (owners). Whatever could make it differ from a full merge sends it back to one:
// a touched object in two files, an allocation problem (an explicit address another service
// holds, which a full merge would move that service off), a fatal one. A full merge follows any
// merge with problems, so what is reported stays the full merge's.

// owners are the cluster IPs and node ports the delivered services hold, by "ns/name".
type owners struct {
	ips   map[netip.Addr]string
	ports map[int32]string
}

// ownersOf returns what the services of final hold.
func ownersOf(final map[objKey]*delivered) *owners {
	o := &owners{ips: make(map[netip.Addr]string, len(final)/2), ports: map[int32]string{}}
	for k, d := range final {
		if d.svc != nil {
			o.add(k.Namespace+"/"+k.Name, d.svc)
		}
	}
	return o
}

// add records what svc (a delivered version of the service name) holds.
func (o *owners) add(name string, svc *v1.Service) {
	for _, s := range svc.Spec.ClusterIPs {
		if ip, err := netip.ParseAddr(s); err == nil {
			o.ips[ip.Unmap()] = name
		}
	}
	for _, p := range heldNodePorts(svc) {
		o.ports[p] = name
	}
}

// drop forgets what svc (a delivered version of the service name) holds.
func (o *owners) drop(name string, svc *v1.Service) {
	for _, s := range svc.Spec.ClusterIPs {
		if ip, err := netip.ParseAddr(s); err == nil && o.ips[ip.Unmap()] == name {
			delete(o.ips, ip.Unmap())
		}
	}
	for _, p := range heldNodePorts(svc) {
		if o.ports[p] == name {
			delete(o.ports, p)
		}
	}
}

// heldNodePorts returns the node ports a completed service holds: those allocateNodePorts
// reserves or allocates (a node port on a ClusterIP service is ignored there, and here).
func heldNodePorts(svc *v1.Service) []int32 {
	spec := &svc.Spec
	if spec.Type != v1.ServiceTypeNodePort && spec.Type != v1.ServiceTypeLoadBalancer {
		return nil
	}
	var out []int32
	for _, p := range spec.Ports {
		if p.NodePort != 0 {
			out = append(out, p.NodePort)
		}
	}
	if spec.Type == v1.ServiceTypeLoadBalancer && spec.ExternalTrafficPolicy == v1.ServiceExternalTrafficPolicyLocal && spec.HealthCheckNodePort != 0 {
		out = append(out, spec.HealthCheckNodePort)
	}
	return out
}

// nodePortKeys returns the allocation keys of the node ports svc may have been given (see
// allocateNodePorts).
func nodePortKeys(name string, svc *v1.Service) []string {
	out := []string{name + "#healthCheck"}
	for _, p := range svc.Spec.Ports {
		out = append(out, name+":"+p.Name)
	}
	return out
}

// noteTouched records, for the next merge, the keys whose version differs between a file's
// objects before (prev) and now (next). Versions are compared by identity: a document that
// did not change keeps its decoded object (see docCache).
func (s *Source) noteTouched(prev, next map[objKey]*entry) {
	if s.touched == nil {
		s.touched = map[objKey]bool{}
	}
	for k, e := range next {
		if p := prev[k]; p == nil || p.svc != e.svc || p.slice != e.slice || p.stale != e.stale {
			s.touched[k] = true
		}
	}
	for k := range prev {
		if next[k] == nil {
			s.touched[k] = true
		}
	}
}

// mergeChanged merges the touched objects only (see the comment at the top) and reports
// whether it could; when it returns false the caller does a full merge, which rebuilds
// whatever mergeChanged changed on the way.
func (s *Source) mergeChanged(h source.Handler) bool {
	if s.inc == nil || s.fullMergesOnly {
		return false
	}
	names := make([]string, 0, len(s.files))
	for name := range s.files {
		names = append(names, name)
	}
	sort.Strings(names)
	keys := slices.SortedFunc(func(yield func(objKey) bool) {
		for k := range s.touched {
			if !yield(k) {
				return
			}
		}
	}, compareKeys)
	want := make(map[objKey]candidate, len(keys))
	var svcKeys []objKey
	for _, k := range keys {
		claims := 0
		for _, name := range names {
			if e := s.files[name].objects[k]; e != nil {
				claims++
				want[k] = candidate{file: name, e: e}
			}
		}
		if claims > 1 {
			return false // a duplicate: reported by the full merge
		}
		if c, ok := want[k]; ok && c.e.svc != nil {
			svcKeys = append(svcKeys, k)
		}
	}
	// What the touched services hold is theirs to keep or give up: allocate against the others.
	for _, k := range keys {
		if d := s.delivered[k]; d != nil && d.svc != nil {
			s.inc.drop(k.Namespace+"/"+k.Name, d.svc)
		}
	}
	svcs := make([]*v1.Service, len(svcKeys))
	for i, k := range svcKeys {
		svcs[i] = want[k].e.svc
	}
	done, next, aps := s.alloc.allocateAgainst(svcs, s.allocated, s.inc)
	if len(aps) > 0 {
		return false
	}
	// Carry the allocation over: the touched services' entries are replaced, the others kept.
	for _, k := range keys {
		d := s.delivered[k]
		if d == nil || d.svc == nil {
			continue
		}
		name := k.Namespace + "/" + k.Name
		delete(s.allocated.ips, name)
		for _, pk := range nodePortKeys(name, d.from) {
			delete(s.allocated.ports, pk)
		}
		delete(s.allocated.done, d.from)
	}
	for name, ips := range next.ips {
		s.allocated.ips[name] = ips
	}
	for pk, p := range next.ports {
		s.allocated.ports[pk] = p
	}
	for from, svc := range next.done {
		s.allocated.done[from] = svc
	}

	changes := make(map[objKey]*delivered, len(keys))
	for _, k := range keys {
		changes[k] = nil // deleted, unless found below
	}
	for i, k := range svcKeys {
		prev := s.delivered[k]
		switch {
		case prev != nil && prev.from == svcs[i] && sameAllocation(prev.svc, done[i]):
			changes[k] = &delivered{svc: prev.svc, from: svcs[i], file: want[k].file}
		default:
			changes[k] = &delivered{svc: done[i], from: svcs[i], file: want[k].file}
		}
	}
	for k, c := range want {
		if c.e.slice != nil {
			changes[k] = &delivered{slice: c.e.slice, file: c.file}
		}
	}
	s.deliverChanges(h, keys, changes)
	for _, k := range svcKeys {
		s.inc.add(k.Namespace+"/"+k.Name, s.delivered[k].svc)
	}
	s.touched = nil
	s.incrementalMerges++
	return true
}
