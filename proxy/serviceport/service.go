package serviceport

import (
	"errors"
	"fmt"
	"net/netip"
	"time"

	v1 "k8s.io/api/core/v1"
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
// ServicePorts that could be built are returned alongside it.
func FromService(svc *v1.Service) ([]*ServicePort, error) {
	if SkipReason(svc) != "" {
		return nil, nil
	}
	obj := "Service " + svc.Namespace + "/" + svc.Name
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, &FieldError{Object: obj, Field: field, Detail: fmt.Sprintf(format, args...)})
	}

	clusterIPs := svc.Spec.ClusterIPs
	clusterField := "spec.clusterIPs"
	if len(clusterIPs) == 0 {
		clusterIPs = []string{svc.Spec.ClusterIP}
		clusterField = "spec.clusterIP"
	}
	var cips []netip.Addr
	for i, s := range clusterIPs {
		ip, err := netip.ParseAddr(s)
		if err != nil {
			bad(fmt.Sprintf("%s[%d]", clusterField, i), "invalid IP %q", s)
			continue
		}
		cips = append(cips, ip.Unmap())
	}
	if len(cips) == 0 {
		return nil, errors.Join(errs...)
	}

	var eips []netip.Addr
	for i, s := range svc.Spec.ExternalIPs {
		ip, err := netip.ParseAddr(s)
		if err != nil {
			bad(fmt.Sprintf("spec.externalIPs[%d]", i), "invalid IP %q", s)
			continue
		}
		eips = append(eips, ip.Unmap())
	}

	var lbips []netip.Addr
	if svc.Spec.Type == v1.ServiceTypeLoadBalancer {
		for i, ing := range svc.Status.LoadBalancer.Ingress {
			if ing.IP == "" {
				continue // hostname-only ingress has nothing for us to capture
			}
			ip, err := netip.ParseAddr(ing.IP)
			if err != nil {
				bad(fmt.Sprintf("status.loadBalancer.ingress[%d].ip", i), "invalid IP %q", ing.IP)
				continue
			}
			if ing.IPMode != nil && *ing.IPMode == v1.LoadBalancerIPModeProxy {
				continue // the load balancer proxies to the NodePort itself
			}
			lbips = append(lbips, ip.Unmap())
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
		hcnp = int(svc.Spec.HealthCheckNodePort)
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
			Name:                Name{Namespace: svc.Namespace, Name: svc.Name, Port: p.Name},
			Protocol:            proto,
			Port:                int(p.Port),
			NodePort:            nodePort,
			ClusterIPs:          cips,
			ExternalIPs:         eips,
			LoadBalancerIPs:     lbips,
			SessionAffinity:     affinity,
			AffinityTimeout:     timeout,
			ExternalPolicyLocal: externalLocal,
			InternalPolicyLocal: internalLocal,
			HealthCheckNodePort: hcnp,
			ProxyProtocol:       pp,
			Topology:            topology,
		})
	}
	return out, errors.Join(errs...)
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
