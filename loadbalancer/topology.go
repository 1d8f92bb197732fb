package loadbalancer

import (
	"strings"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// Node is what endpoint selection needs to know about the node the proxy runs on.
type Node struct {
	// Name is the node's name, compared with Endpoint.NodeName for Local traffic policies and
	// with node hints. Empty: no endpoint is local and node hints never apply.
	Name string
	// Zone is the node's topology.kubernetes.io/zone label. Empty (unknown): zone hints never
	// apply, so the cluster-wide rule uses every endpoint.
	Zone string
}

// topologyMode is which hints narrow the endpoints of the cluster-wide rule.
type topologyMode int

const (
	topologyNone     topologyMode = iota // every endpoint
	topologySameZone                     // endpoints hinted for this node's zone
	topologySameNode                     // endpoints hinted for this node
)

func (m topologyMode) String() string {
	switch m {
	case topologySameZone:
		return "zone hints"
	case topologySameNode:
		return "node hints"
	}
	return "no hints"
}

// topologyChoice is the decision of topologyFor and why it was made.
type topologyChoice struct {
	mode topologyMode
	// hinted is true when some ready endpoint carries a hint of either kind.
	hinted bool
	// ignored says why hints of some kind were present but not used ("" when none were ignored).
	ignored string
}

// topologyFor decides, as kube-proxy's topologyModeFromHints does (v1.33 and later), whether the
// hints of eps narrow the cluster-wide endpoints on node. Only ready endpoints count:
//   - node hints are used when every ready endpoint has one and at least one is hinted for
//     node.Name;
//   - otherwise zone hints are used when every ready endpoint has one and at least one is hinted
//     for node.Zone (so an unknown zone never uses them);
//   - otherwise no hints are used, and every endpoint is.
//
// With no ready endpoint, no hints are used: the serving-and-terminating fallback ignores
// topology. The service's own request (ServicePort.Topology) plays no part, as in kube-proxy.
func topologyFor(order *rotation, node Node) topologyChoice {
	anyReady := false
	allNode, forNode, anyNode := true, false, false
	allZone, forZone, anyZone := true, false, false
	for i := range order.len() {
		e := order.at(i)
		if !e.Ready {
			continue
		}
		anyReady = true
		if e.NodeHints.Empty() {
			allNode = false
		} else {
			anyNode = true
			forNode = forNode || e.NodeHints.Has(node.Name)
		}
		if e.ZoneHints.Empty() {
			allZone = false
		} else {
			anyZone = true
			forZone = forZone || e.ZoneHints.Has(node.Zone)
		}
	}
	c := topologyChoice{hinted: anyNode || anyZone}
	if !anyReady {
		return c
	}
	var why []string
	switch {
	case allNode && forNode:
		c.mode = topologySameNode
		return c
	case allNode:
		why = append(why, "node hints: no endpoint is hinted for this node")
	case anyNode:
		why = append(why, "node hints: some ready endpoints have none")
	}
	switch {
	case allZone && forZone:
		c.mode = topologySameZone
	case allZone && node.Zone == "":
		why = append(why, "zone hints: this node's zone is unknown (no topology.kubernetes.io/zone label)")
	case allZone:
		why = append(why, "zone hints: no endpoint is hinted for this node's zone")
	case anyZone:
		why = append(why, "zone hints: some ready endpoints have none")
	}
	c.ignored = strings.Join(why, "; ")
	return c
}

// availableForTopology reports whether e may take the cluster-wide traffic of node under mode.
func availableForTopology(e *proxy.Endpoint, mode topologyMode, node Node) bool {
	switch mode {
	case topologySameZone:
		return e.ZoneHints.Has(node.Zone)
	case topologySameNode:
		return e.NodeHints.Has(node.Name)
	}
	return true
}
