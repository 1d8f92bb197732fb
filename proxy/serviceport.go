package proxy

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Name identifies one port of one service: "namespace/name:port".
type Name struct {
	Namespace string
	Name      string
	Port      string // the port's name; "" for a service's single unnamed port
}

// String returns "namespace/name:port", the form kube-proxy uses in rule comments and logs.
func (n Name) String() string {
	return n.Namespace + "/" + n.Name + ":" + n.Port
}

// Compare compares n and o in the order of their strings (String), as strings.Compare would,
// without building them: -1 when n sorts first, 0 when equal, +1 otherwise.
func (n Name) Compare(o Name) int {
	if n.Namespace != o.Namespace {
		return compareJoined(n, o, n.Namespace, o.Namespace, '/')
	}
	if n.Name != o.Name {
		return compareJoined(n, o, n.Name, o.Name, ':')
	}
	return strings.Compare(n.Port, o.Port)
}

// compareJoined compares the strings of n and o at the first of their parts that differ, a and
// b, each followed by sep in the string. Namespaces hold no "/" and names no ":", so it
// decides at the first byte that differs, or where the shorter part ends; otherwise (a part
// holding its separator) it compares the strings themselves.
func compareJoined(n, o Name, a, b string, sep byte) int {
	k := 0
	for k < len(a) && k < len(b) && a[k] == b[k] {
		k++
	}
	x, y := sep, sep // the bytes of the strings at k: a part's end is followed by sep
	if k < len(a) {
		x = a[k]
	}
	if k < len(b) {
		y = b[k]
	}
	switch {
	case x < y:
		return -1
	case x > y:
		return 1
	}
	return strings.Compare(n.String(), o.String())
}

// Service returns the namespaced name of the service the port belongs to.
func (n Name) Service() types.NamespacedName {
	return types.NamespacedName{Namespace: n.Namespace, Name: n.Name}
}

// DefaultAffinityTimeout is the ClientIP session affinity timeout when the service does not set one
// (Kubernetes' v1.DefaultClientIPServiceAffinitySeconds).
const DefaultAffinityTimeout = 10800 * time.Second

// ProxyProtocol is the version of the PROXY protocol header sent to endpoints ("" for none).
type ProxyProtocol string

// PROXY protocol versions.
const (
	ProxyProtocolNone ProxyProtocol = ""
	ProxyProtocolV1   ProxyProtocol = "v1"
	ProxyProtocolV2   ProxyProtocol = "v2"
)

// ProxyProtocolAnnotation on a Service asks the proxy to send a PROXY protocol header ("v1" or
// "v2") to the service's endpoints.
const ProxyProtocolAnnotation = "kube-userspace-proxy.io/proxy-protocol"

// UsedServiceAnnotations are the annotations of a Service the proxy reads (FromService); a
// source may drop the others (package kubeapi does, before caching).
var UsedServiceAnnotations = []string{ProxyProtocolAnnotation, v1.DeprecatedAnnotationTopologyAwareHints, v1.AnnotationTopologyMode}

// ServicePort is everything the proxy needs to know about one port of one service.
// A ServicePort is immutable once built: a change in the service produces a new value.
type ServicePort struct {
	Name     Name
	Protocol v1.Protocol // v1.ProtocolTCP or v1.ProtocolUDP
	Port     int         // the service's port (spec.ports[].port)
	NodePort int         // 0 when the service has no NodePort for this port

	// ClusterIPs holds spec.clusterIPs (at most one per family).
	ClusterIPs []netip.Addr
	// ExternalIPs holds spec.externalIPs.
	ExternalIPs []netip.Addr
	// LoadBalancerIPs holds the status.loadBalancer.ingress[].ip entries whose ipMode is VIP (or
	// unset); ingress with ipMode Proxy is reached through the NodePort and has no portal.
	LoadBalancerIPs []netip.Addr
	// LoadBalancerSourceRanges holds spec.loadBalancerSourceRanges of a LoadBalancer service,
	// masked: when not empty, only sources inside one of them reach the LoadBalancerIPs (not the
	// ClusterIP, externalIPs or NodePort), as with kube-proxy; per IP family, a list without a
	// range of that family restricts nothing there. An entry that does not parse is kept as the
	// zero Prefix, which matches no source: a list of nothing but bad entries lets no source in
	// rather than every source.
	LoadBalancerSourceRanges []netip.Prefix

	// SessionAffinity is true for sessionAffinity ClientIP; AffinityTimeout is then its timeout.
	SessionAffinity bool
	AffinityTimeout time.Duration

	// ExternalPolicyLocal is externalTrafficPolicy: Local (only for NodePort and LoadBalancer
	// services, or services with externalIPs).
	ExternalPolicyLocal bool
	// InternalPolicyLocal is internalTrafficPolicy: Local.
	InternalPolicyLocal bool
	// HealthCheckNodePort is spec.healthCheckNodePort (0 when unset).
	HealthCheckNodePort int

	// ProxyProtocol is the PROXY protocol version to send to endpoints, from ProxyProtocolAnnotation.
	ProxyProtocol ProxyProtocol

	// Topology is the topology-aware routing the service asks for (TopologyNone when it asks for
	// none). The proxy follows the endpoints' hints whatever this says, as kube-proxy does since
	// v1.33 (the EndpointSlice controller writes hints only for services that ask); it is kept
	// so that the load balancer can say why a service that asked got no topology.
	Topology Topology
}

// Topology is the topology-aware routing a Service asks for, through the annotations
// service.kubernetes.io/topology-mode (or the deprecated service.kubernetes.io/topology-aware-hints)
// or spec.trafficDistribution. The EndpointSlice controller answers it by writing hints on the
// service's endpoints.
type Topology string

// Topology requests.
const (
	// TopologyNone: the service asks for no topology-aware routing.
	TopologyNone Topology = ""
	// TopologyAuto: the topology-mode (or topology-aware-hints) annotation is "Auto": zone hints
	// in proportion to each zone's CPU cores.
	TopologyAuto Topology = "Auto"
	// TopologyPreferSameZone: trafficDistribution PreferSameZone or its older name PreferClose:
	// zone hints, each endpoint hinted for its own zone.
	TopologyPreferSameZone Topology = v1.ServiceTrafficDistributionPreferSameZone
	// TopologyPreferSameNode: trafficDistribution PreferSameNode: node hints, each endpoint
	// hinted for its own node, and zone hints as a fallback.
	TopologyPreferSameNode Topology = v1.ServiceTrafficDistributionPreferSameNode
)

// String returns the port's name and protocol, as "ns/name:port/TCP".
func (sp *ServicePort) String() string {
	return sp.Name.String() + "/" + string(sp.Protocol)
}

// Equal reports whether two ServicePorts describe the same thing.
func (sp *ServicePort) Equal(o *ServicePort) bool {
	if sp == nil || o == nil {
		return sp == o
	}
	return sp.Name == o.Name && sp.Protocol == o.Protocol && sp.Port == o.Port &&
		sp.NodePort == o.NodePort && slices.Equal(sp.ClusterIPs, o.ClusterIPs) &&
		slices.Equal(sp.ExternalIPs, o.ExternalIPs) && slices.Equal(sp.LoadBalancerIPs, o.LoadBalancerIPs) &&
		slices.Equal(sp.LoadBalancerSourceRanges, o.LoadBalancerSourceRanges) &&
		sp.SessionAffinity == o.SessionAffinity && sp.AffinityTimeout == o.AffinityTimeout &&
		sp.ExternalPolicyLocal == o.ExternalPolicyLocal && sp.InternalPolicyLocal == o.InternalPolicyLocal &&
		sp.HealthCheckNodePort == o.HealthCheckNodePort && sp.ProxyProtocol == o.ProxyProtocol &&
		sp.Topology == o.Topology
}

// UsesExternalPolicy reports whether traffic arriving through addr (an IP the packet was sent to)
// is "external" traffic, subject to externalTrafficPolicy, rather than ClusterIP traffic.
func (sp *ServicePort) UsesExternalPolicy(addr netip.Addr) bool {
	return !slices.Contains(sp.ClusterIPs, addr.Unmap())
}

// Endpoint is one address:port that serves a ServicePort, with its EndpointSlice conditions.
type Endpoint struct {
	Addr netip.AddrPort
	// Ready, Serving and Terminating are the EndpointSlice conditions (ready defaults to true
	// when unset, serving to ready, terminating to false, as the API documents).
	Ready       bool
	Serving     bool
	Terminating bool
	// NodeName is the node hosting the endpoint ("" if unknown).
	NodeName string
	// ZoneHints and NodeHints are the endpoint's hints.forZones and hints.forNodes: the zones and
	// nodes whose traffic should go to it under topology-aware routing (empty when not hinted).
	ZoneHints, NodeHints Hints
}

// Hints is a set of zone or node names from an endpoint's hints. It is kept as its names sorted,
// without duplicates and joined by commas (names that are valid label values or node names hold
// no comma), so that Endpoint stays comparable with == and equal sets compare equal. The zero
// value is the empty set.
type Hints string

// NewHints returns the set of names; empty names are left out.
func NewHints(names ...string) Hints {
	list := make([]string, 0, len(names))
	for _, n := range names {
		if n != "" {
			list = append(list, n)
		}
	}
	slices.Sort(list)
	return Hints(strings.Join(slices.Compact(list), ","))
}

// Has reports whether name is in the set; the empty name never is.
func (h Hints) Has(name string) bool {
	if name == "" {
		return false
	}
	for rest := string(h); rest != ""; {
		var n string
		n, rest, _ = strings.Cut(rest, ",")
		if n == name {
			return true
		}
	}
	return false
}

// Empty reports whether the set has no name: the endpoint carries no hint of this kind.
func (h Hints) Empty() bool { return h == "" }

// Names returns the names in the set, sorted (nil when empty).
func (h Hints) Names() []string {
	if h == "" {
		return nil
	}
	return strings.Split(string(h), ",")
}

// String returns the endpoint's address as "ip:port".
func (e Endpoint) String() string { return e.Addr.String() }

// FieldError is a problem with one field of one object. The proxy logs it and serves everything
// else of the object.
type FieldError struct {
	Object string // "Service ns/name" or "EndpointSlice ns/name"
	Field  string // "spec.ports[1].protocol"
	Detail string
}

func (e *FieldError) Error() string {
	return fmt.Sprintf("%s: %s: %s", e.Object, e.Field, e.Detail)
}
