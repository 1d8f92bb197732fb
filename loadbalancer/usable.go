package loadbalancer

import "github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"

// isLocal reports whether e runs on nodeName; an unknown node ("") is never local.
func isLocal(e *proxy.Endpoint, nodeName string) bool {
	return nodeName != "" && e.NodeName == nodeName
}

// filter appends to dst the endpoints of order usable under the selection rule (local restricts
// them to node.Name; mode restricts the ready ones to those available for topology), as indexes
// into order.eps in rotation order, and returns it. mode must leave at least one ready endpoint
// when any is ready (topologyFor guarantees it), so the fallback to serving and terminating
// endpoints happens only when none is ready.
func filter(dst []uint32, order *rotation, node Node, local bool, mode topologyMode) []uint32 {
	start := len(dst)
	for i := range order.len() {
		e := order.at(i)
		if e.Ready && (!local || isLocal(e, node.Name)) && availableForTopology(e, mode, node) {
			dst = append(dst, order.indexOf(i))
		}
	}
	if len(dst) > start {
		return dst
	}
	for i := range order.len() {
		e := order.at(i)
		if e.Serving && e.Terminating && (!local || isLocal(e, node.Name)) {
			dst = append(dst, order.indexOf(i))
		}
	}
	return dst
}
