package proxy

import (
	"fmt"
	"net"
	"net/netip"
	"slices"
	"time"
)

// Action says what the portals do with new traffic of one class of a service port.
type Action int

// Actions.
const (
	// Redirect sends new traffic to the proxy's listener (the zero value).
	Redirect Action = iota
	// Reject refuses new traffic: TCP connections get a reset, UDP datagrams an ICMP port
	// unreachable; the client sees "connection refused" at once. For service ports without any
	// usable endpoint (or whose listener could not be opened).
	Reject
	// Drop silently drops new traffic. For externalTrafficPolicy (or internalTrafficPolicy) Local
	// with no endpoint on this node.
	Drop
)

var actionNames = [...]string{Redirect: "redirect", Reject: "reject", Drop: "drop"}

// String returns "redirect", "reject" or "drop".
func (a Action) String() string {
	if a >= 0 && int(a) < len(actionNames) {
		return actionNames[a]
	}
	return fmt.Sprintf("Action(%d)", int(a))
}

// PortState is one service port as a sync left it: what the portals program and what the health
// checks and metrics report.
type PortState struct {
	ServicePort *ServicePort
	// ProxyPort is the port of the proxy's listener; 0 while it could not be opened (the portals
	// then reject the port's traffic rather than redirect it nowhere).
	ProxyPort int
	// Internal applies to ClusterIP traffic, External to NodePort, externalIP and LB IP traffic.
	Internal, External Action
	// LocalEndpoints counts the endpoints on this node that external Local traffic may use.
	LocalEndpoints int
	// LocalReady lists the distinct IPs of this port's ready endpoints on this node. The
	// healthCheckNodePort server counts these per service, as kube-proxy does: an endpoint that
	// is only serving and terminating still receives traffic but no longer makes the node
	// healthy, so load balancers drain the node while its connections finish.
	LocalReady []netip.Addr
}

// SyncKind tells the kinds of sync apart.
type SyncKind int

// Sync kinds.
const (
	// SyncListeners: no portals are programmed (--portal-mode none); only listeners changed.
	SyncListeners SyncKind = iota
	// SyncPartial: the portals were told only what changed since the last sync.
	SyncPartial
	// SyncFull: every portal rule was rewritten.
	SyncFull
)

var syncKindNames = [...]string{SyncListeners: "listeners", SyncPartial: "partial", SyncFull: "full"}

// String returns "listeners", "partial" or "full".
func (k SyncKind) String() string {
	if k >= 0 && int(k) < len(syncKindNames) {
		return syncKindNames[k]
	}
	return fmt.Sprintf("SyncKind(%d)", int(k))
}

// SyncResult is what one sync produced, handed as a value to whoever reports on it (the health
// checks and the metrics). It is not modified after it is handed out.
type SyncResult struct {
	// Start is when the sync started and Took how long it took.
	Start time.Time
	Took  time.Duration
	Kind  SyncKind
	// Err is the sync's failure (programming the portals), nil on success.
	Err error
	// Triggers are the trigger times of the endpoint changes this sync programmed (see
	// TriggerTime): on success, each is one network programming latency observation.
	Triggers []TriggerTime
	// ServiceChanges and EndpointChanges count the services whose definition, and whose
	// endpoints, changed since the previous sync.
	ServiceChanges, EndpointChanges int
	// Ports is the state of every service port after the sync, sorted by name and protocol.
	Ports []PortState
	// Unservable counts the service ports left without a listener because the open-files limit
	// has no descriptor for them (their portals reject).
	Unservable int
}

// EndpointsResult is what one endpoint-only update produced: endpoint changes handed to the
// balancer without a sync, because they change no rule. It is not modified after it is handed out.
type EndpointsResult struct {
	// Start is when the update started and Took how long it took.
	Start time.Time
	Took  time.Duration
	// EndpointChanges counts the services whose endpoints changed.
	EndpointChanges int
	// Triggers are the trigger times of the changes it programmed (see TriggerTime); those of
	// changes that wait for a sync's rules come with that sync's SyncResult.
	Triggers []TriggerTime
}

// NodeAddrs is one snapshot of the node's own addresses (IPv4-mapped addresses unmapped). A sync
// takes one and hands it to everything that needs it. The zero value holds no address.
type NodeAddrs struct {
	list []netip.Addr
	set  map[netip.Addr]struct{}
	// links are the on-link prefixes of the node's interfaces (bridges, LANs), without host
	// routes (/32, /128) and loopback.
	links []netip.Prefix
}

// NewNodeAddrs returns a snapshot of addrs.
func NewNodeAddrs(addrs []netip.Addr) NodeAddrs {
	a := NodeAddrs{set: make(map[netip.Addr]struct{}, len(addrs))}
	for _, ip := range addrs {
		ip = ip.Unmap()
		if _, dup := a.set[ip]; ip.IsValid() && !dup {
			a.set[ip] = struct{}{}
			a.list = append(a.list, ip)
		}
	}
	slices.SortFunc(a.list, netip.Addr.Compare)
	return a
}

// NodeAddrsFromPrefixes returns a snapshot of the interface addresses in prefixes (each an
// address with its on-link prefix length, as `ip addr` shows it).
func NodeAddrsFromPrefixes(prefixes []netip.Prefix) NodeAddrs {
	addrs := make([]netip.Addr, 0, len(prefixes))
	var links []netip.Prefix
	for _, p := range prefixes {
		a := p.Addr().Unmap()
		addrs = append(addrs, a)
		if bits := p.Bits() - (p.Addr().BitLen() - a.BitLen()); !a.IsLoopback() && bits > 0 && bits < a.BitLen() {
			links = append(links, netip.PrefixFrom(a, bits).Masked())
		}
	}
	n := NewNodeAddrs(addrs)
	n.links = links
	return n
}

// ListNodeAddrs returns a snapshot of the addresses of all the node's interfaces.
func ListNodeAddrs() (NodeAddrs, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return NodeAddrs{}, fmt.Errorf("list interface addresses: %w", err)
	}
	out := make([]netip.Prefix, 0, len(addrs))
	for _, a := range addrs {
		var ip net.IP
		bits := -1
		switch v := a.(type) {
		case *net.IPNet:
			ip = v.IP
			var total int
			if bits, total = v.Mask.Size(); total == 8*net.IPv4len {
				ip = ip.To4() // a 4-byte mask: an IPv4 address, perhaps stored in 16 bytes
			}
		case *net.IPAddr:
			ip = v.IP
		default:
			continue
		}
		addr, ok := netip.AddrFromSlice(ip)
		if !ok {
			continue
		}
		if bits < 0 {
			bits = addr.BitLen()
		}
		out = append(out, netip.PrefixFrom(addr, bits))
	}
	return NodeAddrsFromPrefixes(out), nil
}

// OnSameLink reports whether a and b are both inside one on-link prefix of the node's
// interfaces (a bridge of pods, a LAN): packets between them are delivered at layer 2, never
// routed through the node.
func (a NodeAddrs) OnSameLink(x, y netip.Addr) bool {
	x, y = x.Unmap(), y.Unmap()
	for _, p := range a.links {
		if p.Contains(x) && p.Contains(y) {
			return true
		}
	}
	return false
}

// List returns the addresses, sorted. The caller must not modify it.
func (a NodeAddrs) List() []netip.Addr { return a.list }

// Contains reports whether ip is one of the addresses.
func (a NodeAddrs) Contains(ip netip.Addr) bool {
	_, ok := a.set[ip.Unmap()]
	return ok
}
