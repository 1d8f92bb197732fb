package userspace

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/proxyproto"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/tcp"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/udp"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/portalloc"
)

// TrafficMetrics hands out the traffic-metrics sink of each service port.
type TrafficMetrics interface {
	ForPort(name proxy.Name, protocol v1.Protocol) forward.Metrics
	// Forget drops a deleted service port's series.
	Forget(name proxy.Name, protocol v1.Protocol)
	// KeepEndpoints drops the per-endpoint series of the port's endpoints that keep rejects.
	KeepEndpoints(name proxy.Name, protocol v1.Protocol, keep func(netip.AddrPort) bool)
	// AffinityEvicted counts a ClientIP affinity entry evicted at the balancer's bound.
	AffinityEvicted(name proxy.Name, protocol v1.Protocol)
}

// maxOpenAttempts bounds how many ports of the range one open tries before giving up until the
// next sync.
const maxOpenAttempts = 16

// listener is one service port's proxy listener and the forwarder serving it.
type listener struct {
	// log is the proxier's logger; each event gets the servicePort field at log time (see
	// ScopeEvent): a logger scoped with With would hold its context, some 500 bytes, for every
	// listener, most of which never log.
	log *zerolog.Logger
	// choose picks the endpoints of its connections and flows; it holds the port's current
	// definition, swapped by the sync.
	choose chooser
	// key is the port's name as a string, for sorting; fixed at creation.
	key string
	// endpoints and balanced are the port's endpoints and definition as the sync last handed
	// them to the balancer; under Proxier.mu.
	endpoints []proxy.Endpoint
	balanced  *proxy.ServicePort
	// selfSP and selfPort are what the proxier's selfAddrs hold of this listener (see
	// selfAddrs.add); nil and 0 when nothing. Under Proxier.mu.
	selfSP   *proxy.ServicePort
	selfPort int
	// state is the port's state as a sync last computed it, valid while stateOK; under
	// Proxier.mu. A sync recomputes the states of the services it touches, and all of them
	// when it is periodic (see Proxier.portStatesLocked).
	state   proxy.PortState
	stateOK bool
	// problem is the reason of the Problem last reported for the listener's failure to open
	// ("" when it opened); set by Proxier.openLocked, which runs for distinct listeners at once.
	problem string

	// The following fields are set by open and cleared by close, under Proxier.mu.
	proxyPort int // 0 while not open
	// inherit is what a predecessor handed over for this listener, taken by the next open.
	inherit *inherited
	tcp     *tcp.Proxy
	udp     *udp.Proxy
	// adopt holds the handed-over connections (conns) and sessions (sessions) of a listener
	// open yet not started: start adopts them. (One pointer: most listeners never have any.)
	adopt   *inherited
	started bool
	frozen  bool // a hand-over froze it (Proxier.Freeze); thawed if it fails
}

// ScopeEvent adds the service port to an event of the listener or its forwarder
// (forward.LogScope), as a logger scoped with With would. A nil e (the level is off) stays nil.
func (l *listener) ScopeEvent(e *zerolog.Event) *zerolog.Event {
	return e.Stringer("servicePort", l.choose.sp.Load())
}

// logDebug, logInfo, logWarn and logError start an event of the listener's log, at their level.
func (l *listener) logDebug() *zerolog.Event { return l.ScopeEvent(l.log.Debug()) }
func (l *listener) logInfo() *zerolog.Event  { return l.ScopeEvent(l.log.Info()) }
func (l *listener) logWarn() *zerolog.Event  { return l.ScopeEvent(l.log.Warn()) }
func (l *listener) logError() *zerolog.Event { return l.ScopeEvent(l.log.Error()) }

func (l *listener) protocol() v1.Protocol { return l.choose.sp.Load().Protocol }

func (l *listener) isOpen() bool { return l.proxyPort != 0 }

// picker is what a chooser needs of the load balancer.
type picker interface {
	Next(name proxy.Name, client netip.Addr, external, resetAffinity bool) (proxy.Endpoint, error)
	Unreachable(name proxy.Name, endpoint netip.AddrPort)
}

// chooser picks the endpoint of each new connection or flow of one service port
// (forward.Chooser). It knows the port, the balancer and this node; nothing of the proxier.
type chooser struct {
	sp      atomic.Pointer[proxy.ServicePort]
	lb      picker
	routing *routing
}

var (
	_ forward.OriginalDstChooser = (*chooser)(nil)
	_ forward.UnreachableChooser = (*chooser)(nil)
)

// Choose picks the endpoint for a new connection or flow (forward.Chooser). Traffic whose
// original destination is not one of the ClusterIPs arrived on a NodePort, externalIP or LB IP
// and follows the external traffic policy.
//
// The target is transparent (dialled from the client's address) for external traffic of an
// externalTrafficPolicy: Local service to an endpoint on this node when Options.TransparentLocal
// is set, and carries the service's PROXY protocol setting whatever its policy.
func (c *chooser) Choose(client, dst netip.AddrPort, reset bool) (forward.Target, error) {
	sp := c.sp.Load()
	external := dst.IsValid() && sp.UsesExternalPolicy(dst.Addr().Unmap())
	if external && sp.ExternalPolicyLocal && c.routing.inCluster(client.Addr()) {
		// Traffic the node itself or a pod sends to a NodePort, externalIP or LB IP has no
		// client IP to preserve: like kube-proxy's "route LOCAL traffic ... to service chain"
		// rule (addrtype --src-type LOCAL) and its pod-traffic rule (-s cluster CIDR), it is
		// treated as ClusterIP traffic and may use endpoints on every node (subject to
		// internalTrafficPolicy).
		external = false
	}
	ep, err := c.lb.Next(sp.Name, client.Addr().Unmap(), external, reset)
	if err != nil {
		return forward.Target{}, err
	}
	// Dial from the client's address only where the endpoint's replies come back through this
	// node: external traffic of a Local service to an endpoint here (never Cluster policy or
	// remote endpoints, whose replies would bypass the proxy).
	// Never to an endpoint that is one of this node's own addresses (a hostNetwork pod): its
	// replies are local traffic that never crosses mangle PREROUTING, where the reply routing of
	// transparent connections is. Nor when the client and the endpoint share a link of the node
	// (a pod on the same bridge, with no --cluster-cidr to tell it is a pod): the endpoint would
	// answer the client at layer 2, past the node, and the client would reset the stray reply.
	r := c.routing
	transparent := r.transparentLocal.Load() && external && sp.ExternalPolicyLocal &&
		ep.NodeName != "" && ep.NodeName == r.nodeName && !r.isNodeAddr(ep.Addr.Addr()) &&
		!r.nodeAddrs().OnSameLink(client.Addr(), ep.Addr.Addr())
	return forward.Target{Endpoint: ep.Addr, Transparent: transparent, ProxyProtocol: proxyProtocol(sp.ProxyProtocol)}, nil
}

// Unreachable tells the balancer that a dial to endpoint failed (forward.UnreachableChooser): it
// passes over the endpoint for a while.
func (c *chooser) Unreachable(endpoint netip.AddrPort) {
	c.lb.Unreachable(c.sp.Load().Name, endpoint)
}

// NeedsOriginalDst reports whether Choose looks at dst (forward.OriginalDstChooser): only to tell
// ClusterIP traffic from external traffic, which differ only when either traffic policy is Local
// (both classes use the cluster-wide endpoints otherwise; transparent dialling needs Local), and
// for the PROXY protocol header. Without it, the TCP proxy saves a getsockopt(2) per connection.
// (A policy that changes between this call and Choose misclassifies at most the connections
// accepted in between, as when the change came a moment later.)
func (c *chooser) NeedsOriginalDst() bool {
	sp := c.sp.Load()
	return sp.ExternalPolicyLocal || sp.InternalPolicyLocal || sp.ProxyProtocol != proxy.ProxyProtocolNone
}

// proxyProtocol maps the service's PROXY protocol annotation to forward's setting.
func proxyProtocol(v proxy.ProxyProtocol) proxyproto.Version {
	switch v {
	case proxy.ProxyProtocolV1:
		return proxyproto.V1
	case proxy.ProxyProtocolV2:
		return proxyproto.V2
	}
	return proxyproto.None
}

// open allocates a proxy port (the preferred one if it can) and opens the listening socket;
// start then serves it.
func (l *listener) open(cfg *listenConfig) error {
	sp := l.choose.sp.Load()
	var metrics forward.Metrics
	if cfg.metrics != nil {
		metrics = cfg.metrics.ForPort(sp.Name, sp.Protocol)
	}
	if in := l.inherit; in != nil {
		l.inherit = nil
		err := l.openInherited(cfg, in, metrics)
		if err == nil {
			return nil
		}
		cfg.alloc.Release(in.proxyPort)
		l.logWarn().Err(err).Int("proxyPort", in.proxyPort).Msg("cannot serve the handed-over listener; opening a new one")
	}
	if l.openPreferred(cfg, sp, metrics) {
		return nil
	}
	alloc := cfg.alloc
	var failed []int
	defer func() {
		for _, p := range failed {
			alloc.Release(p)
		}
	}()
	attempts := maxOpenAttempts
	if r := alloc.Range(); r.Size > 0 && r.Size < attempts {
		attempts = r.Size
	}
	var lastErr error
	for range attempts {
		port, err := alloc.Allocate()
		if err != nil {
			return fmt.Errorf("open proxy listener for %s: %w (last bind error: %v)", sp, err, lastErr)
		}
		if err := l.listen(sp.Protocol, cfg, port, metrics); err != nil {
			lastErr = err
			failed = append(failed, port)
			continue
		}
		return nil
	}
	return fmt.Errorf("open proxy listener for %s: %d ports tried: %w", sp, attempts, lastErr)
}

// listen opens the listening socket of the port on bind:port.
func (l *listener) listen(proto v1.Protocol, cfg *listenConfig, port int, metrics forward.Metrics) error {
	bind := cfg.bind
	addr := listenAddr(bind, port)
	if proto == v1.ProtocolUDP {
		conn, err := net.ListenUDP(network("udp", bind), net.UDPAddrFromAddrPort(addr))
		if err != nil {
			return err
		}
		l.proxyPort = conn.LocalAddr().(*net.UDPAddr).Port
		l.udp = l.newUDP(cfg, conn, metrics)
		return nil
	}
	ln, err := tcp.Listen(network("tcp", bind), net.TCPAddrFromAddrPort(addr))
	if err != nil {
		return err
	}
	l.proxyPort = ln.Addr().(*net.TCPAddr).Port
	l.tcp = l.newTCP(cfg, ln, metrics)
	return nil
}

// start adopts what was handed over for an open listener and starts serving it. open leaves
// this to start so that the sync can hand the port's endpoints to the balancer in between: the
// rules may lead to the socket already (a handed-over listener, or the proxy port of an earlier
// run), and a connection waiting in its backlog, or an adopted one still to be dialled, would
// otherwise meet a balancer without endpoints and be reset.
func (l *listener) start(cfg *listenConfig) {
	if l.started || !l.isOpen() {
		return
	}
	l.started = true
	if cfg.testHookServe != nil {
		cfg.testHookServe(l)
	}
	switch {
	case l.tcp != nil:
		var conns []forward.TCPConnState
		if l.adopt != nil {
			conns, l.adopt = l.adopt.conns, nil
		}
		if err := l.tcp.Adopt(conns); err != nil {
			l.logError().Err(err).Msg("handed-over connections not adopted; the others go on")
		}
		l.serveTCP(cfg)
	case l.udp != nil:
		var sessions []forward.UDPSessionState
		if l.adopt != nil {
			sessions, l.adopt = l.adopt.sessions, nil
		}
		if err := l.udp.Adopt(sessions); err != nil {
			l.logError().Err(err).Msg("handed-over UDP sessions not adopted; the others go on")
		}
		l.serveUDP(cfg)
	}
}

func (l *listener) newUDP(cfg *listenConfig, conn *net.UDPConn, metrics forward.Metrics) *udp.Proxy {
	return &udp.Proxy{Conn: conn, Chooser: &l.choose, Timeout: cfg.udpTimeout, Log: l.log, LogScope: l, Metrics: metrics,
		Budget: cfg.budget, MaxSessions: cfg.maxSessions}
}

func (l *listener) newTCP(cfg *listenConfig, ln *net.TCPListener, metrics forward.Metrics) *tcp.Proxy {
	return &tcp.Proxy{Listener: ln, Chooser: &l.choose, Log: l.log, LogScope: l, Metrics: metrics,
		Budget: cfg.budget, MaxConns: cfg.maxConns, IdleTimeout: cfg.idleTimeout, Loops: cfg.loops}
}

// serveTCP starts the TCP proxy, on the event loops it was made with (listenConfig.loops).
func (l *listener) serveTCP(_ *listenConfig) {
	if err := l.tcp.Start(); err != nil {
		l.logError().Err(err).Str("protocol", string(v1.ProtocolTCP)).Msg("proxy listener not serving")
	}
}

// serveUDP starts the UDP proxy; with cfg's poller, a port without datagrams holds no goroutine.
func (l *listener) serveUDP(cfg *listenConfig) {
	if err := l.udp.Start(cfg.poller); err != nil {
		l.logError().Err(err).Str("protocol", string(v1.ProtocolUDP)).Msg("proxy listener not serving")
	}
}

// endpointsChanged drops UDP sessions to endpoints that left the port.
func (l *listener) endpointsChanged(eps []proxy.Endpoint) {
	if l.udp == nil {
		return
	}
	keep := make(map[netip.AddrPort]bool, len(eps))
	for _, e := range eps {
		if e.Serving || e.Ready {
			keep[e.Addr] = true
		}
	}
	l.udp.DropSessions(func(ep netip.AddrPort) bool { return keep[ep] })
}

// stopAccepting closes the listening socket; established TCP connections go on.
func (l *listener) stopAccepting() {
	if in := l.adopt; in != nil { // open, never started: nobody adopted them
		for _, c := range in.conns {
			resetFile(c.Client)
			resetFile(c.Backend)
		}
		for _, s := range in.sessions {
			_ = s.Backend.Close()
		}
		l.adopt = nil
	}
	var err error
	switch {
	case l.tcp != nil:
		err = l.tcp.Close()
	case l.udp != nil:
		err = l.udp.Close()
	}
	if err != nil && !errors.Is(err, net.ErrClosed) {
		l.logWarn().Err(err).Msg("closing proxy listener")
	}
}

// close stops the listener, cuts its established connections and releases its port.
func (l *listener) close(alloc *portalloc.Allocator, m TrafficMetrics) {
	l.stopAccepting()
	if l.tcp != nil {
		ctx, cancel := context.WithCancel(context.Background())
		cancel() // a deleted service port's connections end now
		_ = l.tcp.Shutdown(ctx)
	}
	l.release(alloc)
	if m != nil {
		sp := l.choose.sp.Load()
		m.Forget(sp.Name, sp.Protocol)
	}
}

// shutdown waits for established TCP connections until ctx is done.
func (l *listener) shutdown(ctx context.Context) error {
	if l.tcp == nil {
		return nil
	}
	return l.tcp.Shutdown(ctx)
}

func (l *listener) release(alloc *portalloc.Allocator) {
	if l.proxyPort != 0 {
		alloc.Release(l.proxyPort)
	}
	l.proxyPort, l.tcp, l.udp, l.started = 0, nil, nil, false
}

func listenAddr(bind netip.Addr, port int) netip.AddrPort {
	if bind.IsUnspecified() {
		return netip.AddrPortFrom(netip.IPv6Unspecified(), uint16(port))
	}
	return netip.AddrPortFrom(bind, uint16(port))
}

// network returns the network ("tcp" or "udp") of the listener's family: an unspecified bind
// address listens on both families.
func network(proto string, bind netip.Addr) string {
	switch {
	case bind.IsUnspecified():
		return proto
	case bind.Is4():
		return proto + "4"
	}
	return proto + "6"
}

// portHolds keeps TCP ports bound, without listening, from the proxier's creation until the
// listeners that prefer them open (see Options.PreferredPorts). A restarted proxy's preferred
// ports are free from the earlier process's exit until its listeners open, and at 10,000
// service ports a third of the ephemeral range is preferred ports: an outgoing connection
// made meanwhile — the proxy's own to the API server, made before the first sync — picks one
// about as often, and that service port then needs another proxy port, which rewrites its
// rules (~0.2 s of iptables-restore at 10,000) and, at the next periodic sync, every rule
// (~0.4 s, ~20 MB of garbage). The kernel gives outgoing connections no port a socket is
// bound to. Safe for concurrent use.
type portHolds struct {
	mu  sync.Mutex
	fds map[int]io.Closer // port -> its socket (bindTCP)
}

// holdPorts binds a TCP socket to each of ports on bind (the listeners' address), at most max
// of them; a port it cannot bind (another socket has it) is not held.
func holdPorts(bind netip.Addr, ports []int, max int) *portHolds {
	h := &portHolds{fds: make(map[int]io.Closer, min(len(ports), max))}
	for _, port := range ports {
		if len(h.fds) >= max {
			break
		}
		if c, err := bindTCP(netip.AddrPortFrom(bind, uint16(port))); err == nil {
			h.fds[port] = c
		}
	}
	return h
}

// release closes the socket holding port, if any, so that a listener can bind it. A nil h holds
// nothing.
func (h *portHolds) release(port int) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if c, ok := h.fds[port]; ok {
		_ = c.Close()
		delete(h.fds, port)
	}
}

// releaseAll closes every socket still holding a port.
func (h *portHolds) releaseAll() {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for port, c := range h.fds {
		_ = c.Close()
		delete(h.fds, port)
	}
}
