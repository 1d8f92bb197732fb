package proxy

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
)

// SliceServiceName returns the service an EndpointSlice belongs to, from its
// kubernetes.io/service-name label; ok is false when the label is missing.
func SliceServiceName(s *discovery.EndpointSlice) (types.NamespacedName, bool) {
	name := s.Labels[discovery.LabelServiceName]
	if name == "" {
		return types.NamespacedName{}, false
	}
	return types.NamespacedName{Namespace: s.Namespace, Name: name}, true
}

// SliceEndpoints is what one EndpointSlice contributes to its service: the endpoints of each of
// its ports (each list sorted by address, an address once: its first ready copy, else its first)
// and the problems of its fields. The Tracker keeps this instead of the slice, so a source may
// let the slice go once delivered.
type SliceEndpoints struct {
	// Name is the slice's name.
	Name string
	// Ports is the slice's endpoints per port name, as EndpointsByPort (no port without
	// endpoints). Never changed in place once returned.
	Ports EndpointsByPort
	// Err reports the slice's invalid fields, which are left out (nil when there are none).
	Err error
}

// FromSlice returns what the slice s contributes to its service (see SliceEndpoints); an FQDN
// slice contributes nothing.
func FromSlice(s *discovery.EndpointSlice) SliceEndpoints {
	se := SliceEndpoints{Name: s.Name}
	if s.AddressType == discovery.AddressTypeFQDN {
		return se
	}
	var errs []error
	bad := func(field, format string, args ...any) {
		obj := "EndpointSlice " + s.Namespace + "/" + s.Name // only when there is a problem
		errs = append(errs, &FieldError{Object: obj, Field: field, Detail: fmt.Sprintf(format, args...)})
	}
	// byPort is built in place, a port name found by scanning (a slice has few ports): a map
	// would cost ~500 bytes and three allocations more per update for one port, the common case.
	var byPort EndpointsByPort
	var index map[string]map[netip.AddrPort]int
	addresses := 0
	for i := range s.Endpoints {
		addresses += len(s.Endpoints[i].Addresses)
	}
	for pi, p := range s.Ports {
		if p.Port == nil {
			bad(fmt.Sprintf("ports[%d].port", pi), "missing")
			continue
		}
		if *p.Port < 1 || *p.Port > 65535 {
			bad(fmt.Sprintf("ports[%d].port", pi), "%d out of range 1..65535", *p.Port)
			continue
		}
		portName := ""
		if p.Name != nil {
			portName = *p.Name
		}
		for ei, e := range s.Endpoints {
			ready := e.Conditions.Ready == nil || *e.Conditions.Ready
			serving := ready
			if e.Conditions.Serving != nil {
				serving = *e.Conditions.Serving
			}
			terminating := e.Conditions.Terminating != nil && *e.Conditions.Terminating
			node := ""
			if e.NodeName != nil {
				node = *e.NodeName
			}
			var zoneHints, nodeHints Hints
			if e.Hints != nil {
				report := bad
				if pi > 0 {
					report = func(string, string, ...any) {} // reported with the first port
				}
				zoneHints, nodeHints = hints(e.Hints, fmt.Sprintf("endpoints[%d].hints", ei), report)
			}
			for ai, a := range e.Addresses {
				ip, ok := parseIP(a)
				if !ok {
					if pi == 0 {
						bad(fmt.Sprintf("endpoints[%d].addresses[%d]", ei, ai), "invalid IP %q", a)
					}
					continue
				}
				ap := netip.AddrPortFrom(ip, uint16(*p.Port))
				ep := Endpoint{Addr: ap, Ready: ready, Serving: serving, Terminating: terminating, NodeName: node,
					ZoneHints: zoneHints, NodeHints: nodeHints}
				at := slices.IndexFunc(byPort, func(pe PortEndpoints) bool { return pe.Port == portName })
				if at < 0 {
					if byPort == nil {
						byPort = make(EndpointsByPort, 0, len(s.Ports))
					}
					byPort = append(byPort, PortEndpoints{Port: portName})
					at = len(byPort) - 1
				}
				list := byPort[at].Endpoints
				if len(list) > 0 { // one address once: a few endpoints are scanned, more indexed
					if i, dup := findEndpoint(list, index[portName], ap); dup {
						if !list[i].Ready && ready {
							list[i] = ep
						}
						continue
					}
				}
				if len(list) == indexFrom {
					if index == nil {
						index = map[string]map[netip.AddrPort]int{}
					}
					m := make(map[netip.AddrPort]int, 2*indexFrom)
					for i, x := range list {
						m[x.Addr] = i
					}
					index[portName] = m
				}
				if m := index[portName]; m != nil {
					m[ap] = len(list)
				}
				if list == nil {
					// Sized for every address at once: the list is kept (by the Tracker and the
					// balancer), and one grown by doubling would hold up to twice its endpoints.
					list = make([]Endpoint, 0, addresses)
				}
				byPort[at].Endpoints = append(list, ep)
			}
		}
	}
	for i := range byPort {
		slices.SortFunc(byPort[i].Endpoints, func(a, b Endpoint) int { return a.Addr.Compare(b.Addr) })
		byPort[i].Endpoints = slices.Clip(byPort[i].Endpoints)
	}
	slices.SortFunc(byPort, func(a, b PortEndpoints) int { return strings.Compare(a.Port, b.Port) })
	se.Ports = byPort
	se.Err = errors.Join(errs...)
	return se
}

// indexFrom is the length from which a port's endpoints are indexed by address while a slice is
// read; shorter lists are scanned.
const indexFrom = 16

// findEndpoint returns the index of the endpoint with address ap in list, through index when the
// list is indexed (nil: it is short, scan it).
func findEndpoint(list []Endpoint, index map[netip.AddrPort]int, ap netip.AddrPort) (int, bool) {
	if index != nil {
		i, ok := index[ap]
		return i, ok
	}
	for i := range list {
		if list[i].Addr == ap {
			return i, true
		}
	}
	return 0, false
}

// MergeSlices merges what the slices of one service contribute (in the order given: the
// Tracker's is by slice name) into its endpoints per port: an address listed by several slices
// once, its first ready copy (else its first). A port only one slice has keeps that slice's
// list, not a copy: a service of one slice (the common case) costs no second copy of its
// endpoints. The error joins the slices' FieldErrors in one flat list.
func MergeSlices(list []SliceEndpoints) (EndpointsByPort, error) {
	var errs []error
	for _, se := range list {
		if j, ok := se.Err.(interface{ Unwrap() []error }); ok {
			errs = append(errs, j.Unwrap()...) // one flat list of FieldErrors
		} else if se.Err != nil {
			errs = append(errs, se.Err)
		}
	}
	err := errors.Join(errs...)
	if len(list) == 1 {
		return list[0].Ports, err
	}
	var names []string
	for _, se := range list {
		for _, pe := range se.Ports {
			if !slices.Contains(names, pe.Port) {
				names = append(names, pe.Port)
			}
		}
	}
	if len(names) == 0 {
		return nil, err
	}
	slices.Sort(names)
	out := make(EndpointsByPort, 0, len(names))
	for _, name := range names {
		var from [][]Endpoint
		for _, se := range list {
			if eps := se.Ports.Get(name); len(eps) > 0 {
				from = append(from, eps)
			}
		}
		if len(from) == 1 {
			out = append(out, PortEndpoints{Port: name, Endpoints: from[0]})
			continue
		}
		var merged []Endpoint
		index := map[netip.AddrPort]int{}
		for _, eps := range from {
			for _, ep := range eps {
				if i, dup := index[ep.Addr]; dup {
					if !merged[i].Ready && ep.Ready {
						merged[i] = ep
					}
					continue
				}
				index[ep.Addr] = len(merged)
				merged = append(merged, ep)
			}
		}
		slices.SortFunc(merged, func(a, b Endpoint) int { return a.Addr.Compare(b.Addr) })
		out = append(out, PortEndpoints{Port: name, Endpoints: slices.Clip(merged)})
	}
	return out, err
}

// hints converts an endpoint's hints, reporting (through bad, under field) names that are not
// valid zone or node names, as the API server would have rejected them.
func hints(h *discovery.EndpointHints, field string, bad func(field, format string, args ...any)) (zones, nodes Hints) {
	names := make([]string, 0, max(len(h.ForZones), len(h.ForNodes)))
	for i, z := range h.ForZones {
		if errs := validation.IsValidLabelValue(z.Name); z.Name == "" || len(errs) > 0 {
			bad(fmt.Sprintf("%s.forZones[%d].name", field, i), "invalid zone name %q", z.Name)
			continue
		}
		names = append(names, z.Name)
	}
	zones = NewHints(names...)
	names = names[:0]
	for i, n := range h.ForNodes {
		if errs := validation.IsDNS1123Subdomain(n.Name); len(errs) > 0 {
			bad(fmt.Sprintf("%s.forNodes[%d].name", field, i), "invalid node name %q", n.Name)
			continue
		}
		names = append(names, n.Name)
	}
	return zones, NewHints(names...)
}
