package forward

import (
	"net/netip"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/proxyproto"
	"github.com/rs/zerolog"
)

// Chooser picks endpoints for new connections and flows.
type Chooser interface {
	// Choose returns the endpoint for a new connection or UDP session from client.
	//
	// client is the peer's address (IPv4-mapped IPv6 addresses are unmapped). dst is the
	// original destination of the connection before the portal's REDIRECT/DNAT, from conntrack
	// (SO_ORIGINAL_DST for TCP, a ctnetlink lookup for UDP); it is the zero AddrPort when
	// unknown: the client connected to the proxy port directly, or conntrack could not be asked
	// (UDP needs CAP_NET_ADMIN for it).
	// reset=true means the previous choice for this client could not be reached: forget its
	// affinity. An error means there is no usable endpoint: TCP clients are reset, UDP
	// datagrams dropped.
	//
	// Choose is called from many goroutines at once.
	Choose(client, dst netip.AddrPort, reset bool) (Target, error)
}

// UnreachableChooser is a Chooser that hears of the endpoints that could not be reached: the TCP
// proxy reports each dial attempt that the endpoint refused, that timed out or that found no
// route, and the UDP proxy each session whose endpoint answered with an ICMP error (port
// unreachable, no route), so that the Chooser can pass over that endpoint for other connections
// and sessions for a while (it has not left the EndpointSlices yet, or never will: a node that
// stopped with its pods). Not reported: attempts that failed for the proxy's own want of
// descriptors or memory. Unreachable is called from many goroutines at once, only on failures.
type UnreachableChooser interface {
	Chooser
	Unreachable(endpoint netip.AddrPort)
}

// OriginalDstChooser is a Chooser that can tell, before a TCP connection's Choose, whether it
// will look at dst: when NeedsOriginalDst reports false, the TCP proxy does not ask the kernel
// for the connection's original destination (a getsockopt(2) per connection) and passes the
// zero AddrPort. It is asked once per connection and must be cheap. A Target asking for the
// PROXY protocol gets the original destination in its header all the same (asked for then).
type OriginalDstChooser interface {
	Chooser
	NeedsOriginalDst() bool
}

// Target is a Chooser's answer: the endpoint, and how to reach it. The zero values of Transparent
// and ProxyProtocol are a plain connection from one of the node's own addresses.
type Target struct {
	// Endpoint is the address to connect to.
	Endpoint netip.AddrPort
	// Transparent asks for a connection from the client's own address: the proxy's socket to
	// the endpoint gets IP_TRANSPARENT (IPV6_TRANSPARENT) and is bound to the client's IP (any
	// port), so the endpoint sees the client's address. Only set it when the endpoint's replies
	// are routed back through this node and delivered to such sockets (package
	// portal/transparent); otherwise the connection fails. It needs CAP_NET_ADMIN (or
	// CAP_NET_RAW): when the socket option or the bind is refused, the proxy logs it and
	// connects from the node's address instead. It is ignored when the client and the
	// endpoint are of different IP families.
	Transparent bool
	// ProxyProtocol, when set, makes the proxy send a PROXY protocol header of that version
	// (with the client's address and the original destination) before any payload. TCP only:
	// UDP sessions ignore it.
	ProxyProtocol proxyproto.Version
}

// LogScope adds the fields naming what a proxy serves (its service port) to each event the proxy
// logs, at log time (TCPProxy.LogScope, UDPProxy.LogScope): a Log scoped with With instead holds
// its context, hundreds of bytes, for every proxy, even one that never logs. The fields come
// where With's context would have put them, after the Log's own context.
type LogScope interface {
	ScopeEvent(e *zerolog.Event) *zerolog.Event
}

// Metrics receives the traffic events of one service port. Calls come from many goroutines at
// once and are made off the copy loops: at most a few per connection or session, never per
// read. Every accepted connection ends in exactly one ConnClosed (it reached an endpoint) or
// ConnFailed (it never did).
type Metrics interface {
	// ConnAccepted: a TCP connection was accepted.
	ConnAccepted()
	// ConnClosed: a TCP connection that reached an endpoint has ended.
	ConnClosed()
	// ConnFailed: a TCP connection ended without reaching an endpoint (no endpoint, every
	// dial failed, or the proxy was shut down while dialling).
	ConnFailed()
	// ConnRefused: a TCP connection was reset at once, because the port was at its connection
	// limit or the data path's descriptor budget was spent. It is not counted as accepted.
	ConnRefused()
	// DialFailed: connecting to endpoint failed (TCP dial, or a UDP endpoint that answered
	// with ICMP port unreachable).
	DialFailed(endpoint netip.AddrPort)
	// BytesCopied adds the payload bytes forwarded to and from an endpoint. Reported once when
	// a TCP connection or UDP session ends.
	BytesCopied(toEndpoint, fromEndpoint int64)
	// UDPSessionOpened and UDPSessionClosed bracket each UDP session.
	UDPSessionOpened()
	UDPSessionClosed()
	// DatagramDropped: a UDP datagram from a client could not be forwarded (no endpoint, or
	// the session's socket could not be created or written).
	DatagramDropped()
	// UDPSessionEvicted: the longest-idle session was ended early to make room for a new one
	// (the port's session limit or the descriptor budget). UDPSessionClosed follows.
	UDPSessionEvicted()
}

// NopMetrics is a Metrics that discards every event: what a proxy without Metrics reports to.
type NopMetrics struct{}

func (NopMetrics) ConnAccepted()              {}
func (NopMetrics) ConnClosed()                {}
func (NopMetrics) ConnFailed()                {}
func (NopMetrics) ConnRefused()               {}
func (NopMetrics) UDPSessionEvicted()         {}
func (NopMetrics) DialFailed(netip.AddrPort)  {}
func (NopMetrics) BytesCopied(to, from int64) {}
func (NopMetrics) UDPSessionOpened()          {}
func (NopMetrics) UDPSessionClosed()          {}
func (NopMetrics) DatagramDropped()           {}
