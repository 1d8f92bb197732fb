// Package source defines what a source of Services and EndpointSlices delivers to the proxy.
//
// Two sources implement it: package kubeapi (client-go informers on a real API server) and
// package manifests (a directory of YAML/JSON manifests). Both call a Handler with every change
// they see, in order, from one goroutine at a time. A source that also knows this node's Node
// (kubeapi does; a manifests directory has none) tells a Handler that implements TopologyHandler
// the node's zone.
package source

import (
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
)

// Handler receives the changes a source sees. prev is nil for an add, cur is nil for a delete.
// Calls are made from one goroutine at a time; a Handler must not block for long (it records the
// change and returns; the proxy applies changes in its own sync loop). Objects passed in are
// owned by the source and must not be modified. prev equals the version delivered before but
// need not be the same object: both sources keep objects encoded once delivered and decode them
// again when they hand them out, so a Handler should keep what it derives, not the objects.
type Handler interface {
	OnServiceUpdate(prev, cur *v1.Service)
	OnEndpointSliceUpdate(prev, cur *discovery.EndpointSlice)
	// OnSynced is called once, after the source has delivered its complete initial state.
	OnSynced()
}

// TopologyHandler is implemented by Handlers that route by topology. A source that watches this
// node's Node calls OnNodeTopology with the Node's topology.kubernetes.io/zone label when it is
// first seen and whenever it changes ("" when the label is missing or the Node is deleted). The
// calls are serialised with the Handler's other calls and, like them, must not block for long.
// Until the first call the zone is unknown.
type TopologyHandler interface {
	OnNodeTopology(zone string)
}
