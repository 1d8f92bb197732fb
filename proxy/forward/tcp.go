package forward

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
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

// TCPProxy forwards every connection accepted on Listener to an endpoint picked by Chooser.
//
// Set the fields, then run Serve in a goroutine; the fields must not change after that. Close
// stops accepting; established connections go on until they end or Shutdown cuts them.
//
// Each connection is dialled by a goroutine of its own, so a slow or dead endpoint never holds up
// the accept loop; once connected, each direction has a goroutine. Its endpoint is dialled with DialTimeouts[0]; when that fails, Choose is asked
// again with reset=true and the next timeout is used, until the list is exhausted. A client
// whose connection cannot reach any endpoint is reset (RST), so it learns at once that the
// service is unavailable instead of mistaking a FIN for an empty answer. Once connected, the
// proxy splices bytes both ways, passes a half-close (EOF) from either side on as a CloseWrite
// to the other, and resets both sides if either fails.
//
// Both sockets have TCP_NODELAY (Go's default). The endpoint side has TCP keepalive; the client
// side has it when the Listener came from ListenTCP (see keepalive_linux.go).
type TCPProxy struct {
	// Listener is the service port's listening socket. Required. The proxy owns it from Serve
	// on: Close and Shutdown close it.
	Listener *net.TCPListener
	// Chooser picks the endpoint of each connection. Required.
	Chooser Chooser
	// Log receives the proxy's events; the zero Logger discards them. Scope it to the service
	// port. Per-connection events are at debug level.
	Log zerolog.Logger
	// DialTimeouts are the timeouts of the successive dial attempts of one connection. nil or
	// empty means 250ms, 500ms, 1s, 2s, as kube-proxy had it.
	DialTimeouts []time.Duration
	// Metrics receives traffic events; nil means none.
	Metrics Metrics

	// testHookAcceptPause, if set, is called before each pause of the accept loop.
	testHookAcceptPause func(attempt int, delay time.Duration)

	// Resolved from the fields above by Serve, before any connection goroutine starts.
	metrics  Metrics
	timeouts []time.Duration

	connWG sync.WaitGroup // one count per connection goroutine

	pipes pipePool // splice pipes of the connections, idle ones only

	transparentWarned atomic.Bool // a failed transparent dial was logged at warning level

	mu    sync.Mutex // guards the following fields
	run   runState
	conns map[*tcpConn]struct{}
}

// Serve accepts connections until Close or Shutdown, handing each to its own goroutine. It
// returns nil after Close, or an error if accept fails for a reason other than running out of
// file descriptors or memory (which pauses accepting instead). It may be called once.
func (p *TCPProxy) Serve() error {
	if p.Listener == nil || p.Chooser == nil {
		return errors.New("serve TCP proxy: Listener and Chooser are required")
	}
	p.mu.Lock()
	p.initLocked()
	done, ok, err := p.run.startLocked("TCP proxy")
	if !ok {
		p.mu.Unlock()
		return err
	}
	p.metrics = metricsOrNone(p.Metrics)
	p.timeouts = p.DialTimeouts
	if len(p.timeouts) == 0 {
		p.timeouts = defaultDialTimeouts()
	}
	p.mu.Unlock()
	defer close(done)
	return p.acceptLoop()
}

func (p *TCPProxy) initLocked() {
	p.run.initLocked()
	if p.conns == nil {
		p.conns = make(map[*tcpConn]struct{})
	}
}

// Close stops accepting: it closes the Listener and returns once the accept loop is gone.
// Established connections, and connections still dialling, go on. Close may be called more
// than once, and before Serve.
func (p *TCPProxy) Close() error {
	var sock io.Closer
	if p.Listener != nil {
		sock = p.Listener
	}
	first, err := p.run.close(&p.mu, p.initLocked, sock, "TCP proxy listener")
	if first {
		p.pipes.closeAll() // connections still running close their pipes when done
	}
	return err
}

// Shutdown closes the proxy like Close, then waits for its connections to end. When ctx ends
// first, it cuts the remaining connections (resetting both sides), waits for their goroutines
// and returns ctx's error.
func (p *TCPProxy) Shutdown(ctx context.Context) error {
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
	<-drained // cut connections end promptly: their sockets are closed and dials cancelled
	return errors.Join(err, fmt.Errorf("shut down TCP proxy: cut %d connections: %w", cut, ctx.Err()))
}

// awaitConns closes drained once every connection goroutine has returned. Its owner is
// Shutdown, which no longer admits new connections and cuts the remaining ones if it must.
func (p *TCPProxy) awaitConns(drained chan<- struct{}) {
	p.connWG.Wait()
	close(drained)
}

// CloseConnectionsTo cuts (resets both sides of) every connection whose endpoint keep rejects,
// including connections still dialling it, and returns how many it cut. The proxy never does
// this on its own: established connections to a terminating endpoint are left to finish.
func (p *TCPProxy) CloseConnectionsTo(keep func(endpoint netip.AddrPort) bool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for c := range p.conns {
		if c.endpoint.IsValid() && !c.cut && !keep(c.endpoint) {
			c.cutLocked()
			n++
		}
	}
	return n
}

// acceptLoop is Serve's loop.
func (p *TCPProxy) acceptLoop() error {
	var pause resourcePause
	for {
		client, err := p.Listener.AcceptTCP()
		if err != nil {
			switch {
			case p.run.stopping():
				return nil
			case isResourceExhausted(err):
				if !p.pauseAccepting(&pause, err) {
					return nil
				}
			case isPendingConnError(err):
				p.Log.Debug().Err(err).Msg("accept: connection failed before it was accepted")
			default:
				return fmt.Errorf("accept on %s: %w", p.Listener.Addr(), err)
			}
			continue
		}
		if pause.attempts > 0 {
			p.Log.Info().Int("retries", pause.attempts).Dur("paused", time.Since(pause.start)).
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
		p.Log.Warn().Err(err).Msg("accept: out of file descriptors or memory; pausing new connections until some close")
	}
	d := pause.next()
	if h := p.testHookAcceptPause; h != nil {
		h(pause.attempts, d)
	}
	return sleepUnlessStopped(d, p.run.stop)
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

// startConn registers an accepted connection and starts its goroutine.
func (p *TCPProxy) startConn(client *net.TCPConn) {
	ctx, cancel := context.WithCancel(context.Background())
	c := &tcpConn{p: p, client: client, ctx: ctx, cancel: cancel}
	p.mu.Lock()
	p.conns[c] = struct{}{}
	p.mu.Unlock()
	p.metrics.ConnAccepted()
	p.connWG.Add(1)
	go c.serve()
}

// tcpConn is one proxied connection. Its goroutines own it: serve while connecting, then the two
// copy goroutines, the last of which finishes it.
type tcpConn struct {
	p      *TCPProxy
	client *net.TCPConn
	ctx    context.Context // cancelled when the connection is cut; ends a dial in progress
	cancel context.CancelFunc

	// Guarded by p.mu.
	endpoint netip.AddrPort // the endpoint being dialled, then the connected one
	backend  *net.TCPConn   // set once connected
	cut      bool           // cut by Shutdown or CloseConnectionsTo

	// Set by serve before the copy goroutines start; fixed from then on.
	backend0 *net.TCPConn
	// Each direction's result, written by its goroutine before it decrements copying; the
	// goroutine that brings copying to zero reads both.
	toEndpoint, fromEndpoint copyResult
	copying                  atomic.Int32
}

// serve runs the connection: it connects to an endpoint, then hands the two directions to
// goroutines of their own (copyToEndpoint, copyToClient) and returns; the last of them to
// finish closes both sides.
//
// The copies get fresh goroutines, rather than this one, because of memory: dialling grows a
// goroutine's stack past the runtime's smallest size, and a goroutine parked in the network
// poller never shrinks back to it. An idle connection thus costs two minimal stacks.
func (c *tcpConn) serve() {
	backend := c.open()
	if backend == nil {
		return
	}
	c.backend0 = backend
	c.copying.Store(2)
	go c.copyToClient()
	go c.copyToEndpoint()
}

// open connects the connection to an endpoint. When it cannot, it resets the client, ends the
// connection and returns nil.
func (c *tcpConn) open() *net.TCPConn {
	backend := c.connect(tcpAddrPort(c.client.RemoteAddr()))
	if backend == nil {
		resetConn(c.client)
		c.p.metrics.ConnFailed()
		c.end()
	}
	return backend
}

// finish closes both sides of a connection that reached its endpoint, reports it and ends it.
func (c *tcpConn) finish(backend *net.TCPConn, toEndpoint, fromEndpoint copyResult) {
	p := c.p
	c.client.Close()
	backend.Close()
	p.metrics.BytesCopied(toEndpoint.n, fromEndpoint.n)
	p.metrics.ConnClosed()
	if e := p.Log.Debug(); e.Enabled() {
		e.Stringer("client", tcpAddrPort(c.client.RemoteAddr())).Stringer("endpoint", c.endpointNow()).
			Int64("toEndpoint", toEndpoint.n).Int64("fromEndpoint", fromEndpoint.n).
			AnErr("toEndpointErr", toEndpoint.err).AnErr("fromEndpointErr", fromEndpoint.err).
			Msg("connection closed")
	}
	c.end()
}

// end forgets the connection, releases its context and lets Shutdown know it is gone.
func (c *tcpConn) end() {
	c.p.forget(c)
	c.cancel()
	c.p.connWG.Done()
}

// connect dials an endpoint for the connection, asking Choose again (reset=true) after each
// failure, one attempt per dial timeout. It returns nil when no endpoint could be reached.
func (c *tcpConn) connect(clientAddr netip.AddrPort) *net.TCPConn {
	p := c.p
	dst := tcpOriginalDst(c.client)
	reset := false
	for attempt, timeout := range p.timeouts {
		target, err := p.Chooser.Choose(clientAddr, dst, reset)
		if err != nil {
			p.Log.Debug().Err(err).Stringer("client", clientAddr).Stringer("dst", dst).
				Msg("no endpoint; resetting the client")
			return nil
		}
		ep := target.Endpoint
		if !c.setEndpoint(ep) {
			return nil // cut
		}
		backend, err := c.dial(target, clientAddr, timeout)
		if err == nil {
			if !c.setBackend(backend) {
				resetConn(backend)
				return nil
			}
			if target.ProxyProtocol != ProxyProtocolNone && !c.sendProxyHeader(backend, target.ProxyProtocol, clientAddr, dst) {
				resetConn(backend)
				return nil
			}
			return backend
		}
		p.metrics.DialFailed(ep)
		switch {
		case c.ctx.Err() != nil:
			return nil // cut while dialling
		case isResourceExhausted(err):
			// Our own shortage, not the endpoint's fault: another endpoint will not help.
			p.Log.Warn().Err(err).Stringer("client", clientAddr).Stringer("endpoint", ep).
				Msg("cannot create a socket to the endpoint; closing the client")
			return nil
		}
		p.Log.Debug().Err(err).Stringer("client", clientAddr).Stringer("endpoint", ep).
			Int("attempt", attempt+1).Dur("timeout", timeout).Msg("dial endpoint failed")
		reset = true
	}
	p.Log.Warn().Stringer("client", clientAddr).Stringer("dst", dst).Int("attempts", len(p.timeouts)).
		Msg("no endpoint could be reached; resetting the client")
	return nil
}

// dial connects to target's endpoint within timeout, from the client's address when the target
// asks for it and that is possible. A transparent dial refused for lack of privilege or by the
// bind falls back to a plain one, with a warning.
func (c *tcpConn) dial(target Target, client netip.AddrPort, timeout time.Duration) (*net.TCPConn, error) {
	ep := target.Endpoint
	if !target.Transparent || !canDialFrom(client.Addr(), ep) {
		return dialTCP(c.ctx, newDialer(timeout), ep)
	}
	d := transparentDialer(client.Addr())
	d.Timeout, d.KeepAliveConfig = timeout, endpointKeepAlive
	conn, err := dialTCP(c.ctx, d, ep)
	if err == nil || !isTransparentSetupError(err) {
		return conn, err
	}
	logTransparentFallback(c.p.Log, &c.p.transparentWarned, err, client, ep)
	return dialTCP(c.ctx, newDialer(timeout), ep)
}

// dialTCP connects to ep with d (or until ctx ends); d's other options are Go's defaults.
func dialTCP(ctx context.Context, d net.Dialer, ep netip.AddrPort) (*net.TCPConn, error) {
	network := "tcp4"
	if !ep.Addr().Unmap().Is4() {
		network = "tcp6"
	}
	conn, err := d.DialContext(ctx, network, ep.String())
	if err != nil {
		return nil, err
	}
	return conn.(*net.TCPConn), nil
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
		c.p.Log.Debug().Err(err).Stringer("client", client).Stringer("endpoint", c.endpointNow()).
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

// copyResult is the outcome of one direction of a connection.
type copyResult struct {
	n   int64
	err error
}

// copyToEndpoint copies client→endpoint until the client's EOF, then half-closes the endpoint.
func (c *tcpConn) copyToEndpoint() {
	c.toEndpoint = c.pump(c.backend0, c.client)
	c.copyDone()
}

// copyToClient copies endpoint→client until the endpoint's EOF, then half-closes the client.
func (c *tcpConn) copyToClient() {
	c.fromEndpoint = c.pump(c.client, c.backend0)
	c.copyDone()
}

// copyDone is called by each direction when it ends; the second call finishes the connection.
func (c *tcpConn) copyDone() {
	if c.copying.Add(-1) == 0 {
		c.finish(c.backend0, c.toEndpoint, c.fromEndpoint)
	}
}

// pump copies src to dst and passes src's EOF on to dst with CloseWrite. The bytes move with
// splice(2) through a pipe taken from the proxy's pool only while data flows (see spliceCopy):
// no user-space copy, and no pipe held by an idle connection. On an error in either direction
// both sockets are reset, which also ends the other direction.
func (c *tcpConn) pump(dst, src *net.TCPConn) copyResult {
	n, err := spliceCopy(&c.p.pipes, dst, src)
	if err == nil {
		err = dst.CloseWrite()
	}
	if err != nil {
		c.p.mu.Lock()
		c.resetBothLocked()
		c.p.mu.Unlock()
	}
	return copyResult{n: n, err: err}
}

// cutLocked ends the connection on the proxy's behalf: it cancels a dial in progress and resets
// both sides.
func (c *tcpConn) cutLocked() {
	if c.cut {
		return
	}
	c.cut = true
	c.cancel()
	c.resetBothLocked()
}

func (c *tcpConn) resetBothLocked() {
	resetConn(c.client)
	if c.backend != nil {
		resetConn(c.backend)
	}
}

// resetConn closes conn with an RST instead of a FIN (SO_LINGER with a zero timeout), dropping
// unsent data. Closing an already closed conn does nothing.
func resetConn(conn *net.TCPConn) {
	_ = conn.SetLinger(0)
	_ = conn.Close()
}

func (p *TCPProxy) forget(c *tcpConn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}
