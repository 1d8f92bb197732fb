// Package serviceport is the proxy's model of what it serves.
//
// A Kubernetes Service with N ports becomes N ServicePorts, one per (service, port name); the
// EndpointSlices of that service become, per port name, a list of Endpoints. Everything below the
// sources (the change tracker, the load balancer, the listeners and the portal rules) works on
// these values only, never on API objects, so the conversion and its validation live here once.
//
// Conversion never fails as a whole: an invalid field is reported in the returned error (naming the
// object and the field) and left out, and everything valid in the same object is still returned.
package serviceport

import (
	"fmt"
	"net/netip"
	"slices"
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
}

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
		sp.SessionAffinity == o.SessionAffinity && sp.AffinityTimeout == o.AffinityTimeout &&
		sp.ExternalPolicyLocal == o.ExternalPolicyLocal && sp.InternalPolicyLocal == o.InternalPolicyLocal &&
		sp.HealthCheckNodePort == o.HealthCheckNodePort && sp.ProxyProtocol == o.ProxyProtocol
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
