package forward

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rs/zerolog"
)

// defaultDialTimeouts are kube-proxy's: four attempts, 3.75 s in all.
func defaultDialTimeouts() []time.Duration {
	return []time.Duration{250 * time.Millisecond, 500 * time.Millisecond, time.Second, 2 * time.Second}
}

// sharedDialTimeouts is defaultDialTimeouts for every proxy without DialTimeouts: read only.
var sharedDialTimeouts = defaultDialTimeouts()

// TCPProxy forwards every connection accepted on Listener to an endpoint picked by Chooser.
//
// Set the fields, then run Serve in a goroutine; the fields must not change after that. Close
// stops accepting; established connections go on until they end or Shutdown cuts them.
//
// Each connection is dialled by a goroutine of its own, so a slow or dead endpoint never holds up
// the accept loop; once connected, each direction has a goroutine while it moves data (under
// Start, one idle for ParkIdleAfter gives it up until data comes). Its endpoint is dialled with
// DialTimeouts[0]; when that fails, Choose is asked again with reset=true and the next timeout
// is used, until the list is exhausted. A client
// whose connection cannot reach any endpoint is reset (RST), so it learns at once that the
// service is unavailable instead of mistaking a FIN for an empty answer. Once connected, the
// proxy copies bytes both ways (splicing bulk traffic), passes a half-close (EOF) from either side on as a CloseWrite
// to the other (the second one as the close of both), and resets both sides if either fails.
//
// Both sockets have TCP_NODELAY (Go's default). The endpoint side has TCP keepalive; the client
// side has it when the Listener came from ListenTCP (see keepalive_linux.go).
type TCPProxy struct {
	// Listener is the service port's listening socket. Required. The proxy owns it from Serve
	// on: Close and Shutdown close it.
	Listener *net.TCPListener
	// Chooser picks the endpoint of each connection. Required.
	Chooser Chooser
	// Log receives the proxy's events; nil discards them. Scope it to the service port.
	// Per-connection events are at debug level. (A pointer: a Logger is 112 bytes, held by
	// every service port's proxy.)
	Log *zerolog.Logger
	// LogScope, if set, adds the fields naming the service port to each event, at log time
	// (see LogScope); Log then need not be scoped.
	LogScope LogScope
	// DialTimeouts are the timeouts of the successive dial attempts of one connection. nil or
	// empty means 250ms, 500ms, 1s, 2s, as kube-proxy had it.
	DialTimeouts []time.Duration
	// Metrics receives traffic events; nil means none.
	Metrics Metrics
	// Budget is the descriptor budget shared with the other service ports; nil means
	// unlimited. A connection that would exceed it is reset at once (Metrics.ConnRefused).
	Budget *Budget
	// MaxConns bounds the connections of this service port open at once (accepted and not yet
	// ended); 0 means no bound but the Budget's. A connection above it is reset at once.
	MaxConns int
	// IdleTimeout ends (resets both sides of) a connection that has moved no byte either way
	// for that long, as iptables mode's conntrack established timeout would; 0 means never.
	IdleTimeout time.Duration
	// ParkIdleAfter is how long a direction of a connection of a proxy run by Start waits for
	// data on a goroutine of its own before it gives the goroutine up and has Start's Poller
	// resume it when data comes (see park.go): 0 means DefaultParkIdleAfter, less than a
	// millisecond means at once, negative means never (each direction keeps its goroutine, as
	// under Serve, which never parks).
	ParkIdleAfter time.Duration
	// Loops, when set, serves the listener and the connections on event loops instead of
	// goroutines (see loop_linux.go): Serve and Start attach the listener to one loop (Start's
	// poller and ParkIdleAfter are then unused), and every connection it accepts or Adopt takes
	// is relayed there, with the goroutine path's semantics (splice, PROXY protocol,
	// transparent dials, timeouts, limits, metrics, Freeze/Adopt/Thaw). The Loops must outlive
	// the proxy.
	Loops *Loops

	// testHookAcceptPause, if set, is called before each pause of the accept loop.
	testHookAcceptPause func(attempt int, delay time.Duration)
	// testHookDialed, if set, is called with each socket dialled to an endpoint.
	testHookDialed func(*net.TCPConn)
	// testHookLoopStarting, if set, is called by a Serve on Loops once it has started, before it
	// takes the listener's descriptor.
	testHookLoopStarting func()

	connWG sync.WaitGroup // one count per connection goroutine

	// poller is Start's (nil under Serve; guarded by mu): it resumes the accept loop and the
	// parked directions of connections. It must outlive them; if it is closed first, its Close
	// resumes them and they keep their goroutines from then on.
	poller *Poller

	pipes pipePool // splice pipes of the connections, idle ones only, when there is no Budget

	transparentWarned atomic.Bool // a failed transparent dial was logged at warning level
	refusedWarned     atomic.Bool // a refused connection was logged at warning level

	run runState

	mu       sync.Mutex // guards the following fields
	conns    map[*tcpConn]struct{}
	freezing bool       // Freeze has marked every connection: Adopt admits no more
	onLoop   *loopProxy // with Loops: the proxy's state on its loop, from its first use
}

// Serve accepts connections until Close or Shutdown, handing each to its own goroutine. It
// returns nil after Close, or an error if accept fails for a reason other than running out of
// file descriptors or memory (which pauses accepting instead). It may be called once.
func (p *TCPProxy) Serve() error {
	if p.Listener == nil || p.Chooser == nil {
		return errors.New("serve TCP proxy: Listener and Chooser are required")
	}
	if p.Loops != nil {
		return p.serveOnLoop()
	}
	ok, err := p.run.start("TCP proxy")
	if !ok {
		return err
	}
	defer p.run.ended()
	return p.acceptLoop(false)
}

// Start serves like Serve but returns at once, and holds no goroutine while the listener is idle:
// its accept loop runs on a goroutine of its own while connections arrive, and after half a
// second to a second without one it ends and has poller start it again when the next connection
// is pending (see startParked). The connections' idle directions park on poller likewise (see
// ParkIdleAfter). Close, Shutdown and Freeze work as with Serve; an error of the accept loop is
// logged. With a nil poller, or when the poller cannot watch the listener, the loop keeps its
// goroutine, and so do the directions. The poller should outlive the proxy's connections; if it
// is closed first, its Close resumes what waits on it, and the directions keep their goroutines
// from then on.
func (p *TCPProxy) Start(poller *Poller) error {
	if p.Listener == nil || p.Chooser == nil {
		return errors.New("start TCP proxy: Listener and Chooser are required")
	}
	if p.Loops != nil {
		_, err := p.startOnLoop()
		return err
	}
	p.mu.Lock()
	if p.poller == nil { // before start: a connection relayed after it must find it
		p.poller = poller
	}
	p.mu.Unlock()
	ok, err := p.run.start("TCP proxy")
	if !ok {
		return err
	}
	startParked(&p.run, poller, p.Listener, p)
	return nil
}

// serveLoop is Start's loop (loopOwner).
func (p *TCPProxy) serveLoop(idle bool) error { return p.acceptLoop(idle) }

// socketFD returns the descriptor of a socket (or of an *os.File, without Fd(), which would put
// it into blocking mode); it stays valid until the socket is closed.
func socketFD(sc syscall.Conn) (int, error) {
	rc, err := sc.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	if err := rc.Control(func(s uintptr) { fd = int(s) }); err != nil {
		return -1, err
	}
	return fd, nil
}

// The configuration the fields give, resolved where it is used (the fields do not change once
// the proxy serves): nothing derived from them is kept, as every listener has a TCPProxy.

// sink returns Metrics, or a Metrics that discards everything.
func (p *TCPProxy) sink() Metrics { return metricsOrNone(p.Metrics) }

// dialTimeouts returns DialTimeouts, or the default ones.
func (p *TCPProxy) dialTimeouts() []time.Duration {
	if len(p.DialTimeouts) == 0 {
		return sharedDialTimeouts
	}
	return p.DialTimeouts
}

// pipePool returns the pool of splice pipes the connections use: the Budget's (shared by every
// port), or the proxy's own.
func (p *TCPProxy) pipePool() *pipePool {
	if p.Budget != nil {
		return &p.Budget.pipes
	}
	return &p.pipes
}

// Close stops accepting: it closes the Listener and returns once the accept loop is gone.
// Established connections, and connections still dialling, go on. Close may be called more
// than once, and before Serve. On a frozen proxy it is Release.
func (p *TCPProxy) Close() error {
	if _, frozen := p.run.state(); frozen {
		p.Release()
		return nil
	}
	var sock io.Closer
	if p.Listener != nil {
		sock = p.Listener
		if p.Loops != nil {
			sock = loopListenerCloser{p}
		}
	}
	first, err := p.run.close(sock, "TCP proxy listener")
	if first {
		p.pipes.closeAll() // connections still running close their pipes when done
	}
	return err
}

// Shutdown closes the proxy like Close, then waits for its connections to end. When ctx ends
// first, it cuts the remaining connections (resetting both sides), waits for their goroutines
// and returns ctx's error. On a frozen proxy it is Release: the frozen connections belong to
// whoever adopts them, and are not cut.
func (p *TCPProxy) Shutdown(ctx context.Context) error {
	if _, frozen := p.run.state(); frozen {
		p.Release()
		return nil
	}
	err := p.Close()
	drained := make(chan struct{})
	go p.awaitConns(drained)
	select {
	case <-drained:
		return err
	case <-ctx.Done():
	}
	p.mu.Lock()
	cut := len(p.conns)
	for c := range p.conns {
		c.cutLocked()
	}
	p.mu.Unlock()
	cut += p.cutLoopConns()
	<-drained // cut connections end promptly: their sockets are closed and dials cancelled
	return errors.Join(err, fmt.Errorf("shut down TCP proxy: cut %d connections: %w", cut, ctx.Err()))
}

// awaitConns closes drained once every connection goroutine has returned. Its owner is
// Shutdown, which no longer admits new connections and cuts the remaining ones if it must.
func (p *TCPProxy) awaitConns(drained chan<- struct{}) {
	p.connWG.Wait()
	close(drained)
}

// acceptLoop is Serve's loop. With idle it returns errLoopIdle after half a second to a second
// without a connection (see idleDeadline).
func (p *TCPProxy) acceptLoop(idle bool) error {
	var pause resourcePause
	var deadline idleDeadline
	for {
		if idle && deadline.renew(&p.run, p.Listener.SetDeadline) {
			return nil
		}
		client, err := p.Listener.AcceptTCP()
		if err != nil {
			switch {
			case p.run.stopping():
				return nil
			case idle && errors.Is(err, os.ErrDeadlineExceeded):
				return errLoopIdle
			case isResourceExhausted(err):
				if !p.pauseAccepting(&pause, err) {
					return nil
				}
			case isPendingConnError(err):
				p.logDebug().Err(err).Msg("accept: connection failed before it was accepted")
			default:
				return fmt.Errorf("accept on %s: %w", p.Listener.Addr(), err)
			}
			continue
		}
		if pause.attempts > 0 {
			p.logInfo().Int("retries", pause.attempts).Dur("paused", time.Since(pause.start)).
				Msg("accepting connections again")
			pause = resourcePause{}
		}
		p.startConn(client)
	}
}

// pauseAccepting sleeps before the next accept after err (EMFILE and the like), logging once
// per episode. It returns false if the proxy was closed meanwhile.
func (p *TCPProxy) pauseAccepting(pause *resourcePause, err error) bool {
	if pause.attempts == 0 {
		p.logWarn().Err(err).Msg("accept: out of file descriptors or memory; pausing new connections until some close")
	}
	d := pause.next()
	if h := p.testHookAcceptPause; h != nil {
		h(pause.attempts, d)
	}
	return sleepUnlessStopped(d, p.run.stopChan())
}

// isPendingConnError reports whether an accept error belongs to the one pending connection that
// failed (accept(2): "Linux accept() passes already-pending network errors on the new socket as
// an error code"; EPERM: a firewall rule refused it), so the loop should simply accept again.
func isPendingConnError(err error) bool {
	for _, e := range []syscall.Errno{syscall.ECONNABORTED, syscall.EPROTO, syscall.ENETDOWN,
		syscall.ENOPROTOOPT, syscall.EHOSTDOWN, syscall.ENONET, syscall.EHOSTUNREACH,
		syscall.EOPNOTSUPP, syscall.ENETUNREACH, syscall.EPERM} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// startConn admits an accepted connection and starts its goroutine, or resets it at once when
// this port is at MaxConns or the Budget is spent.
func (p *TCPProxy) startConn(client *net.TCPConn) {
	c := p.newConn(client)
	p.mu.Lock()
	admitted := (p.MaxConns <= 0 || p.connCountLocked() < p.MaxConns) && p.Budget.take(tcpConnFDs)
	if admitted {
		p.addConnLocked(c)
	}
	p.mu.Unlock()
	if !admitted {
		c.endDial()
		p.sink().ConnRefused() // counted before the client can see the reset
		resetConn(client)
		p.warnRefused()
		return
	}
	p.sink().ConnAccepted()
	p.connWG.Add(1)
	go c.handle()
}

// warnRefused logs the first connection refused at admission at warning level.
func (p *TCPProxy) warnRefused() {
	if p.refusedWarned.CompareAndSwap(false, true) {
		p.logWarn().Int("maxConns", p.MaxConns).Int("budget", p.Budget.Limit()).Int("budgetInUse", p.Budget.InUse()).
			Msg("connection refused: this port's connection limit or the data path's descriptor budget is reached (logged once)")
	}
}

// addConnLocked records c among the proxy's connections; p.mu must be held. The set is made by
// the first connection: most listeners of a large cluster never see one.
func (p *TCPProxy) addConnLocked(c *tcpConn) {
	if p.conns == nil {
		p.conns = make(map[*tcpConn]struct{})
	}
	p.conns[c] = struct{}{}
}

// newConn returns the state of a connection from client, not yet admitted.
func (p *TCPProxy) newConn(client *net.TCPConn) *tcpConn {
	c := &tcpConn{p: p, client: client, clientAddr: tcpAddrPort(client.RemoteAddr()),
		idle: newIdleClock(p.IdleTimeout)}
	c.dialing.Store(newDialScope())
	return c
}

// dialScope is the context of a connection's dial (see tcpConn.dialing).
type dialScope struct {
	ctx    context.Context
	cancel context.CancelFunc
}

func newDialScope() *dialScope {
	ctx, cancel := context.WithCancel(context.Background())
	return &dialScope{ctx: ctx, cancel: cancel}
}

// cancelledCtx is the dial context of a connection whose dial was cancelled before it began.
var cancelledCtx = func() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}()

// dialContext returns the context of the connection's dial: done once endDial was called.
func (c *tcpConn) dialContext() context.Context {
	if d := c.dialing.Load(); d != nil {
		return d.ctx
	}
	return cancelledCtx
}

// endDial cancels the connection's dial context, ending a dial in progress, and lets it go:
// an idle connection keeps no context (~100 bytes each). It may be called more than once.
func (c *tcpConn) endDial() {
	if d := c.dialing.Swap(nil); d != nil {
		d.cancel()
	}
}

// testHookCloseWriteSkipped, if set, is called when a copier leaves its EOF to the close of
// both sockets (see direction.run). A package variable, not a field: it costs the proxies nothing; tests
// that set it do so before their proxy starts and clear it after it ends.
var testHookCloseWriteSkipped func()

// tcpConn is one proxied connection; handle runs it from accept to close.
type tcpConn struct {
	p          *TCPProxy
	client     *net.TCPConn
	clientAddr netip.AddrPort
	// dialing is the dial's context until the dial is over (endDial): cutting the connection
	// cancels it, which ends a dial in progress.
	dialing atomic.Pointer[dialScope]
	idle    *idleClock  // nil without IdleTimeout
	frozen  atomic.Bool // Freeze asks the connection to stop at a safe point (see handover.go)

	// Guarded by p.mu.
	endpoint netip.AddrPort // the endpoint being dialled, then the connected one
	backend  *net.TCPConn   // published once connected, so that cutLocked can reset it
	cut      bool           // cut by Shutdown
	relaying bool           // the copiers run: a freeze must wake them with deadlines
	parked   *parkedConn    // frozen: what the adopter needs to carry on
	relayed  *relayRun      // the current relay, once relaying: its parked directions need waking
	reset    bool           // resetBothLocked closed the sockets: no direction parks any more
	// stopped: the connection's goroutines have ended or parked (see stopLocked); stoppedCh is
	// closed then, made only when a freeze waits for it (96 bytes an idle connection need not
	// keep).
	stopped   bool
	stoppedCh chan struct{}
	// clientPolled and backendPolled: the socket is registered with p.poller (a direction
	// parked on it once), and must be disarmed before it is closed (see disarmLocked).
	clientPolled, backendPolled bool
}

// handle is the life of one connection, top to bottom: connect to an endpoint (with failover
// and the PROXY protocol header), then relay. A connection that reaches no endpoint is reset,
// unless it is being frozen: then it is handed over undialled.
func (c *tcpConn) handle() {
	backend := c.connect(c.dialContext(), c.clientAddr)
	// The dial is over: nothing reads its context any more, and cancelling it frees what the
	// dials attached to it (their contexts' registration: ~250 bytes an idle connection would
	// keep), and letting it go the context itself.
	c.endDial()
	if backend == nil {
		if c.parkUndialled() {
			return
		}
		resetConn(c.client)
		c.p.sink().ConnFailed()
		c.end()
		return
	}
	c.relay(backend, relayStart{})
}

// relayStart is where the relay of a connection starts: at nothing for a new connection, with
// the pending bytes and half-closes of an adopted one.
type relayStart struct {
	toEndpoint, toClient         []byte
	toEndpointDone, toClientDone bool
}

// relay starts the two copiers of a connection, each on a goroutine of its own, and returns;
// the copier that ends second closes both sides, or parks the connection when a freeze stopped
// it. Each copier is the root of its goroutine, with nothing above it: a goroutine parked in the
// network poller keeps the stack it grew, and one that parks with less than a quarter of its
// stack in use is shrunk at the next garbage collection, so an idle connection costs two of the
// runtime's smallest stacks only if its copiers wait shallow (dialling, which grows the
// caller's stack, and a frame waiting for the other direction, would keep them larger). Under
// Start, a direction idle for ParkIdleAfter gives its goroutine up altogether (see park.go):
// everything it needs to go on is in relayRun.
func (c *tcpConn) relay(backend *net.TCPConn, start relayStart) {
	r := &relayRun{c: c, backend: backend}
	r.to.init(r, backend, c.client, start.toEndpoint, start.toEndpointDone)
	r.from.init(r, c.client, backend, start.toClient, start.toClientDone)
	if !c.startRelaying(r) {
		c.park(backend, start, 0, 0)
		return
	}
	r.left.Store(2)
	go r.copyToClient()
	go r.copyToEndpoint()
}

// relayRun is one relay: the two copiers' shared state.
type relayRun struct {
	c         *tcpConn
	backend   *net.TCPConn
	parkAfter time.Duration // the directions' splicer.parkAfter
	left      atomic.Int32  // copiers still running
	eofs      atomic.Int32  // directions whose source's EOF was read (see direction.end)
	// to (client→endpoint) and from (endpoint→client) are the directions; each writes its
	// result before it counts down.
	to, from direction
}

// copyToEndpoint copies client→endpoint (pending first) until the client's EOF, then
// half-closes the endpoint.
func (r *relayRun) copyToEndpoint() { r.to.run() }

// copyToClient copies endpoint→client (pending first) until the endpoint's EOF, then
// half-closes the client.
func (r *relayRun) copyToClient() { r.from.run() }

// copierDone counts a copier down; the second one closes the connection, or parks it when a
// freeze stopped it. (The atomic count orders the first copier's result before the second's
// read of it.)
func (r *relayRun) copierDone() {
	if r.left.Add(-1) > 0 {
		return
	}
	c := r.c
	if frozen, st := frozenAt(r.to.res, r.from.res); frozen {
		c.park(r.backend, st, r.to.res.n, r.from.res.n)
		return
	}
	defer c.end()
	c.finish(r.backend, r.to.res, r.from.res)
}

// startRelaying marks the copiers as running, unless the connection is being frozen.
func (c *tcpConn) startRelaying(r *relayRun) bool {
	c.p.mu.Lock()
	defer c.p.mu.Unlock()
	if c.frozen.Load() {
		return false
	}
	c.relaying, c.relayed = true, r
	r.parkAfter = c.p.parkAfterLocked()
	return true
}

// finish closes both sides of a connection that reached its endpoint and reports it.
func (c *tcpConn) finish(backend *net.TCPConn, toEndpoint, fromEndpoint copyResult) {
	p, clientAddr := c.p, c.clientAddr
	p.mu.Lock()
	c.disarmLocked()
	p.mu.Unlock()
	c.client.Close()
	backend.Close()
	p.sink().BytesCopied(toEndpoint.n, fromEndpoint.n)
	p.sink().ConnClosed()
	if e := p.logDebug(); e.Enabled() {
		e.Stringer("client", clientAddr).Stringer("endpoint", c.endpointNow()).
			Int64("toEndpoint", toEndpoint.n).Int64("fromEndpoint", fromEndpoint.n).
			AnErr("toEndpointErr", toEndpoint.err).AnErr("fromEndpointErr", fromEndpoint.err).
			Msg("connection closed")
	}
}

// end forgets the connection, returns its descriptors to the budget, releases its context and
// lets Shutdown know it is gone.
func (c *tcpConn) end() {
	c.p.Budget.give(tcpConnFDs)
	c.endDial()
	c.p.mu.Lock()
	delete(c.p.conns, c)
	c.stopLocked()
	c.p.mu.Unlock()
	c.p.connWG.Done()
}

// stopLocked records that the connection's goroutines have ended or parked, waking a freeze
// that waits for it. p.mu must be held.
func (c *tcpConn) stopLocked() {
	c.stopped = true
	if c.stoppedCh != nil {
		close(c.stoppedCh)
	}
}

// stoppedLocked returns a channel closed once the connection's goroutines have ended or
// parked (at once if they have). p.mu must be held.
func (c *tcpConn) stoppedLocked() <-chan struct{} {
	if c.stoppedCh == nil {
		c.stoppedCh = make(chan struct{})
		if c.stopped {
			close(c.stoppedCh)
		}
	}
	return c.stoppedCh
}

// connect dials an endpoint for the connection, asking Choose again (reset=true) after each
// failure, one attempt per dial timeout, and sends the PROXY protocol header when the target
// asks for one. It returns nil when no endpoint could be reached (or the connection was cut).
func (c *tcpConn) connect(ctx context.Context, clientAddr netip.AddrPort) *net.TCPConn {
	p := c.p
	dst, dstAsked := netip.AddrPort{}, false
	if oc, ok := p.Chooser.(OriginalDstChooser); !ok || oc.NeedsOriginalDst() {
		dst, dstAsked = tcpOriginalDst(c.client), true
	}
	reset := false
	for attempt, timeout := range p.dialTimeouts() {
		target, err := p.Chooser.Choose(clientAddr, dst, reset)
		if err != nil {
			p.logDebug().Err(err).Stringer("client", clientAddr).Stringer("dst", dst).
				Msg("no endpoint; resetting the client")
			return nil
		}
		ep := target.Endpoint
		if !c.setEndpoint(ep) {
			return nil // cut
		}
		backend, err := c.dial(ctx, target, clientAddr, timeout)
		if err == nil {
			if h := p.testHookDialed; h != nil {
				h(backend)
			}
			if !c.setBackend(backend) {
				resetConn(backend)
				return nil
			}
			if target.ProxyProtocol != ProxyProtocolNone && !dstAsked {
				dst, dstAsked = tcpOriginalDst(c.client), true // the chooser did not need it: the header does
			}
			if target.ProxyProtocol != ProxyProtocolNone && !c.sendProxyHeader(backend, target.ProxyProtocol, clientAddr, dst) {
				resetConn(backend)
				return nil
			}
			return backend
		}
		p.sink().DialFailed(ep)
		switch {
		case ctx.Err() != nil:
			return nil // cut while dialling
		case isResourceExhausted(err):
			// Our own shortage, not the endpoint's fault: another endpoint will not help.
			p.logWarn().Err(err).Stringer("client", clientAddr).Stringer("endpoint", ep).
				Msg("cannot create a socket to the endpoint; closing the client")
			return nil
		}
		p.logDebug().Err(err).Stringer("client", clientAddr).Stringer("endpoint", ep).
			Int("attempt", attempt+1).Dur("timeout", timeout).Msg("dial endpoint failed")
		reset = true
	}
	p.logWarn().Stringer("client", clientAddr).Stringer("dst", dst).Int("attempts", len(p.dialTimeouts())).
		Msg("no endpoint could be reached; resetting the client")
	return nil
}

// dial connects to target's endpoint within timeout, from the client's address when the target
// asks for it and that is possible. A transparent dial refused for lack of privilege or by the
// bind falls back to a plain one, with a warning.
func (c *tcpConn) dial(ctx context.Context, target Target, client netip.AddrPort, timeout time.Duration) (*net.TCPConn, error) {
	ep := target.Endpoint
	if !target.Transparent || !canDialFrom(client.Addr(), ep) {
		return dialTCP(ctx, newDialer(timeout), ep)
	}
	// Dialer.DialTCP takes the addresses as they are (no string to parse, no resolver); it
	// binds the socket to its local address, which a transparent dial needs anyway.
	d := transparentDialer(client.Addr())
	d.Timeout, d.KeepAliveConfig = timeout, endpointKeepAlive
	conn, err := d.DialTCP(ctx, tcpNetwork(ep), netip.AddrPortFrom(client.Addr().Unmap(), 0), ep)
	if err == nil || !isTransparentSetupError(err) {
		return conn, err
	}
	logTransparentFallback(logOrNop(c.p.Log), c.p.LogScope, &c.p.transparentWarned, err, client, ep)
	return dialTCP(ctx, newDialer(timeout), ep)
}

// dialTCP connects to ep with d (or until ctx ends); d's other options are Go's defaults. It
// dials the address as a string: Dialer.DialTCP, which would spare the parsing, binds the socket
// first even to a zero local address (one system call more, and bind's choice of the source port
// rather than connect's, which shares a port among destinations).
func dialTCP(ctx context.Context, d net.Dialer, ep netip.AddrPort) (*net.TCPConn, error) {
	conn, err := d.DialContext(ctx, tcpNetwork(ep), ep.String())
	if err != nil {
		return nil, err
	}
	return conn.(*net.TCPConn), nil
}

// tcpNetwork returns the network of a dial to ep: "tcp4" or "tcp6".
func tcpNetwork(ep netip.AddrPort) string {
	if ep.Addr().Unmap().Is4() {
		return "tcp4"
	}
	return "tcp6"
}

// sendProxyHeader writes the PROXY protocol header of version v to the endpoint, naming the
// client and the original destination (the address the client connected to when that is
// unknown). It reports whether the header was sent; the connection is abandoned otherwise.
func (c *tcpConn) sendProxyHeader(backend *net.TCPConn, v ProxyProtocol, client, dst netip.AddrPort) bool {
	if !dst.IsValid() {
		dst = tcpAddrPort(c.client.LocalAddr())
	}
	hdr, err := appendProxyHeader(make([]byte, 0, 64), v, true, client, dst)
	if err == nil {
		_, err = backend.Write(hdr)
	}
	if err != nil {
		c.p.logDebug().Err(err).Stringer("client", client).Stringer("endpoint", c.endpointNow()).
			Msg("sending the PROXY protocol header failed; resetting the client")
		return false
	}
	return true
}

func (c *tcpConn) setEndpoint(ep netip.AddrPort) bool {
	c.p.mu.Lock()
	defer c.p.mu.Unlock()
	c.endpoint = ep
	return !c.cut
}

func (c *tcpConn) setBackend(b *net.TCPConn) bool {
	c.p.mu.Lock()
	defer c.p.mu.Unlock()
	c.backend = b
	return !c.cut
}

func (c *tcpConn) endpointNow() netip.AddrPort {
	c.p.mu.Lock()
	defer c.p.mu.Unlock()
	return c.endpoint
}

// copyResult is the outcome of one direction of a connection: it ended with src's EOF passed
// on (done), or was stopped by a freeze (frozen, with the bytes read but not written), or
// failed (err).
type copyResult struct {
	n       int64
	err     error
	done    bool
	frozen  bool
	pending []byte
}

// frozenAt reports whether a freeze stopped the connection whose directions ended with to and
// from (neither failed, at least one frozen), and where an adopter must start again.
func frozenAt(to, from copyResult) (bool, relayStart) {
	if to.err != nil || from.err != nil || !(to.frozen || from.frozen) {
		return false, relayStart{}
	}
	return true, relayStart{toEndpoint: to.pending, toClient: from.pending, toEndpointDone: to.done, toClientDone: from.done}
}

// direction is one direction of a relay: the copier's state and result, on the heap, so that
// the direction can give its goroutine up while idle and go on on another (see park.go).
type direction struct {
	r        *relayRun
	dst, src *net.TCPConn
	s        *splicer // the copy, once started; nil while parked (see shelve)
	pending  []byte   // to write to dst first (an adopted connection's)
	res      copyResult
	park     parkState // see park.go
	done     bool      // done already (an adopted connection's): copy nothing
	spliced  bool      // while parked: the shelved splicer had switched to splice
}

func (d *direction) init(r *relayRun, dst, src *net.TCPConn, pending []byte, done bool) {
	d.r, d.dst, d.src, d.pending, d.done = r, dst, src, pending, done
	d.park.wakeFn = d.wake
}

// run is a copier: it writes pending to dst, then copies src to dst and passes src's EOF on to
// dst with CloseWrite, or, when it is the connection's second EOF, with the close of both
// sockets that follows once the other copier has ended (a FIN all the same: both EOFs were
// read, so the close finds no unread data and sends no RST; one system call less per
// connection). A direction already done does nothing. The bytes move through a pooled buffer
// until a read fills it, then with splice(2) through a pipe taken from the proxy's pool, either
// held only while data flows (see spliceCopy): no user-space copy of bulk traffic, and no
// buffer or pipe held by an idle connection. On an error in either direction both sockets are
// reset, which also ends the other direction. A freeze stops it with what it has not written.
//
// It writes its result into d.res, rather than returning it: the copier goroutines wait inside
// it for data, and a smaller frame keeps their parked stacks small (see relay).
func (d *direction) run() {
	if d.begin() {
		d.copy()
		return
	}
	d.r.copierDone()
}

// begin writes the pending bytes and prepares the copy; false means the direction has ended
// (it was done, or failed), with its result written.
func (d *direction) begin() bool {
	rr, r := d.r, &d.res
	c := rr.c
	if d.done {
		rr.eofs.Add(1)
		r.done = true
		return false
	}
	if len(d.pending) > 0 {
		w, err := d.dst.Write(d.pending)
		r.n = int64(w)
		if err != nil {
			r.pending = d.pending[w:]
			c.pumpFailed(r, err)
			return false
		}
		c.idle.touch()
	}
	d.pending = nil
	s, err := newSplicer(c.p.pipePool(), d.dst, d.src)
	if err == nil {
		s.idle, s.frozen, s.parkAfter = c.idle, &c.frozen, rr.parkAfter
		err = s.armIdle()
	}
	if err != nil {
		d.end(0, nil, err)
		return false
	}
	d.s = s
	return true
}

// copy runs the copy until it ends, or parks the direction and returns when it would wait
// (resume calls it again, on another goroutine).
func (d *direction) copy() {
	if d.s == nil && !d.unshelve() {
		d.r.copierDone()
		return
	}
	for {
		n, err := d.s.run()
		if errors.Is(err, errWouldBlock) {
			if d.parkOn() {
				return
			}
			continue
		}
		d.end(n, d.s.pending, err)
		d.r.copierDone()
		return
	}
}

// end records the outcome of the copy: n bytes written in all, rest read and not written (a
// freeze's), err. On src's EOF (nil err) it passes the EOF on (see run).
func (d *direction) end(n int64, rest []byte, err error) {
	rr, r := d.r, &d.res
	c := rr.c
	d.stopTimer()
	r.n += n
	r.pending = rest
	if err == nil {
		if rr.eofs.Add(1) == 2 {
			r.done = true // the second EOF: copierDone's close passes it on
			if h := testHookCloseWriteSkipped; h != nil {
				h()
			}
			return
		}
		if err = d.dst.CloseWrite(); err == nil {
			r.done = true
			return
		}
	}
	c.pumpFailed(r, err)
}

// pumpFailed ends a direction stopped by err: frozen when err is the freeze's doing, else
// failed, resetting both sockets.
func (c *tcpConn) pumpFailed(r *copyResult, err error) {
	if errors.Is(err, errFrozen) || (errors.Is(err, os.ErrDeadlineExceeded) && c.frozen.Load()) {
		r.frozen = true
		return
	}
	r.err, r.pending = err, nil
	c.p.mu.Lock()
	c.resetBothLocked()
	c.p.mu.Unlock()
}

// cutLocked ends the connection on the proxy's behalf: it cancels a dial in progress and resets
// both sides.
func (c *tcpConn) cutLocked() {
	if c.cut || c.parked != nil {
		return
	}
	c.cut = true
	c.endDial()
	c.resetBothLocked()
}

// resetBothLocked resets both sockets and wakes the directions parked on the Poller, which then
// find their sockets closed. p.mu must be held.
func (c *tcpConn) resetBothLocked() {
	c.reset = true
	c.disarmLocked() // before the close: the descriptors' numbers may be reused at once
	resetConn(c.client)
	if c.backend != nil {
		resetConn(c.backend)
	}
	c.wakeParkedLocked()
}

// resetConn closes conn with an RST instead of a FIN (SO_LINGER with a zero timeout), dropping
// unsent data. Closing an already closed conn does nothing.
func resetConn(conn *net.TCPConn) {
	_ = conn.SetLinger(0)
	_ = conn.Close()
}

// logDebug, logInfo, logWarn and logError start an event of Log at their level, with LogScope's
// fields.
func (p *TCPProxy) logDebug() *zerolog.Event { return scoped(p.LogScope, logOrNop(p.Log).Debug()) }
func (p *TCPProxy) logInfo() *zerolog.Event  { return scoped(p.LogScope, logOrNop(p.Log).Info()) }
func (p *TCPProxy) logWarn() *zerolog.Event  { return scoped(p.LogScope, logOrNop(p.Log).Warn()) }
func (p *TCPProxy) logError() *zerolog.Event { return scoped(p.LogScope, logOrNop(p.Log).Error()) }
