package proxy

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	netutils "k8s.io/utils/net"
)

// ServiceProxyNameLabel marks services that belong to another service proxy; they are skipped.
const ServiceProxyNameLabel = "service.kubernetes.io/service-proxy-name"

// SkipReason says why a whole service is not proxied ("" when it is).
func SkipReason(svc *v1.Service) string {
	switch {
	case svc == nil:
		return "nil service"
	case svc.Spec.Type == v1.ServiceTypeExternalName:
		return "ExternalName service"
	case svc.Spec.ClusterIP == v1.ClusterIPNone:
		return "headless service"
	case svc.Spec.ClusterIP == "":
		return "service without a cluster IP"
	}
	if _, ok := svc.Labels[ServiceProxyNameLabel]; ok {
		return "service labelled " + ServiceProxyNameLabel
	}
	return ""
}

// FromService converts svc into its ServicePorts. It returns nil for services the proxy skips
// (see SkipReason). Invalid fields are left out and reported together in the error; the
// ServicePorts that could be built are returned alongside it. A service without a namespace or
// a name, or without a valid cluster IP, gives none. IP addresses are taken as the API server
// takes them: no IPv6 zone, and at most one cluster IP per family.
func FromService(svc *v1.Service) ([]*ServicePort, error) {
	if SkipReason(svc) != "" {
		return nil, nil
	}
	obj := "Service " + svc.Namespace + "/" + svc.Name
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, &FieldError{Object: obj, Field: field, Detail: fmt.Sprintf(format, args...)})
	}
	// The name is in every ServicePort's Name; the API server never hands out an object without.
	if svc.Namespace == "" {
		bad("metadata.namespace", "missing")
	}
	if svc.Name == "" {
		bad("metadata.name", "missing")
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}

	clusterIPs := svc.Spec.ClusterIPs
	clusterField := "spec.clusterIPs"
	if len(clusterIPs) == 0 {
		clusterIPs = []string{svc.Spec.ClusterIP}
		clusterField = "spec.clusterIP"
	}
	var cips []netip.Addr
	for i, s := range clusterIPs {
		ip, ok := parseIP(s)
		switch {
		case !ok:
			bad(fmt.Sprintf("%s[%d]", clusterField, i), "invalid IP %q", s)
		case len(cips) == 1 && cips[0].Is4() == ip.Is4(), len(cips) == 2:
			bad(fmt.Sprintf("%s[%d]", clusterField, i), "%q: at most one address per IP family", s)
		default:
			cips = append(cips, ip)
		}
	}
	if len(cips) == 0 {
		return nil, errors.Join(errs...)
	}

	var eips []netip.Addr
	for i, s := range svc.Spec.ExternalIPs {
		ip, ok := parseIP(s)
		if !ok {
			bad(fmt.Sprintf("spec.externalIPs[%d]", i), "invalid IP %q", s)
			continue
		}
		eips = append(eips, ip)
	}

	var lbips []netip.Addr
	if svc.Spec.Type == v1.ServiceTypeLoadBalancer {
		for i, ing := range svc.Status.LoadBalancer.Ingress {
			if ing.IP == "" {
				continue // hostname-only ingress has nothing for us to capture
			}
			ip, ok := parseIP(ing.IP)
			if !ok {
				bad(fmt.Sprintf("status.loadBalancer.ingress[%d].ip", i), "invalid IP %q", ing.IP)
				continue
			}
			if ing.IPMode != nil && *ing.IPMode == v1.LoadBalancerIPModeProxy {
				continue // the load balancer proxies to the NodePort itself
			}
			lbips = append(lbips, ip)
		}
	}

	var ranges []netip.Prefix
	if svc.Spec.Type == v1.ServiceTypeLoadBalancer {
		for i, s := range svc.Spec.LoadBalancerSourceRanges {
			p, err := parseSourceRange(s)
			if err != nil {
				bad(fmt.Sprintf("spec.loadBalancerSourceRanges[%d]", i), "invalid CIDR %q (it allows no source)", s)
			}
			ranges = append(ranges, p) // the zero Prefix when invalid: see ServicePort
		}
	}

	affinity := svc.Spec.SessionAffinity == v1.ServiceAffinityClientIP
	timeout := DefaultAffinityTimeout
	if affinity {
		if c := svc.Spec.SessionAffinityConfig; c != nil && c.ClientIP != nil && c.ClientIP.TimeoutSeconds != nil {
			t := *c.ClientIP.TimeoutSeconds
			if t <= 0 || t > 86400 {
				bad("spec.sessionAffinityConfig.clientIP.timeoutSeconds", "%d out of range 1..86400, using %d", t, int(DefaultAffinityTimeout/time.Second))
			} else {
				timeout = time.Duration(t) * time.Second
			}
		}
	} else if svc.Spec.SessionAffinity != "" && svc.Spec.SessionAffinity != v1.ServiceAffinityNone {
		bad("spec.sessionAffinity", "unsupported value %q, using None", svc.Spec.SessionAffinity)
	}

	externalLocal := svc.Spec.ExternalTrafficPolicy == v1.ServiceExternalTrafficPolicyLocal &&
		(svc.Spec.Type == v1.ServiceTypeNodePort || svc.Spec.Type == v1.ServiceTypeLoadBalancer || len(eips) > 0)
	internalLocal := svc.Spec.InternalTrafficPolicy != nil && *svc.Spec.InternalTrafficPolicy == v1.ServiceInternalTrafficPolicyLocal

	var pp ProxyProtocol
	if v, ok := svc.Annotations[ProxyProtocolAnnotation]; ok {
		switch ProxyProtocol(v) {
		case ProxyProtocolV1, ProxyProtocolV2:
			pp = ProxyProtocol(v)
		default:
			bad("metadata.annotations["+ProxyProtocolAnnotation+"]", "invalid value %q, want v1 or v2", v)
		}
	}

	topology := topologyRequest(svc, bad)

	hcnp := 0
	if externalLocal && svc.Spec.Type == v1.ServiceTypeLoadBalancer {
		if p := svc.Spec.HealthCheckNodePort; p < 0 || p > 65535 {
			bad("spec.healthCheckNodePort", "%d out of range 0..65535", p)
		} else {
			hcnp = int(p)
		}
	}

	var out []*ServicePort
	seen := map[string]bool{}
	for i, p := range svc.Spec.Ports {
		field := fmt.Sprintf("spec.ports[%d]", i)
		proto := p.Protocol
		if proto == "" {
			proto = v1.ProtocolTCP
		}
		switch {
		case proto != v1.ProtocolTCP && proto != v1.ProtocolUDP:
			bad(field+".protocol", "unsupported protocol %q (only TCP and UDP)", p.Protocol)
			continue
		case p.Port < 1 || p.Port > 65535:
			bad(field+".port", "%d out of range 1..65535", p.Port)
			continue
		case p.NodePort < 0 || p.NodePort > 65535:
			bad(field+".nodePort", "%d out of range 0..65535", p.NodePort)
			continue
		case seen[p.Name]:
			bad(field+".name", "duplicate port name %q", p.Name)
			continue
		}
		seen[p.Name] = true
		nodePort := 0
		if svc.Spec.Type == v1.ServiceTypeNodePort || svc.Spec.Type == v1.ServiceTypeLoadBalancer {
			nodePort = int(p.NodePort)
		}
		out = append(out, &ServicePort{
			Name:                     Name{Namespace: svc.Namespace, Name: svc.Name, Port: p.Name},
			Protocol:                 proto,
			Port:                     int(p.Port),
			NodePort:                 nodePort,
			ClusterIPs:               cips,
			ExternalIPs:              eips,
			LoadBalancerIPs:          lbips,
			LoadBalancerSourceRanges: ranges,
			SessionAffinity:          affinity,
			AffinityTimeout:          timeout,
			ExternalPolicyLocal:      externalLocal,
			InternalPolicyLocal:      internalLocal,
			HealthCheckNodePort:      hcnp,
			ProxyProtocol:            pp,
			Topology:                 topology,
		})
	}
	return out, errors.Join(errs...)
}

// parseIP parses an IP address as the API server accepts it: no IPv6 zone (which would also
// break the portals' iptables rules); an IPv4-mapped IPv6 address is taken as the IPv4 address.
func parseIP(s string) (netip.Addr, bool) {
	ip, err := netip.ParseAddr(s)
	if err != nil || ip.Zone() != "" {
		return netip.Addr{}, false
	}
	return ip.Unmap(), true
}

// parseSourceRange parses one entry of spec.loadBalancerSourceRanges as the API server validates
// it: surrounding spaces ignored (validation lets them through, and kube-proxy trims them too),
// IPv4 octets with leading zeros read as decimal (netutils.ParseCIDRSloppy), host bits cleared.
func parseSourceRange(s string) (netip.Prefix, error) {
	s = strings.TrimSpace(s)
	if p, err := netip.ParsePrefix(s); err == nil {
		return p.Masked(), nil
	}
	_, n, err := netutils.ParseCIDRSloppy(s)
	if err != nil {
		return netip.Prefix{}, err
	}
	addr, ok := netip.AddrFromSlice(n.IP)
	if !ok {
		return netip.Prefix{}, fmt.Errorf("invalid CIDR %q", s)
	}
	bits, total := n.Mask.Size()
	if total == 32 {
		addr = addr.Unmap()
	}
	return netip.PrefixFrom(addr, bits).Masked(), nil
}

// topologyRequest returns the topology-aware routing svc asks for, with the precedence of the
// EndpointSlice controller, which is what acts on it: the annotation
// service.kubernetes.io/topology-aware-hints when present, else service.kubernetes.io/topology-mode,
// asks for TopologyAuto when its value is "Auto" or "auto" (any other value asks for nothing);
// otherwise spec.trafficDistribution decides. An unknown trafficDistribution is reported.
func topologyRequest(svc *v1.Service, bad func(field, format string, args ...any)) Topology {
	val, ok := svc.Annotations[v1.DeprecatedAnnotationTopologyAwareHints]
	if !ok {
		val, ok = svc.Annotations[v1.AnnotationTopologyMode]
	}
	if ok && (val == "Auto" || val == "auto") {
		return TopologyAuto
	}
	td := svc.Spec.TrafficDistribution
	if td == nil {
		return TopologyNone
	}
	switch *td {
	case v1.ServiceTrafficDistributionPreferClose, v1.ServiceTrafficDistributionPreferSameZone:
		return TopologyPreferSameZone
	case v1.ServiceTrafficDistributionPreferSameNode:
		return TopologyPreferSameNode
	}
	bad("spec.trafficDistribution", "unsupported value %q (want %s, %s or %s); endpoint hints are still followed",
		*td, v1.ServiceTrafficDistributionPreferClose, v1.ServiceTrafficDistributionPreferSameZone, v1.ServiceTrafficDistributionPreferSameNode)
	return TopologyNone
}
