// Package proxy is the proxy's model of what it serves, and the change tracking that feeds it;
// everything else in the module builds on it, and it imports nothing of the module but
// package proxy/source (the Handler interface its Tracker implements).
//
// # The model
//
// A Kubernetes Service with N ports becomes N ServicePorts, one per (service, port name); the
// EndpointSlices of that service become, per port name, a list of Endpoints. Everything below
// the sources (the load balancer, the listeners and the portal rules) works on these values
// only, never on API objects, so the conversion and its validation live here once (FromService,
// FromSlice and MergeSlices). Conversion never fails as a whole: an invalid field is reported in the
// returned error (a FieldError naming the object and the field) and left out, and everything
// valid in the same object is still returned.
//
// # Change tracking
//
// A source calls a Tracker (it implements source.Handler and source.TopologyHandler) with every
// event. The Tracker keeps the current objects and, per service, the state it last handed out;
// Drain hands out what changed since the previous Drain as (previous, current) pairs, the way
// kube-proxy's change trackers do. Several events for one service between two Drains coalesce
// into one change (oldest previous, newest current), and a change whose current equals its
// previous (an update that changed nothing the proxy uses, or an add followed by a delete) is
// dropped. Services and endpoints are tracked independently: endpoints may arrive before their
// service, and the consumer joins them by name. This node's zone is handed out by Drain when it
// differs from the zone the previous Drain handed out. The Tracker is safe for concurrent use.
//
// # What a sync produces
//
// The proxier (package proxy/userspace) turns each Drain into listeners, balancer state and
// portal rules, and describes the outcome as values of this package: a PortState per service
// port (with the portals' Action for each traffic class), NodeAddrs (one snapshot of the
// node's addresses per sync), and a SyncResult handed to the health checks and the metrics.
//
// The package knows nothing of sockets, iptables or HTTP.
package proxy
