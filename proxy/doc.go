// Package proxy is the heart of kube-userspace-proxy: it owns the service state, the sync loop and
// one listener per service port.
//
// A source (package source/kubeapi or source/manifests) feeds a Proxier's Tracker with Service and
// EndpointSlice events, and kubeapi also with this node's zone (for topology hints). A
// bounded-frequency runner calls the sync, which drains the coalesced changes and then, for every
// changed service port:
//   - opens (or keeps, or closes) the port's listener on a proxy port and serves it with package
//     forward (TCP splice or UDP sessions),
//   - hands the port's endpoints to the load balancer, which picks an endpoint per new
//     connection or flow,
//   - drops UDP sessions whose endpoint left,
//
// and finally tells the Portals (iptables rules, or nothing with --portal-mode none) the complete
// desired state, and holds NodePorts with real sockets so no other process can take them.
//
// Data flows one way: sources → tracker → sync → (balancer, listeners, portals).
package proxy
