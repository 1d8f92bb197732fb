package tcp

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
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/backpressure"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/sys"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/proxyproto"
)

// tcpRelay is the portable TCP engine of a Proxy, for systems without the event loops
// (relay_other.go selects it; on Linux its tests run it too): one goroutine accepts, and each
// connection has one goroutine that dials and then two named copiers, io.Copy each way. It
// follows the proxy's connection policy (policy.go) as the loops do: admission within MaxConns
// and the Budget, Choose, failover through DialTimeouts, the PROXY header, IdleTimeout. It has
// no splice, no hand-over and no transparent dialing (Target.Transparent is ignored), and knows
// no original destination (Choose gets the zero AddrPort; a PROXY header names the address the
// client reached).
type tcpRelay struct {
	p *Proxy

	ctx    context.Context // ended by cut: dials in progress stop
	cancel context.CancelFunc
	stop   chan struct{} // closed by close: a paused accept loop stops waiting

	mu      sync.Mutex // guards the following fields
	closed  bool
	serving bool          // serve was called
	done    chan struct{} // closed when serve returns
	live    map[*relayConn]struct{}
}

// The relay's connections are counted in p.connWG, which Shutdown waits for (Proxy.drain): off
// Linux, Shutdown closes the relay (loopListenerCloser) and, at the end of its grace period,
// cuts the relay's connections (cutLoopConns).

// relayConn is one connection of a tcpRelay; its goroutine (handle) owns it, cut may reset it.
type relayConn struct {
	client   net.Conn
	mu       sync.Mutex // guards backend and cut
	backend  net.Conn
	cut      bool
	lastRead atomic.Int64 // time.Now().UnixNano() of the last byte read either way
}

// newTCPRelay returns the relay of p and sets p.relay.
func newTCPRelay(p *Proxy) *tcpRelay {
	ctx, cancel := context.WithCancel(context.Background())
	p.relay = &tcpRelay{p: p, ctx: ctx, cancel: cancel, stop: make(chan struct{}), done: make(chan struct{}),
		live: map[*relayConn]struct{}{}}
	return p.relay
}

// serve accepts connections until close; nil after close, else the accept error that stopped it.
func (r *tcpRelay) serve() error {
	r.mu.Lock()
	if r.serving {
		r.mu.Unlock()
		return errors.New("serve TCP proxy: Serve called twice")
	}
	r.serving = true
	closed := r.closed
	r.mu.Unlock()
	defer close(r.done)
	if closed {
		return nil
	}
	p := r.p
	var pause backpressure.Pause
	for {
		c, err := p.Listener.Accept()
		if err != nil {
			switch {
			case r.isClosed():
				return nil
			case backpressure.IsResourceExhausted(err):
				d := pause.Next()
				if h := p.testHookAcceptPause; h != nil {
					h(pause.Attempts, d)
				}
				if !backpressure.SleepUnlessStopped(d, r.stop) {
					return nil
				}
				continue
			case isPendingConnError(err):
				p.logDebug().Err(err).Msg("accept: connection failed before it was accepted")
				continue
			}
			err = fmt.Errorf("accept on %s: %w", p.Listener.Addr(), err)
			p.logError().Err(err).Msg("TCP proxy stopped")
			return err
		}
		if pause.Attempts > 0 {
			p.logInfo().Int("retries", pause.Attempts).Dur("paused", time.Since(pause.Start)).
				Msg("accepting connections again")
			pause = backpressure.Pause{}
		}
		rc := &relayConn{client: c}
		if !r.admit(rc) {
			p.refused()
			resetNetConn(c)
			continue
		}
		p.sink().ConnAccepted()
		go r.handle(rc)
	}
}

// admit takes rc in as a live connection within the policy's limits; false when it is refused
// (or the relay closed).
func (r *tcpRelay) admit(rc *relayConn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed || !r.p.admitLocked(len(r.live)) {
		return false
	}
	r.live[rc] = struct{}{}
	r.p.connWG.Add(1)
	return true
}

func (r *tcpRelay) isClosed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.closed
}

// close stops accepting (closes the Listener) and waits for serve to return; connections go on.
func (r *tcpRelay) close() error {
	r.mu.Lock()
	first, serving := !r.closed, r.serving
	r.closed = true
	r.mu.Unlock()
	var err error
	if first {
		close(r.stop)
		if cerr := r.p.Listener.Close(); cerr != nil && !errors.Is(cerr, net.ErrClosed) {
			err = fmt.Errorf("close TCP proxy listener: %w", cerr)
		}
	}
	if serving {
		<-r.done
	}
	return err
}

// cut resets every live connection and stops dials; it returns how many there were.
func (r *tcpRelay) cut() int {
	r.cancel()
	r.mu.Lock()
	defer r.mu.Unlock()
	for rc := range r.live {
		rc.mu.Lock()
		rc.cut = true
		resetNetConn(rc.client)
		if rc.backend != nil {
			resetNetConn(rc.backend)
		}
		rc.mu.Unlock()
	}
	return len(r.live)
}

// handle is one connection, in order: choose and dial (failing over), the PROXY header, the two
// copiers, the end.
func (r *tcpRelay) handle(rc *relayConn) {
	p := r.p
	client := netAddrPort(rc.client.RemoteAddr())
	var endpoint netip.AddrPort
	var n [2]int64
	connected := false
	var err error
	defer func() {
		r.mu.Lock()
		delete(r.live, rc)
		r.mu.Unlock()
		p.Budget.Give(tcpConnFDs)
		p.connEnded(connected, client, endpoint, n[0], n[1], err)
		r.p.connWG.Done()
	}()
	var backend net.Conn
	var target forward.Target
	backend, target, err = r.dial(client)
	if err != nil {
		resetNetConn(rc.client)
		return
	}
	endpoint = target.Endpoint
	rc.mu.Lock()
	if rc.cut {
		rc.mu.Unlock()
		resetNetConn(backend)
		err = errCutRelay
		return
	}
	rc.backend = backend
	rc.mu.Unlock()
	connected = true
	if target.ProxyProtocol != proxyproto.None {
		var hdr []byte
		hdr, err = p.proxyHeader(target.ProxyProtocol, client, endpoint, netip.AddrPort{}, netAddrPort(rc.client.LocalAddr()))
		if err == nil {
			_, err = backend.Write(hdr)
		}
		if err != nil {
			resetNetConn(rc.client)
			resetNetConn(backend)
			return
		}
	}
	rc.lastRead.Store(time.Now().UnixNano())
	errs := make(chan error, 2)
	go r.copyToEndpoint(rc, backend, &n[0], errs)
	go r.copyFromEndpoint(rc, backend, &n[1], errs)
	for range 2 {
		if e := <-errs; e != nil && err == nil {
			err = e
			resetNetConn(rc.client) // the other copier ends too
			resetNetConn(backend)
		}
	}
	if err == nil {
		_ = rc.client.Close()
		_ = backend.Close()
	}
}

// errCutRelay is the reason of connections cut by shutdown.
var errCutRelay = errors.New("cut by shutdown")

// dial chooses an endpoint and connects to it, failing over to the next choice with the next
// timeout.
func (r *tcpRelay) dial(client netip.AddrPort) (net.Conn, forward.Target, error) {
	p := r.p
	var plan dialPlan
	dst := netip.AddrPort{} // unknown: no conntrack here
	for {
		timeout, ok := plan.next(p)
		if !ok {
			return nil, forward.Target{}, p.unreachable(&plan, client, dst)
		}
		target, err := p.choose(&plan, client, dst)
		if err != nil {
			return nil, forward.Target{}, err
		}
		d := net.Dialer{Timeout: timeout}
		ep := netip.AddrPortFrom(target.Endpoint.Addr().Unmap(), target.Endpoint.Port())
		c, err := d.DialContext(r.ctx, "tcp", ep.String())
		if err == nil {
			return c, target, nil
		}
		if r.ctx.Err() != nil {
			return nil, forward.Target{}, errCutRelay
		}
		if backpressure.IsResourceExhausted(err) {
			p.socketFailed(client, target.Endpoint, err)
			return nil, forward.Target{}, err
		}
		p.attemptFailed(&plan, client, target.Endpoint, err)
	}
}

// copyToEndpoint and copyFromEndpoint are a connection's two copiers (named so that stack dumps
// read well): each copies until its source's EOF, which it passes on as a half-close.
func (r *tcpRelay) copyToEndpoint(rc *relayConn, backend net.Conn, n *int64, errs chan<- error) {
	errs <- r.copyHalf(rc, backend, rc.client, n)
}

func (r *tcpRelay) copyFromEndpoint(rc *relayConn, backend net.Conn, n *int64, errs chan<- error) {
	errs <- r.copyHalf(rc, rc.client, backend, n)
}

// copyHalf copies src to dst until src's EOF, then shuts down dst's sending side. With an
// IdleTimeout it fails with errIdle once no byte was read either way for that long.
func (r *tcpRelay) copyHalf(rc *relayConn, dst, src net.Conn, n *int64) error {
	var err error
	*n, err = io.Copy(dst, idleReader{rc: rc, c: src, idle: r.p.IdleTimeout})
	if err != nil {
		return err
	}
	if cw, ok := dst.(interface{ CloseWrite() error }); ok {
		if err := cw.CloseWrite(); err != nil {
			return fmt.Errorf("pass on EOF: %w", err)
		}
	}
	return nil
}

// idleReader reads from c; with idle > 0 a read fails with errIdle once neither direction of rc
// has read a byte for idle. As a plain io.Reader it also keeps io.Copy from splicing.
type idleReader struct {
	rc   *relayConn
	c    net.Conn
	idle time.Duration
}

func (ir idleReader) Read(b []byte) (int, error) {
	for {
		if ir.idle > 0 {
			_ = ir.c.SetReadDeadline(time.Now().Add(ir.idle))
		}
		n, err := ir.c.Read(b)
		if n > 0 {
			ir.rc.lastRead.Store(time.Now().UnixNano())
		}
		if err != nil && ir.idle > 0 && errors.Is(err, os.ErrDeadlineExceeded) {
			if time.Since(time.Unix(0, ir.rc.lastRead.Load())) < ir.idle {
				continue // the other direction moved: not idle
			}
			return n, errIdle
		}
		return n, err
	}
}

// resetNetConn closes c with a reset (SO_LINGER 0) where it is a TCP connection.
func resetNetConn(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
}

// netAddrPort returns a TCP or UDP address as an AddrPort (unmapped); the zero one for another.
func netAddrPort(a net.Addr) netip.AddrPort {
	switch a := a.(type) {
	case *net.TCPAddr:
		return sys.UnmapAddrPort(a.AddrPort())
	case *net.UDPAddr:
		return sys.UnmapAddrPort(a.AddrPort())
	}
	return netip.AddrPort{}
}
