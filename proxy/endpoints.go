package proxy

import (
	"errors"
	"fmt"
	"net/netip"
	"sort"

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

// EndpointsFromSlices merges the EndpointSlices of one service into Endpoints per port name.
// Slices of address type FQDN are ignored. An endpoint listed in several slices appears once
// (the first ready copy wins). Invalid fields are left out and reported together in the error.
// Each port's list is sorted by address so equal inputs give equal outputs.
//
// An endpoint's hints.forZones and hints.forNodes become its ZoneHints and NodeHints; a hint whose
// name is not a valid zone (label value) or node name is reported and left out.
func EndpointsFromSlices(svc types.NamespacedName, slices []*discovery.EndpointSlice) (map[string][]Endpoint, error) {
	var errs []error
	out := map[string][]Endpoint{}
	index := map[string]map[netip.AddrPort]int{}
	for _, s := range slices {
		if s == nil || s.AddressType == discovery.AddressTypeFQDN {
			continue
		}
		obj := "EndpointSlice " + s.Namespace + "/" + s.Name
		bad := func(field, format string, args ...any) {
			errs = append(errs, &FieldError{Object: obj, Field: field, Detail: fmt.Sprintf(format, args...)})
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
			if index[portName] == nil {
				index[portName] = map[netip.AddrPort]int{}
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
					if i, dup := index[portName][ap]; dup {
						if !out[portName][i].Ready && ready {
							out[portName][i] = ep
						}
						continue
					}
					index[portName][ap] = len(out[portName])
					out[portName] = append(out[portName], ep)
				}
			}
		}
	}
	for _, eps := range out {
		sort.Slice(eps, func(i, j int) bool { return eps[i].Addr.Compare(eps[j].Addr) < 0 })
	}
	_ = svc
	return out, errors.Join(errs...)
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
