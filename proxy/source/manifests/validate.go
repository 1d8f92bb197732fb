package manifests

import (
	"fmt"
	"net/netip"
	"strings"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// maxAffinityTimeout is the largest sessionAffinityConfig.clientIP.timeoutSeconds the API server
// accepts (one day).
const maxAffinityTimeout = 86400

// defaultAndValidateService applies the API server's defaults that matter to the proxy and
// returns what the API server would reject (and the proxy cares about). Cluster IPs, IP
// families and node ports are allocated later, across all services.
func defaultAndValidateService(svc *v1.Service) []error {
	obj := "Service " + svc.Namespace + "/" + svc.Name
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, &proxy.FieldError{Object: obj, Field: field, Detail: fmt.Sprintf(format, args...)})
	}
	if svc.Namespace == "" {
		svc.Namespace = metav1.NamespaceDefault
		obj = "Service " + svc.Namespace + "/" + svc.Name
	}
	// Names end up in log lines and iptables comments: hold them to the API server's rules.
	for _, msg := range validation.IsDNS1035Label(svc.Name) {
		bad("metadata.name", "%q: %s", svc.Name, msg)
	}
	for _, msg := range validation.IsDNS1123Label(svc.Namespace) {
		bad("metadata.namespace", "%q: %s", svc.Namespace, msg)
	}

	spec := &svc.Spec
	if spec.Type == "" {
		spec.Type = v1.ServiceTypeClusterIP
	}
	switch spec.Type {
	case v1.ServiceTypeClusterIP, v1.ServiceTypeNodePort, v1.ServiceTypeLoadBalancer, v1.ServiceTypeExternalName:
	default:
		bad("spec.type", "unsupported value %q (want ClusterIP, NodePort, LoadBalancer or ExternalName)", spec.Type)
	}
	if spec.SessionAffinity == "" {
		spec.SessionAffinity = v1.ServiceAffinityNone
	}
	switch spec.SessionAffinity {
	case v1.ServiceAffinityNone:
	case v1.ServiceAffinityClientIP:
		if spec.SessionAffinityConfig == nil {
			spec.SessionAffinityConfig = &v1.SessionAffinityConfig{}
		}
		if spec.SessionAffinityConfig.ClientIP == nil {
			spec.SessionAffinityConfig.ClientIP = &v1.ClientIPConfig{}
		}
		if spec.SessionAffinityConfig.ClientIP.TimeoutSeconds == nil {
			t := int32(v1.DefaultClientIPServiceAffinitySeconds)
			spec.SessionAffinityConfig.ClientIP.TimeoutSeconds = &t
		}
		if t := *spec.SessionAffinityConfig.ClientIP.TimeoutSeconds; t < 1 || t > maxAffinityTimeout {
			bad("spec.sessionAffinityConfig.clientIP.timeoutSeconds", "%d out of range 1..%d", t, maxAffinityTimeout)
		}
	default:
		bad("spec.sessionAffinity", "unsupported value %q (want None or ClientIP)", spec.SessionAffinity)
	}

	if spec.Type != v1.ServiceTypeExternalName {
		if spec.InternalTrafficPolicy == nil {
			p := v1.ServiceInternalTrafficPolicyCluster
			spec.InternalTrafficPolicy = &p
		}
		switch *spec.InternalTrafficPolicy {
		case v1.ServiceInternalTrafficPolicyCluster, v1.ServiceInternalTrafficPolicyLocal:
		default:
			bad("spec.internalTrafficPolicy", "unsupported value %q (want Cluster or Local)", *spec.InternalTrafficPolicy)
		}
	}
	external := spec.Type == v1.ServiceTypeNodePort || spec.Type == v1.ServiceTypeLoadBalancer
	if external && spec.ExternalTrafficPolicy == "" {
		spec.ExternalTrafficPolicy = v1.ServiceExternalTrafficPolicyCluster
	}
	switch spec.ExternalTrafficPolicy {
	case "", v1.ServiceExternalTrafficPolicyCluster, v1.ServiceExternalTrafficPolicyLocal:
	default:
		bad("spec.externalTrafficPolicy", "unsupported value %q (want Cluster or Local)", spec.ExternalTrafficPolicy)
	}
	if spec.Type == v1.ServiceTypeLoadBalancer && spec.AllocateLoadBalancerNodePorts == nil {
		t := true
		spec.AllocateLoadBalancerNodePorts = &t
	}
	if spec.HealthCheckNodePort < 0 || spec.HealthCheckNodePort > 65535 {
		bad("spec.healthCheckNodePort", "%d out of range 0..65535", spec.HealthCheckNodePort)
	}

	validateClusterIPs(spec, bad)
	for i, s := range spec.ExternalIPs {
		if ip, err := netip.ParseAddr(s); err != nil || ip.Zone() != "" {
			bad(fmt.Sprintf("spec.externalIPs[%d]", i), "invalid IP %q", s)
		}
	}
	for i, ing := range svc.Status.LoadBalancer.Ingress {
		field := fmt.Sprintf("status.loadBalancer.ingress[%d]", i)
		if ip, err := netip.ParseAddr(ing.IP); ing.IP != "" && (err != nil || ip.Zone() != "") {
			bad(field+".ip", "invalid IP %q", ing.IP)
		}
		if m := ing.IPMode; m != nil && *m != v1.LoadBalancerIPModeVIP && *m != v1.LoadBalancerIPModeProxy {
			bad(field+".ipMode", "unsupported value %q (want VIP or Proxy)", *m)
		}
	}
	if td := spec.TrafficDistribution; td != nil {
		switch *td {
		case v1.ServiceTrafficDistributionPreferClose, v1.ServiceTrafficDistributionPreferSameZone, v1.ServiceTrafficDistributionPreferSameNode:
		default:
			bad("spec.trafficDistribution", "unsupported value %q (want %s, %s or %s)", *td,
				v1.ServiceTrafficDistributionPreferClose, v1.ServiceTrafficDistributionPreferSameZone, v1.ServiceTrafficDistributionPreferSameNode)
		}
	}
	if v, ok := svc.Annotations[proxy.ProxyProtocolAnnotation]; ok && v != string(proxy.ProxyProtocolV1) && v != string(proxy.ProxyProtocolV2) {
		bad("metadata.annotations["+proxy.ProxyProtocolAnnotation+"]", "invalid value %q (want v1 or v2)", v)
	}
	if len(spec.IPFamilies) > 2 {
		bad("spec.ipFamilies", "at most 2 families, got %d", len(spec.IPFamilies))
	}
	for i, f := range spec.IPFamilies {
		if f != v1.IPv4Protocol && f != v1.IPv6Protocol {
			bad(fmt.Sprintf("spec.ipFamilies[%d]", i), "unsupported value %q (want IPv4 or IPv6)", f)
		}
		if i == 1 && f == spec.IPFamilies[0] {
			bad("spec.ipFamilies[1]", "duplicate family %q", f)
		}
	}
	if p := spec.IPFamilyPolicy; p != nil {
		switch *p {
		case v1.IPFamilyPolicySingleStack, v1.IPFamilyPolicyPreferDualStack, v1.IPFamilyPolicyRequireDualStack:
		default:
			bad("spec.ipFamilyPolicy", "unsupported value %q", *p)
		}
	}

	headless := spec.ClusterIP == v1.ClusterIPNone
	if len(spec.Ports) == 0 && !headless && spec.Type != v1.ServiceTypeExternalName {
		bad("spec.ports", "at least one port is required")
	}
	names := map[string]int{}
	portProto := map[string]int{}
	for i := range spec.Ports {
		p := &spec.Ports[i]
		field := fmt.Sprintf("spec.ports[%d]", i)
		if p.Protocol == "" {
			p.Protocol = v1.ProtocolTCP
		}
		if p.TargetPort == (intstr.IntOrString{}) && p.Port >= 1 && p.Port <= 65535 {
			p.TargetPort = intstr.FromInt32(p.Port)
		}
		switch p.Protocol {
		case v1.ProtocolTCP, v1.ProtocolUDP, v1.ProtocolSCTP:
		default:
			bad(field+".protocol", "unsupported value %q (want TCP, UDP or SCTP)", p.Protocol)
		}
		if p.Port < 1 || p.Port > 65535 {
			bad(field+".port", "%d out of range 1..65535", p.Port)
		}
		if p.NodePort < 0 || p.NodePort > 65535 {
			bad(field+".nodePort", "%d out of range 0..65535", p.NodePort)
		}
		switch tp := p.TargetPort; {
		case tp == (intstr.IntOrString{}):
			// Left unset because the port is invalid, which is reported.
		case tp.Type == intstr.Int && (tp.IntVal < 1 || tp.IntVal > 65535):
			bad(field+".targetPort", "%d out of range 1..65535", tp.IntVal)
		case tp.Type == intstr.String && len(validation.IsValidPortName(tp.StrVal)) > 0:
			bad(field+".targetPort", "invalid port name %q: %s", tp.StrVal, strings.Join(validation.IsValidPortName(tp.StrVal), "; "))
		}
		if p.Name == "" && len(spec.Ports) > 1 {
			bad(field+".name", "required when the service has more than one port")
		}
		if p.Name != "" {
			for _, msg := range validation.IsDNS1123Label(p.Name) {
				bad(field+".name", "%q: %s", p.Name, msg)
			}
		}
		if j, dup := names[p.Name]; dup && p.Name != "" {
			bad(field+".name", "duplicate port name %q (also spec.ports[%d])", p.Name, j)
		}
		names[p.Name] = i
		pp := fmt.Sprintf("%d/%s", p.Port, p.Protocol)
		if j, dup := portProto[pp]; dup {
			bad(field, "duplicate port %s (also spec.ports[%d])", pp, j)
		}
		portProto[pp] = i
	}
	return errs
}

// validateClusterIPs checks spec.clusterIP and spec.clusterIPs and makes them agree, as the API
// server defaults them: one given fills the other.
func validateClusterIPs(spec *v1.ServiceSpec, bad func(field, format string, args ...any)) {
	if len(spec.ClusterIPs) == 0 && spec.ClusterIP != "" {
		spec.ClusterIPs = []string{spec.ClusterIP}
	}
	if spec.ClusterIP == "" && len(spec.ClusterIPs) > 0 {
		spec.ClusterIP = spec.ClusterIPs[0]
	}
	if len(spec.ClusterIPs) > 0 && spec.ClusterIP != spec.ClusterIPs[0] {
		bad("spec.clusterIPs[0]", "%q must equal spec.clusterIP %q", spec.ClusterIPs[0], spec.ClusterIP)
		return
	}
	if len(spec.ClusterIPs) > 2 {
		bad("spec.clusterIPs", "at most 2 addresses, got %d", len(spec.ClusterIPs))
		return
	}
	var fams []bool // is IPv6, per entry
	for i, s := range spec.ClusterIPs {
		field := fmt.Sprintf("spec.clusterIPs[%d]", i)
		if s == v1.ClusterIPNone {
			if len(spec.ClusterIPs) > 1 {
				bad(field, "%q must be the only entry", s)
			}
			continue
		}
		ip, err := netip.ParseAddr(s)
		if err != nil || ip.Zone() != "" {
			bad(field, "invalid IP %q", s)
			continue
		}
		fams = append(fams, ip.Unmap().Is6())
	}
	if len(fams) == 2 && fams[0] == fams[1] {
		bad("spec.clusterIPs", "both addresses are of the same family; dual-stack needs one IPv4 and one IPv6")
	}
	if spec.Type == v1.ServiceTypeExternalName && len(spec.ClusterIPs) > 0 {
		bad("spec.clusterIP", "must be empty for an ExternalName service")
	}
	// One valid address and no dual-stack policy: the family and policy are what the API server
	// (and the allocator's plan) would make of them. Filling them in here lets the allocator
	// serve the decoded object as it is, without a completed copy.
	if len(fams) == 1 && len(spec.ClusterIPs) == 1 && spec.Type != v1.ServiceTypeExternalName &&
		(spec.IPFamilyPolicy == nil || *spec.IPFamilyPolicy == v1.IPFamilyPolicySingleStack) {
		fam := v1.IPv4Protocol
		if fams[0] {
			fam = v1.IPv6Protocol
		}
		if len(spec.IPFamilies) == 0 {
			spec.IPFamilies = []v1.IPFamily{fam}
		}
		if spec.IPFamilyPolicy == nil {
			policy := v1.IPFamilyPolicySingleStack
			spec.IPFamilyPolicy = &policy
		}
	}
}

// maxEndpointAddresses is the API server's limit of addresses per endpoint.
const maxEndpointAddresses = 100

// defaultAndValidateSlice applies the API server's EndpointSlice defaults (port name "",
// protocol TCP) and returns what the API server, or this proxy, would reject.
func defaultAndValidateSlice(s *discovery.EndpointSlice) []error {
	if s.Namespace == "" {
		s.Namespace = metav1.NamespaceDefault
	}
	obj := "EndpointSlice " + s.Namespace + "/" + s.Name
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, &proxy.FieldError{Object: obj, Field: field, Detail: fmt.Sprintf(format, args...)})
	}
	for _, msg := range validation.IsDNS1123Subdomain(s.Name) {
		bad("metadata.name", "%q: %s", s.Name, msg)
	}
	for _, msg := range validation.IsDNS1123Label(s.Namespace) {
		bad("metadata.namespace", "%q: %s", s.Namespace, msg)
	}
	svcName := s.Labels[discovery.LabelServiceName]
	if svcName == "" {
		bad("metadata.labels["+discovery.LabelServiceName+"]", "missing: the proxy cannot tell which service the slice belongs to")
	} else {
		for _, msg := range validation.IsDNS1035Label(svcName) {
			bad("metadata.labels["+discovery.LabelServiceName+"]", "%q: %s", svcName, msg)
		}
	}
	switch s.AddressType {
	case "":
		bad("addressType", "missing (want IPv4, IPv6 or FQDN)")
	case discovery.AddressTypeIPv4, discovery.AddressTypeIPv6, discovery.AddressTypeFQDN:
	default:
		bad("addressType", "unsupported value %q (want IPv4, IPv6 or FQDN)", s.AddressType)
	}
	names := map[string]int{}
	for i := range s.Ports {
		p := &s.Ports[i]
		field := fmt.Sprintf("ports[%d]", i)
		if p.Name == nil {
			n := ""
			p.Name = &n
		}
		if p.Protocol == nil {
			tcp := v1.ProtocolTCP
			p.Protocol = &tcp
		}
		switch *p.Protocol {
		case v1.ProtocolTCP, v1.ProtocolUDP, v1.ProtocolSCTP:
		default:
			bad(field+".protocol", "unsupported value %q (want TCP, UDP or SCTP)", *p.Protocol)
		}
		if p.Port == nil {
			bad(field+".port", "missing")
		} else if *p.Port < 1 || *p.Port > 65535 {
			bad(field+".port", "%d out of range 1..65535", *p.Port)
		}
		if *p.Name != "" {
			for _, msg := range validation.IsDNS1123Label(*p.Name) {
				bad(field+".name", "%q: %s", *p.Name, msg)
			}
		}
		if j, dup := names[*p.Name]; dup {
			bad(field+".name", "duplicate port name %q (also ports[%d])", *p.Name, j)
		}
		names[*p.Name] = i
	}
	for i, e := range s.Endpoints {
		field := fmt.Sprintf("endpoints[%d].addresses", i)
		if len(e.Addresses) == 0 || len(e.Addresses) > maxEndpointAddresses {
			bad(field, "must hold 1..%d addresses, has %d", maxEndpointAddresses, len(e.Addresses))
		}
		if s.AddressType != discovery.AddressTypeIPv4 && s.AddressType != discovery.AddressTypeIPv6 {
			continue
		}
		for j, a := range e.Addresses {
			ip, err := netip.ParseAddr(a)
			switch {
			case err != nil || ip.Zone() != "":
				bad(fmt.Sprintf("%s[%d]", field, j), "invalid IP %q", a)
			case ip.Is4() != (s.AddressType == discovery.AddressTypeIPv4):
				bad(fmt.Sprintf("%s[%d]", field, j), "%q is not an %s address", a, s.AddressType)
			}
		}
		if e.Hints == nil {
			continue
		}
		// Zone hints are ignored (see the package documentation), but held to the API server's
		// rules all the same, as node hints are.
		for j, z := range e.Hints.ForZones {
			if z.Name == "" || len(validation.IsValidLabelValue(z.Name)) > 0 {
				bad(fmt.Sprintf("endpoints[%d].hints.forZones[%d].name", i, j), "invalid zone name %q", z.Name)
			}
		}
		for j, n := range e.Hints.ForNodes {
			if len(validation.IsDNS1123Subdomain(n.Name)) > 0 {
				bad(fmt.Sprintf("endpoints[%d].hints.forNodes[%d].name", i, j), "invalid node name %q", n.Name)
			}
		}
	}
	return errs
}
