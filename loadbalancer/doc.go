// Package loadbalancer decides which endpoint a new TCP connection or UDP flow of a service port
// goes to.
//
// It is pure logic over the proxy's model (package proxy, the only package of this module it
// imports): endpoint lists with their
// EndpointSlice conditions, node names and topology hints, the service's traffic policies and its
// ClientIP session affinity, and this node's name and zone. It opens no sockets and writes no rules; time and randomness are injected
// (Options.Now, Options.Rand), so its behaviour is deterministic in tests.
//
// # Selection rule
//
// filter (usable.go) is the one place the rule is written down; the balancer's per-port lists are
// made with it, and Availability tells the proxier, per port, which traffic classes have a
// usable endpoint (so the portals redirect, drop or reject them):
//
//   - Usable endpoints are the ready ones. When none is ready, the endpoints that are serving and
//     terminating are used instead, so a service whose pods are all shutting down keeps working
//     until they are gone.
//   - Traffic subject to a Local policy (external traffic of a service with
//     externalTrafficPolicy: Local, ClusterIP traffic of a service with internalTrafficPolicy:
//     Local) only goes to endpoints whose NodeName is this node, with the same ready →
//     serving-and-terminating fallback among those. External traffic of a service whose only
//     Local policy is the internal one, and ClusterIP traffic of a service whose only Local
//     policy is the external one, are not restricted.
//   - A Local class with no usable local endpoint fails with ErrNoLocalEndpoints when the service
//     has usable endpoints elsewhere (the proxy drops the traffic), and with ErrNoEndpoints when it
//     has none at all (the proxy rejects it).
//   - Traffic not subject to a Local policy follows the endpoints' topology hints, as kube-proxy
//     v1.33 and later does: when every ready endpoint is hinted for some node and one is hinted
//     for this node, only the ready endpoints hinted for this node are used; otherwise, when every
//     ready endpoint is hinted for some zone and one is hinted for this node's zone, only those
//     hinted for this zone; otherwise every ready endpoint. Hints come from the EndpointSlice
//     controller, which writes them for services that ask (trafficDistribution PreferSameZone,
//     PreferClose or PreferSameNode, annotation service.kubernetes.io/topology-mode: Auto); the
//     service's request itself is not checked, as in kube-proxy since v1.33. An unknown zone
//     (Options.Zone, SetZone) disables zone hints. The serving-and-terminating fallback ignores
//     hints. Why hints are used or ignored is logged at debug level when it changes.
//
// # Round robin and affinity
//
// RoundRobin keeps, per service port, the endpoints in a random order: the first set is
// shuffled, later updates keep the surviving endpoints in their order and interleave new ones at
// random positions, so a rotation stays fair across updates and its position is carried over.
// Each class of traffic (internal, external) rotates over its own usable list, precomputed when
// the service port is set; classes with the same rule share one list and one rotation.
//
// With ClientIP affinity a client (keyed by its IP address) keeps getting the endpoint it got
// last, until it has not been used for the service's affinity timeout (measured from the last
// use, and always against the port's current timeout, so a changed timeout applies at once to
// existing entries), until that endpoint leaves the service, or until the proxy reports that
// dialling it failed (Next with resetAffinity). An entry whose endpoint is present but not usable
// for the traffic's class (for example terminating while ready endpoints exist) is not used.
// Affinity is kept per service port, and per selection rule within it (a client's choice under a
// Local rule is kept apart from its choice under the cluster-wide rule).
//
// The entries of a service port are bounded (Options.MaxAffinityEntries, by default
// DefaultMaxAffinityEntries, counting a client once per rule it has used), so that clients with
// spoofed or ever-changing addresses cannot grow the proxy's memory for the length of the
// affinity timeout (up to a day). At the bound a new client evicts the least recently used one,
// which gets a new pick when it comes back, as if its entry had expired; each eviction is
// reported to Options.OnAffinityEvicted. The entries of a port form a map and a doubly linked
// list in order of use, so that a hit, an insertion and an eviction are O(1), and a hit
// allocates nothing; Sweep frees the expired entries, the least recently used ones, from the
// list's tail.
//
// # Unreachable endpoints
//
// The proxy reports each endpoint a TCP dial could not reach, or that answered a UDP session with
// an ICMP error (Unreachable); the port's picks then pass over it for a hold of 1 s, doubled for
// each failure that follows soon after the previous hold, up to 16 s (unreachable.go). When a
// hold ends, one connection tries the endpoint (its trial) while the others pass over it for
// another second, unless the trial fails. Affinity entries naming a held endpoint are not used.
// When every usable endpoint of a pick is held, the holds are ignored. Ports without holds pay
// nothing.
//
// # Concurrency
//
// All methods of RoundRobin are safe for concurrent use. Next is the hot path: it finds the port
// under a read lock held only for the map lookup, then works on an immutable snapshot that
// SetServicePort publishes; without affinity it takes no other lock and does not allocate, its
// only shared write being the port's rotation counter (an atomic add). With affinity it takes the
// port's own mutex, so ports never contend with each other (the affinity bound is per port for
// this reason too). SetServicePort and DeleteServicePort are serialised with each other; Sweep
// locks one port at a time.
package loadbalancer
