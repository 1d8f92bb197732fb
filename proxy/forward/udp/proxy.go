package udp

import (
	"errors"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/ctnetlink"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/logscope"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/runstate"
	"github.com/rs/zerolog"
)

// DefaultTimeout is the idle timeout of a UDP session when Proxy.Timeout is zero.
//
// kube-proxy's 250ms broke DNS forwarders, which wait seconds for an upstream answer (glibc's
// resolver retries after 5 s): the session, and the affinity of the flow to one endpoint, were
// gone before the answer came. 30 s is the kernel's conntrack timeout for a UDP flow
// (nf_conntrack_udp_timeout; replied flows get 120 s), so a session never outlives the conntrack
// entry that un-NATs its replies, and the proxy holds a socket per client no longer than the
// kernel holds the flow's state anyway.
const DefaultTimeout = 30 * time.Second

// udpBufSize is the size of every datagram buffer: more than the largest UDP payload (65,507
// bytes over IPv4, 65,527 over IPv6), so no datagram is ever truncated.
const udpBufSize = 64 << 10

// Proxy forwards the datagrams received on Conn to endpoints picked by Chooser, one session
// per client address.
//
// The original destination passed to Choose comes from conntrack over ctnetlink (one lookup per
// new session), which needs CAP_NET_ADMIN in the socket's network namespace; without it the
// destination is reported unknown. Replies leave from exactly the address the client's
// datagrams arrived at (IP_PKTINFO), so that conntrack matches and un-NATs them even on a
// wildcard listener of a host with several addresses, or when a REDIRECT of locally generated
// traffic moved them to 127.0.0.1.
//
// Set the fields, then run Serve in a goroutine; the fields must not change after that.
//
// The first datagram from a client address opens a session: Choose picks the endpoint and the
// proxy connects a new UDP socket to it. Later datagrams from that address go through the same
// socket; one goroutine per session reads the endpoint's replies and sends them to the client
// from Conn, so that conntrack un-NATs them back to the service address. A session ends when
// no datagram has passed either way for Timeout, when DropSessions drops its endpoint, or when
// the proxy closes. When the endpoint answers with ICMP port unreachable (or no route), the
// endpoint is reported to a forward.UnreachableChooser, and the next datagram from the client
// asks Choose again with reset=true. A datagram with no usable endpoint is dropped (iptables
// rules elsewhere send the ICMP reject).
type Proxy struct {
	// Conn is the service port's listening socket. Required. The proxy owns it from Serve on:
	// Close closes it.
	Conn *net.UDPConn
	// Chooser picks the endpoint of each new session. Required.
	Chooser forward.Chooser
	// Timeout is how long a session lives without traffic in either direction; zero means
	// DefaultTimeout.
	Timeout time.Duration
	// Log receives the proxy's events; nil discards them. Scope it to the service port.
	// Per-session and per-drop events are at debug level. (A pointer, as TCPProxy's.)
	Log *zerolog.Logger
	// LogScope, if set, adds the fields naming the service port to each event, at log time
	// (see LogScope); Log then need not be scoped.
	LogScope forward.LogScope
	// Metrics receives traffic events; nil means none.
	Metrics forward.Metrics
	// Budget is the descriptor budget shared with the other service ports; nil means
	// unlimited. Each session takes one descriptor.
	Budget *forward.Budget
	// MaxSessions bounds the sessions of this service port open at once; 0 means no bound but
	// the Budget's. A new client beyond either limit ends this port's longest-idle session
	// (Metrics.UDPSessionEvicted); when the port has none, its datagram is dropped.
	MaxSessions int

	// Resolved by Serve or Adopt (prepare) before the first session starts.
	prepared sync.Once
	metrics  forward.Metrics
	timeout  time.Duration
	epoch    time.Time       // session activity is kept as the monotonic time since epoch
	connRC   syscall.RawConn // Conn's, for the replies' sends

	connStats    udpBatchStats           // Conn's receives and the sends to endpoints
	replyStats   udpBatchStats           // the sessions' receives and the replies' sends
	testHookRecv func(fd int, conn bool) // when set, called before every batched receive (Conn's or a session's)

	sessionWG sync.WaitGroup // one count per session goroutine

	transparentWarned atomic.Bool // a failed transparent socket was logged at warning level
	refusedWarned     atomic.Bool // a datagram dropped for want of room was logged at warning level

	run    runstate.State
	frozen atomic.Bool // Freeze asks the sessions' goroutines to stop (see handover_linux.go)

	relay *udpRelay // the portable engine's state, where it serves (relay_other.go; tests)

	mu       sync.Mutex                     // guards the following fields
	sessions map[netip.AddrPort]*udpSession // nil until Serve
	startCT  *ctnetlink.Conn                // Start's loop's, closed once the loop is over
}

// udpSession is one client address's flow to one endpoint. Its goroutine (relayReplies) owns it.
type udpSession struct {
	p         *Proxy
	client    netip.AddrPort // as received on Conn (an IPv4 client of an AF_INET6 socket is mapped)
	endpoint  netip.AddrPort
	backend   *net.UDPConn    // connected to endpoint
	rc        syscall.RawConn // backend's
	clientSA  []byte          // client as a struct sockaddr, for the replies' sends
	replyFrom netip.Addr      // the replies' source; invalid when unknown
	replyOOB  []byte          // IP_PKTINFO setting replyFrom; nil when unknown

	lastActive   atomic.Int64 // p.now() of the last datagram either way
	refused      atomic.Bool  // the endpoint answered with an ICMP error
	released     atomic.Bool  // backend closed and its descriptor returned to the budget
	parked       atomic.Bool  // stopped by a freeze: its goroutine is gone, its socket open
	toEndpoint   atomic.Int64 // payload bytes
	fromEndpoint atomic.Int64
}

// udpSessionFDs is the descriptors a session holds of the Budget: its socket to the endpoint.
const udpSessionFDs = 1

// freezeDeadline is the deadline, long past, that wakes and stops a frozen proxy's waits.
var freezeDeadline = time.Unix(1, 0)

// sink returns Metrics, or a Metrics that discards everything.
func (p *Proxy) sink() forward.Metrics {
	if p.Metrics == nil {
		return forward.NopMetrics{}
	}
	return p.Metrics
}

// isUnreachable reports whether err is an ICMP error reported on a connected UDP socket: the
// endpoint's port is closed or its host cannot be reached.
func isUnreachable(err error) bool {
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EHOSTUNREACH) ||
		errors.Is(err, syscall.ENETUNREACH) || errors.Is(err, syscall.EHOSTDOWN)
}

// logDebug, logWarn and logError start an event of Log at their level, with LogScope's
// fields.
func (p *Proxy) logDebug() *zerolog.Event {
	return logscope.Event(p.LogScope, logscope.Logger(p.Log).Debug())
}
func (p *Proxy) logWarn() *zerolog.Event {
	return logscope.Event(p.LogScope, logscope.Logger(p.Log).Warn())
}
func (p *Proxy) logError() *zerolog.Event {
	return logscope.Event(p.LogScope, logscope.Logger(p.Log).Error())
}
