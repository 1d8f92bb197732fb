// Package userspace is the userspace proxier: it owns the sync loop and one listener per service
// port, and splices every connection to an endpoint. Only cmd/ imports it.
//
// A source (package proxy/source/kubeapi or proxy/source/manifests) feeds the Proxier's Tracker
// (package proxy) with Service and EndpointSlice events. A bounded-frequency runner calls the
// sync, which drains the coalesced changes and then, top to bottom:
//
//  1. for every changed service port, opens (or keeps, or closes) its listener on a proxy port,
//     served by package proxy/forward/tcp or proxy/forward/udp, and hands its endpoints to the
//     load balancer;
//  2. takes one snapshot of the node's addresses (proxy.NodeAddrs);
//  3. asks the balancer which traffic of each port has a usable endpoint and turns that into
//     the portals' actions (proxy.PortState);
//  4. holds NodePorts and local portal IP:ports with real sockets;
//  5. tells the Portals (iptables rules, or nothing with --portal-mode none) the complete state;
//  6. hands the sync's result (proxy.SyncResult) to Options.OnSynced.
//
// An endpoint change does not wait for that rate-limited sync: the proxy's rules do not name
// endpoints, so the Tracker hands endpoint changes (DrainEndpoints) to a loop of their own,
// which gives the changed services' ports their new endpoints at once and reports
// (Options.OnEndpointsProgrammed); only a change that alters a port's state (its first or last
// usable endpoint, its local endpoints) asks for a sync, which writes the rules.
//
// A connection's walk: a portal rule redirects it to a listener; the listener's tcp.Proxy
// accepts it and asks the listener's chooser for an endpoint (the chooser asks the balancer,
// with the traffic class the original destination implies); the proxy's event loop dials, then
// copies and splices both ways (package proxy/forward/tcp).
//
// Data flows one way: sources → tracker → sync → (balancer, listeners, portals) → result. The
// package knows nothing of iptables (the Portals interface hides it) nor of HTTP (health
// checks and metrics receive the SyncResult).
package userspace
