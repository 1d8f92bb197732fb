package tcp

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/runstate"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/sys"
	"golang.org/x/sys/unix"
)

// The Proxy side of the event-loop data path (see loop_linux.go): placing a proxy on a
// loop, admission, Close and Shutdown, and the hand-over of loop connections.

// loopProxy is a Proxy's state on the loops; p.mu guards it.
//
// The listener is attached to each of the proxy's loops (loopsPerPort of them), and each
// accepts for itself: a busy port's connections spread over them (and over processors) with no
// hand-off between loops. A connection stays on the loop that accepted it, also across a freeze
// and thaw; adopted ones go on the proxy's home loop, l.
type loopProxy struct {
	l      *loop
	set    []*loop         // the proxy's loops, l first
	lns    []*loopListener // by loop of set: the listener, while attached there
	holds  int             // attached listeners, and startOnLoop while it attaches: the last to go ends Serve
	live   int             // connections admitted on the loops, not yet ended or released
	frozen []*lconn        // connections stopped by Freeze, until Release or Thaw
	err    error           // the accept error that stopped the listener, for Serve
	dials  *freezeWait     // the dials a Freeze waits for
	// resuming counts the connections that Thaw and Adopt handed to a loop (posted) and that
	// are not back on it yet: they are on no loop's descriptors, where Freeze and Shutdown look
	// for them, so those wait until resumed is closed (when resuming drops to 0; nil while 0).
	resuming int
	resumed  chan struct{}
}

// errCut is the reason of connections cut by Shutdown.
var errCut = errors.New("cut by shutdown")

// loopState returns the proxy's loop state, placing the proxy on a loop at its first use.
func (p *Proxy) loopState() *loopProxy {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.onLoop == nil {
		set := p.Loops.pick()
		p.onLoop = &loopProxy{l: set[0], set: set, lns: make([]*loopListener, len(set))}
	}
	return p.onLoop
}

// connCountLocked is how many connections count toward MaxConns; p.mu must be held.
func (p *Proxy) connCountLocked() int {
	if p.onLoop == nil {
		return 0
	}
	return p.onLoop.live
}

// admitLoopConn admits a connection accepted on the loop as startConn admits one: within
// MaxConns and the Budget.
func (p *Proxy) admitLoopConn() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.admitLocked(p.connCountLocked()) {
		return false
	}
	p.onLoop.live++
	p.connWG.Add(1)
	return true
}

// loopConnEnded forgets a loop connection that ended: its descriptors go back to the Budget and
// Shutdown hears of it.
func (p *Proxy) loopConnEnded() {
	p.Budget.Give(tcpConnFDs)
	p.mu.Lock()
	p.onLoop.live--
	p.mu.Unlock()
	p.connWG.Done()
}

// serveOnLoop is Serve with Loops: the listener is served by its loop, and Serve waits until
// Close, Freeze or an accept error takes it off.
func (p *Proxy) serveOnLoop() error {
	started, err := p.startOnLoop()
	if !started {
		return err
	}
	done := p.run.Done()
	if done != nil {
		<-done
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.onLoop.err
}

// startOnLoop attaches the listener to each of the proxy's loops; started is false when the
// proxy was closed first or an attach failed (err: what was attached is let go). It does not
// wake the loops (see withTurn): a proxier starting thousands of listeners pays an epoll_ctl
// per listener and loop.
func (p *Proxy) startOnLoop() (started bool, err error) {
	ok, err := p.run.Start("TCP proxy")
	if !ok {
		return false, err
	}
	if h := p.testHookLoopStarting; h != nil {
		h()
	}
	fd, err := sys.FD(p.Listener)
	if err != nil {
		p.run.Ended()
		if closed, _ := p.run.Status(); closed {
			return false, nil // Close came between start and here (and closed the listener): as Serve after Close
		}
		return false, fmt.Errorf("start TCP proxy on %s: %w", p.Listener.Addr(), err)
	}
	lp := p.loopState()
	p.mu.Lock()
	lp.holds++ // this start's: released below, after every attach
	p.mu.Unlock()
	attached := false
	var aerr error
	for i, l := range lp.set {
		ln := &loopListener{p: p, fd: fd}
		ok := false
		l.withTurn(func() { ok, aerr = p.attachInTurn(lp, i, l, ln) })
		attached = attached || ok
		if !ok {
			break // closed, frozen or failed: the loops attached so far were or will be let go
		}
	}
	if aerr != nil {
		p.detachFromLoop()
	}
	p.listenerOff()
	if aerr != nil {
		return false, fmt.Errorf("start TCP proxy on %s: %w", p.Listener.Addr(), aerr)
	}
	return attached, nil
}

// attachInTurn attaches ln to loop l (the i-th) during a turn of l's, unless Close or Freeze
// came since start (their detach, in a turn too, found nothing there: the proxy then ends
// once what was attached is let go, as Serve after Close does).
func (p *Proxy) attachInTurn(lp *loopProxy, i int, l *loop, ln *loopListener) (attached bool, err error) {
	if l.isStopped() {
		return false, errors.New("the event loops are closed")
	}
	if closed, frozen := p.run.Status(); closed || frozen {
		return false, nil
	}
	if err := l.attach(ln); err != nil {
		return false, err
	}
	p.mu.Lock()
	lp.lns[i], lp.err = ln, nil
	lp.holds++
	p.mu.Unlock()
	return true, nil
}

// listenerOff lets go of one hold on the proxy's Serve (an attached listener detached, or
// startOnLoop done attaching); the last ends it.
func (p *Proxy) listenerOff() {
	p.mu.Lock()
	p.onLoop.holds--
	last := p.onLoop.holds == 0
	p.mu.Unlock()
	if last {
		p.run.Ended()
	}
}

// detachFromLoop takes the listener off every loop, leaving it open (Close closes it after,
// Freeze exports it). It does not wake the loops (see withTurn).
func (p *Proxy) detachFromLoop() {
	p.mu.Lock()
	lp := p.onLoop
	p.mu.Unlock()
	if lp == nil {
		return
	}
	for i, l := range lp.set {
		l.withTurn(func() {
			p.mu.Lock()
			ln := lp.lns[i]
			lp.lns[i] = nil
			p.mu.Unlock()
			if ln != nil {
				l.detach(ln)
			}
		})
	}
}

// loopListenerCloser closes a loop proxy's listener: off the loop first, as its descriptor's
// number may be reused once closed.
type loopListenerCloser struct{ p *Proxy }

func (c loopListenerCloser) Close() error {
	c.p.detachFromLoop()
	return c.p.Listener.Close()
}

// loopConns returns the proxy's live connections on l; loop goroutine only.
func (l *loop) connsOf(p *Proxy) []*lconn {
	var out []*lconn
	for i := range l.fds {
		if s := l.fds[i]; s.c != nil && s.side == 0 && s.c.p == p && !s.c.closed {
			out = append(out, s.c)
		}
	}
	return out
}

// cutLoopConns resets every connection of the proxy on the loops and returns how many.
func (p *Proxy) cutLoopConns() int {
	if p.loopIdle() {
		return 0
	}
	p.awaitResumes() // a closed proxy adopts no more, nor thaws
	n := 0
	p.eachLoopConn(func(l *loop, c *lconn) {
		l.finish(c, true, errCut)
		n++
	})
	return n
}

// eachLoopConn calls fn with each of the proxy's live connections during a turn of the loop
// that holds it, visiting its loops one after another. The proxy must be placed (onLoop does
// not change then); fn may take p.mu.
func (p *Proxy) eachLoopConn(fn func(l *loop, c *lconn)) {
	for _, l := range p.onLoop.set {
		l.withTurn(func() {
			for _, c := range l.connsOf(p) {
				fn(l, c)
			}
		})
	}
}

// freezeLoopConns stops every connection of the proxy on its loop where it stands (the loop
// is one goroutine: nothing is half done) and keeps them for export, Release or Thaw.
// Connections still dialling finish their dial first (successful or not) unless ctx ends, which
// abandons the dials: those are exported undialled and their adopter dials. The bytes moved so
// far are reported now.
func (p *Proxy) freezeLoopConns(ctx context.Context) {
	if p.loopIdle() {
		return
	}
	lp := p.onLoop
	// Connections that a Thaw or Adopt just handed to their loops are not there yet: the loops
	// put them back first (nothing adds more: the proxy is frozen, and Adopt refuses).
	p.awaitResumes()
	// The wait holds one count itself until every loop has been visited, so that a dial that
	// ends on one loop while another is visited cannot end it early.
	w := &freezeWait{left: 1, done: make(chan struct{})}
	p.mu.Lock()
	lp.dials = w
	p.mu.Unlock()
	p.eachLoopConn(func(l *loop, c *lconn) {
		if c.connected {
			l.freeze(c)
			return
		}
		c.freezing = true
		p.mu.Lock()
		w.left++
		p.mu.Unlock()
	})
	p.dialFrozen(w)
	select {
	case <-w.done:
	case <-ctx.Done():
		p.eachLoopConn(func(l *loop, c *lconn) {
			if c.freezing {
				l.freeze(c)
			}
		})
	}
}

// dialFrozen counts one of w's dials as ended.
func (p *Proxy) dialFrozen(w *freezeWait) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if w.left--; w.left == 0 {
		close(w.done)
		if p.onLoop.dials == w {
			p.onLoop.dials = nil
		}
	}
}

// resumingLocked counts n connections handed to their loops by Thaw or Adopt (see
// loopProxy.resuming); p.mu must be held.
func (lp *loopProxy) resumingLocked(n int) {
	if lp.resuming == 0 {
		lp.resumed = make(chan struct{})
	}
	lp.resuming += n
}

// resumedOnLoop counts n connections of those as back on their loop (or ended).
func (p *Proxy) resumedOnLoop(n int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	lp := p.onLoop
	if lp.resuming -= n; lp.resuming == 0 {
		close(lp.resumed)
		lp.resumed = nil
	}
}

// awaitResumes returns once every connection that Thaw or Adopt handed to a loop is on it (or
// ended): the loops run what is posted to them in order, promptly. The caller holds neither
// p.mu nor a loop's turn.
func (p *Proxy) awaitResumes() {
	p.mu.Lock()
	resumed := p.onLoop.resumed
	p.mu.Unlock()
	if resumed != nil {
		<-resumed
	}
}

// loopIdle reports whether the proxy has no connection on the loops: most service ports of a
// large cluster have none, and a Freeze or Shutdown of all of them then costs no round trip to
// the loops. (Once placed, onLoop does not change.)
func (p *Proxy) loopIdle() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.onLoop == nil || p.onLoop.live == 0
}

// freezeWait counts the dials a freeze waits for; its proxy's p.mu guards it.
type freezeWait struct {
	left int
	done chan struct{}
}

// freeze takes c off the loop, its sockets open, and adds it to its proxy's frozen connections.
func (l *loop) freeze(c *lconn) {
	p := c.p
	l.unregister(c, 0)
	l.unregister(c, 1)
	if c.connecting {
		_ = unix.Close(int(c.fd[1]))
		c.fd[1], c.connecting = -1, false
		l.dialEnded()
	}
	l.dropDial(c) // its sweep must not time out a dial it no longer has
	if !c.connected {
		c.endpoint, c.dl = netip.AddrPort{}, nil
		c.dir[0].pending = nil // a PROXY header not sent: the adopter sends its own
	}
	l.uncountTimed(c)
	for d := range 2 {
		if err := l.unsplice(c, d); err != nil { // the bytes are lost: the connection cannot go on
			p.logWarn().Err(err).Stringer("client", c.clientAddr).Msg("freeze: connection reset")
			c.freezing = false
			l.finish(c, true, err)
			return
		}
	}
	c.closed = true
	if c.connected {
		p.sink().BytesCopied(c.n[0], c.n[1])
		c.n = [2]int64{}
	}
	p.mu.Lock()
	lp := p.onLoop
	lp.frozen = append(lp.frozen, c)
	w := lp.dials
	p.mu.Unlock()
	if c.freezing {
		c.freezing = false
		if w != nil {
			p.dialFrozen(w)
		}
	}
	p.connWG.Done() // Thaw counts it again
}

// exportLoopConns appends duplicates of the frozen loop connections to st.
func (p *Proxy) exportLoopConns(st *forward.TCPState) error {
	p.mu.Lock()
	var frozen []*lconn
	if p.onLoop != nil {
		frozen = p.onLoop.frozen
	}
	p.mu.Unlock()
	for _, c := range frozen {
		cs, err := c.export()
		if err != nil {
			return fmt.Errorf("connection from %s: %w", c.clientAddr, err)
		}
		st.Conns = append(st.Conns, cs)
	}
	return nil
}

// export duplicates a frozen loop connection's sockets, with copies of its pending bytes.
func (c *lconn) export() (forward.TCPConnState, error) {
	cs := forward.TCPConnState{ClientAddr: c.clientAddr,
		ToEndpoint: cloneBytes(c.dir[0].pending), ToClient: cloneBytes(c.dir[1].pending),
		ToEndpointDone: c.dir[0].shut, ToClientDone: c.dir[1].shut}
	var err error
	if cs.Client, err = sys.DupFile(int(c.fd[0]), "client"); err != nil {
		return forward.TCPConnState{}, err
	}
	if c.fd[1] >= 0 {
		cs.Endpoint = c.endpoint
		if cs.Backend, err = sys.DupFile(int(c.fd[1]), "endpoint"); err != nil {
			_ = cs.Close()
			return forward.TCPConnState{}, err
		}
	}
	return cs, nil
}

func cloneBytes(b []byte) []byte {
	if len(b) == 0 {
		return nil
	}
	return append([]byte(nil), b...)
}

// releaseLoopConns closes the frozen loop connections' own descriptors (no FIN, no RST: the
// exported duplicates keep the sockets) and reports each released.
func (p *Proxy) releaseLoopConns() {
	p.mu.Lock()
	var frozen []*lconn
	if lp := p.onLoop; lp != nil {
		frozen, lp.frozen = lp.frozen, nil
		lp.live -= len(frozen)
	}
	p.mu.Unlock()
	hm, _ := p.sink().(forward.HandoverMetrics)
	for _, c := range frozen {
		for _, fd := range c.fd {
			if fd >= 0 {
				_ = unix.Close(int(fd))
			}
		}
		p.Budget.Give(tcpConnFDs)
		if hm != nil {
			hm.ConnReleased()
		}
	}
}

// thawLoopConns puts the frozen loop connections back on their loops.
func (p *Proxy) thawLoopConns() {
	p.mu.Lock()
	var frozen []*lconn
	var lp *loopProxy
	if lp = p.onLoop; lp != nil {
		frozen, lp.frozen = lp.frozen, nil
		if len(frozen) > 0 {
			lp.resumingLocked(len(frozen))
		}
	}
	p.mu.Unlock()
	if len(frozen) == 0 {
		return
	}
	p.connWG.Add(len(frozen))
	// Each goes back to the loop that owns it (see lconn).
	byLoop := map[*loop][]*lconn{}
	for _, c := range frozen {
		byLoop[c.l] = append(byLoop[c.l], c)
	}
	for l, cs := range byLoop {
		if l.post(func() {
			for _, c := range cs {
				c.closed = false
				l.resume(c)
			}
			p.resumedOnLoop(len(cs))
		}) {
			continue
		}
		for _, c := range cs {
			c.closed = false
			c.connected = false
			l.finish(c, true, errors.New("the event loops are closed"))
		}
		p.resumedOnLoop(len(cs))
	}
}

// resume puts a connection (thawed or adopted) on the loop: both sockets watched again (the
// registration reports what is already readable), and dialled afresh when it has no endpoint.
func (l *loop) resume(c *lconn) {
	c.last = l.now
	for side := range 2 {
		if c.fd[side] < 0 {
			continue
		}
		if err := l.register(c, side); err != nil {
			l.finish(c, true, err)
			return
		}
	}
	l.countTimed(c)
	if c.fd[1] < 0 {
		l.dial(c)
		return
	}
	c.connected = true
	l.pump(c)
}

// adoptOnLoop is adoptConn with Loops: the connection goes on the proxy's home loop.
func (p *Proxy) adoptOnLoop(cs forward.TCPConnState) error {
	cfd, err := connFDFromFile(cs.Client, "client")
	if err != nil {
		_ = forward.TCPConnState{Backend: cs.Backend}.Close()
		return err
	}
	bfd := -1
	switch {
	case cs.Backend != nil:
		if bfd, err = connFDFromFile(cs.Backend, "endpoint"); err != nil {
			_ = unix.Close(cfd)
			return err
		}
	case p.Chooser == nil:
		_ = unix.Close(cfd)
		return errors.New("an undialled connection needs the Chooser")
	}
	lp := p.loopState()
	c := &lconn{p: p, l: lp.l, fd: [2]int32{int32(cfd), int32(bfd)}, clientAddr: cs.ClientAddr}
	if !c.clientAddr.IsValid() {
		c.clientAddr = fdPeerAddr(cfd)
	}
	if bfd >= 0 {
		c.endpoint = cs.Endpoint
		c.dir[0] = ldir{pending: cs.ToEndpoint, eof: cs.ToEndpointDone, shut: cs.ToEndpointDone}
		c.dir[1] = ldir{pending: cs.ToClient, eof: cs.ToClientDone, shut: cs.ToClientDone}
	}
	if err := p.admitAdoptedOnLoop(lp); err != nil {
		closeFDs(cfd, bfd)
		return err
	}
	p.sink().ConnAccepted()
	if !lp.l.post(func() { lp.l.served.Add(1); lp.l.resume(c); p.resumedOnLoop(1) }) {
		lp.l.finish(c, true, errors.New("the event loops are closed"))
		p.resumedOnLoop(1)
		return errors.New("the event loops are closed")
	}
	return nil
}

// admitAdoptedOnLoop counts an adopted connection, even above the Budget's limit.
func (p *Proxy) admitAdoptedOnLoop(lp *loopProxy) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if closed, frozen := p.run.Status(); closed || frozen || p.freezing {
		return runstate.Err(closed, true)
	}
	lp.live++
	lp.resumingLocked(1)
	p.Budget.Force(tcpConnFDs)
	p.connWG.Add(1)
	return nil
}

func closeFDs(fds ...int) {
	for _, fd := range fds {
		if fd >= 0 {
			_ = unix.Close(fd)
		}
	}
}

// fdPeerAddr returns a socket's peer address (unmapped), or the zero AddrPort.
func fdPeerAddr(fd int) netip.AddrPort {
	sa, err := unix.Getpeername(fd)
	if err != nil {
		return netip.AddrPort{}
	}
	return sys.SockaddrAddrPort(sa)
}

// connFDFromFile is sys.FDFromFile for a connected TCP socket, or one whose connection has ended
// since it was frozen (see endedSocket).
func connFDFromFile(f *os.File, what string) (int, error) {
	fd, err := sys.FDFromFile(f, what)
	if err != nil {
		return -1, err
	}
	if fdPeerAddr(fd).IsValid() || endedSocket(fd) {
		return fd, nil
	}
	_ = unix.Close(fd)
	return -1, fmt.Errorf("%s socket is not a connected TCP socket", what)
}
