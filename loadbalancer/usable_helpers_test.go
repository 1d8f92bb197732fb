package loadbalancer

import "github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"

// Usable returns the endpoints that new traffic of one class may use, in the order of eps: for
// external traffic (arriving via a NodePort, an external IP or a load-balancer IP) when external
// is true, for ClusterIP traffic otherwise.
//
// The ready endpoints are usable; when none is, the serving and terminating ones are. When the
// class is subject to a Local policy (sp.ExternalPolicyLocal for external traffic,
// sp.InternalPolicyLocal for ClusterIP traffic), only endpoints whose NodeName is node.Name are
// considered, with the same fallback among them; an empty node.Name matches no endpoint.
// Otherwise the endpoints' topology hints may narrow the ready ones to those hinted for node or
// its zone (see topologyFor); hints never apply under a Local policy, nor to the fallback. A nil
// sp is treated as a service with no Local policy. The result is nil when nothing is usable; it
// never aliases eps.
func Usable(sp *proxy.ServicePort, eps []proxy.Endpoint, node Node, external bool) []proxy.Endpoint {
	r := rotation{eps: eps}
	var perm []uint32
	if localClass(sp, external) {
		perm = filter(nil, &r, node, true, topologyNone)
	} else {
		perm = filter(nil, &r, node, false, topologyFor(&r, node).mode)
	}
	var out []proxy.Endpoint
	for _, i := range perm {
		out = append(out, eps[i])
	}
	return out
}

// localClass reports whether the traffic class (external or ClusterIP) of sp is subject to a
// Local traffic policy.
func localClass(sp *proxy.ServicePort, external bool) bool {
	if sp == nil {
		return false
	}
	if external {
		return sp.ExternalPolicyLocal
	}
	return sp.InternalPolicyLocal
}
