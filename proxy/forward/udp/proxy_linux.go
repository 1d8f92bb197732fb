package udp

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/backpressure"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/ctnetlink"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/logscope"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/sys"
	"golang.org/x/sys/unix"
)

// Serve reads datagrams from Conn and forwards them until Close. It returns nil after Close, or
// an error if reading fails for a reason other than a shortage of memory (which pauses
// reading). It may be called once.
func (p *Proxy) Serve() error {
	if p.Conn == nil || p.Chooser == nil {
		return errors.New("serve UDP proxy: Conn and Chooser are required")
	}
	ok, err := p.run.Start("UDP proxy")
	if !ok {
		return err
	}
	p.prepare()
	defer p.run.Ended()
	ct := p.openOrigDst()
	if ct != nil {
		defer ct.Close()
	}
	return p.readLoop(ct, false)
}

// Start serves like Serve but returns at once, and holds no goroutine while no datagram arrives:
// its read loop runs on a goroutine of its own while datagrams arrive (a busy port's is restarted
// every second or so), and after half a second to a second without one it ends and has poller
// start it again when the next datagram is pending (see startParked). Sessions keep their own
// goroutines. Close and Freeze work as with Serve; an error of the read loop is logged. With a
// nil poller, or when the poller cannot watch Conn, the loop keeps its goroutine.
func (p *Proxy) Start(poller *Poller) error {
	if p.Conn == nil || p.Chooser == nil {
		return errors.New("start UDP proxy: Conn and Chooser are required")
	}
	ok, err := p.run.Start("UDP proxy")
	if !ok {
		return err
	}
	p.prepare()
	ct := p.openOrigDst()
	p.mu.Lock()
	p.startCT = ct
	p.mu.Unlock()
	startParked(&p.run, poller, p.Conn, &udpStartLoop{p, ct})
	return nil
}

// udpStartLoop is Start's loop (loopOwner): the read loop with Start's conntrack socket.
type udpStartLoop struct {
	*Proxy
	ct *ctnetlink.Conn
}

func (u *udpStartLoop) serveLoop(idle bool) error { return u.readLoop(u.ct, idle) }

// closeStartCT closes the conntrack socket of Start's loop, once the loop is over (Close, Freeze).
func (p *Proxy) closeStartCT() {
	p.mu.Lock()
	ct := p.startCT
	p.startCT = nil
	p.mu.Unlock()
	if ct != nil {
		ct.Close()
	}
}

// openOrigDst has Conn report the destinations of datagrams and opens the conntrack socket that
// finds the original destinations of new flows; nil when that is unavailable (logged).
func (p *Proxy) openOrigDst() *ctnetlink.Conn {
	if err := sys.EnableOrigDst(p.Conn); err != nil {
		p.logWarn().Err(err).Msg("destinations of datagrams unavailable: original destinations unknown, replies leave from the routing's choice of source")
		return nil
	}
	ct, err := ctnetlink.Open()
	if err != nil {
		p.logWarn().Err(err).Msg("conntrack unavailable: original destinations of UDP flows unknown")
		return nil
	}
	return ct
}

// prepare resolves the configuration once, for Serve and Adopt alike.
func (p *Proxy) prepare() {
	p.prepared.Do(func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		p.sessions = make(map[netip.AddrPort]*udpSession)
		p.metrics = p.sink()
		p.timeout = p.Timeout
		if p.timeout <= 0 {
			p.timeout = DefaultTimeout
		}
		p.epoch = time.Now()
		if p.Conn != nil {
			p.connRC, _ = p.Conn.SyscallConn() // fails only on a nil Conn
			p.growRcvBuf()
		}
	})
}

// udpConnRcvBuf is the receive buffer the service port's socket gets, in bytes as SO_RCVBUF
// reports them (the kernel doubles what is set, for its bookkeeping). It absorbs the datagrams
// that arrive while the read loop is not running (another thread has the core), which a
// default buffer (net.core.rmem_default, 208 KiB: ~90 datagrams of 1,400 bytes) drops. An
// empty buffer costs nothing; the datagrams it holds count against net.ipv4.udp_mem.
const udpConnRcvBuf = 4 << 20

// growRcvBuf gives Conn a receive buffer of udpConnRcvBuf unless it has one as large already:
// with SO_RCVBUFFORCE, which needs CAP_NET_ADMIN, else with SO_RCVBUF (up to net.core.rmem_max).
// A failure leaves the buffer as it was (logged at debug level).
func (p *Proxy) growRcvBuf() {
	var err error
	cerr := p.connRC.Control(func(fd uintptr) {
		cur, gerr := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF)
		if gerr == nil && cur >= udpConnRcvBuf {
			return
		}
		if err = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, udpConnRcvBuf/2); err != nil {
			err = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF, udpConnRcvBuf/2)
		}
	})
	if err = errors.Join(cerr, err); err != nil {
		p.logDebug().Err(err).Msg("cannot enlarge the receive buffer of the UDP proxy socket")
	}
}

// Close closes Conn, waits for Serve's loop to return, then ends every session and waits for
// their goroutines. Unlike TCP connections, sessions cannot outlive the proxy: their replies
// leave through Conn. Close may be called more than once, and before Serve. On a frozen proxy
// it is Release.
func (p *Proxy) Close() error {
	if _, frozen := p.run.Status(); frozen {
		p.Release()
		return nil
	}
	var sock io.Closer
	if p.Conn != nil {
		sock = p.Conn
	}
	_, err := p.run.Close(sock, "UDP proxy socket")
	p.closeStartCT()
	p.DropSessions(func(netip.AddrPort) bool { return false })
	p.sessionWG.Wait()
	return err
}

// DropSessions ends at once every session whose endpoint keep rejects and returns how many it
// ended. The next datagram from such a client opens a new session, to an endpoint Choose picks.
// Call it after each change of the service's endpoints.
func (p *Proxy) DropSessions(keep func(endpoint netip.AddrPort) bool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for client, s := range p.sessions {
		if !keep(s.endpoint) {
			delete(p.sessions, client)
			s.release() // its goroutine sees the close and finishes the session
			n++
		}
	}
	return n
}

// now is the monotonic time since Serve started, for session activity stamps.
func (p *Proxy) now() int64 { return int64(time.Since(p.epoch)) }

// readLoop is Serve's loop. It stays in one wait on Conn: each time Conn is readable it reads
// and forwards batches of datagrams until Conn is empty (readBatches), then waits again. ct is
// nil when conntrack cannot be asked.
func (p *Proxy) readLoop(ct *ctnetlink.Conn, idle bool) error {
	local := p.Conn.LocalAddr()
	stop := p.run.StopChan()
	var pause backpressure.Pause
	var deadline idleDeadline
	for {
		if idle && deadline.renew(&p.run, p.Conn.SetReadDeadline) {
			return nil
		}
		var rerr error
		err := p.connRC.Read(func(fd uintptr) bool {
			rerr = p.readBatches(int(fd), ct, stop, &pause)
			return rerr != nil
		})
		if err == nil {
			err = rerr
		}
		if p.run.Stopping() {
			return nil
		}
		if idle && errors.Is(err, os.ErrDeadlineExceeded) {
			return errLoopIdle
		}
		if backpressure.IsResourceExhausted(err) {
			if pause.Attempts == 0 {
				p.logWarn().Err(err).Msg("receive: out of memory; pausing")
			}
			if !backpressure.SleepUnlessStopped(pause.Next(), stop) {
				return nil
			}
			continue
		}
		return fmt.Errorf("read from UDP proxy socket %s: %w", local, err)
	}
}

// readBatches reads batches of datagrams from the service port's socket fd and forwards them,
// until the socket is empty (it returns nil: wait until it is readable) or reading fails.
//
// A batch shorter than udpBatchLen means that the socket was empty: the caller waits without
// the read that would find it so. A datagram arriving after that read wakes the wait.
func (p *Proxy) readBatches(fd int, ct *ctnetlink.Conn, stop <-chan struct{}, pause *backpressure.Pause) error {
	for {
		b, n, err := p.recvBatch(fd, true)
		if b == nil {
			return err // nil: the socket is empty
		}
		*pause = backpressure.Pause{}
		p.connStats.received(n)
		p.forwardBatch(ct, b, n)
		putUDPBatch(b)
		if n < len(b.in) || isClosed(stop) {
			return nil
		}
	}
}

// isClosed reports whether ch is closed.
func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// forwardBatch forwards the n datagrams received in b: each run of consecutive datagrams from
// one client goes to its session in one send.
func (p *Proxy) forwardBatch(ct *ctnetlink.Conn, b *udpBatch, n int) {
	for i := 0; i < n; {
		client := b.source(i)
		b.setOut(i, i, nil, nil)
		j := i + 1
		for ; j < n && b.source(j) == client; j++ {
			b.setOut(j, j, nil, nil)
		}
		p.forward(ct, b, i, j, client, sys.OrigDstFromOOB(b.control(i)))
		i = j
	}
}

// originalDst asks conntrack where the flow from client that reached the proxy at to was
// addressed before NAT. It returns the zero AddrPort when that is unknown or when the flow was
// not NATed.
func (p *Proxy) originalDst(ct *ctnetlink.Conn, client, to netip.AddrPort) netip.AddrPort {
	if ct == nil || !to.IsValid() {
		return netip.AddrPort{}
	}
	dst, err := ct.OriginalDst(unix.IPPROTO_UDP, client, to)
	if err != nil {
		if !errors.Is(err, unix.ENOENT) { // ENOENT: conntrack does not track the flow
			p.logDebug().Err(err).Stringer("client", client).Msg("conntrack lookup failed")
		}
		return netip.AddrPort{}
	}
	if dst = sys.UnmapAddrPort(dst); dst == to {
		return netip.AddrPort{}
	}
	return dst
}

// forward sends the datagrams of b's sends [from, to), all from client and received at dst,
// to the client's session, opening one if needed. A session found closed or refused is
// replaced; a datagram that two sessions failed to take is dropped.
func (p *Proxy) forward(ct *ctnetlink.Conn, b *udpBatch, from, to int, client, dst netip.AddrPort) {
	tries := 0
	for from < to {
		if tries == 2 {
			p.metrics.DatagramDropped()
			from, tries = from+1, 0
			continue
		}
		s := p.session(ct, client, dst)
		if s == nil {
			p.metrics.DatagramDropped()
			from, tries = from+1, 0
			continue
		}
		sent, err := 0, error(nil)
		if segmented := false; b.segmentable(from, to) {
			if segmented, err = b.sendSegmented(s.rc, from, to, &p.connStats); segmented && err == nil {
				sent = to - from
			}
			if !segmented {
				sent, err = b.sendOut(s.rc, from, to, &p.connStats)
			}
		} else {
			sent, err = b.sendOut(s.rc, from, to, &p.connStats)
		}
		s.toEndpoint.Add(b.outBytes(from, from+sent))
		if from += sent; sent > 0 {
			tries = 0
		}
		switch {
		case err == nil:
		case errors.Is(err, net.ErrClosed): // dropped or expired meanwhile: open a new session
			tries++
		case isUnreachable(err):
			// An earlier datagram drew an ICMP error: this one was not sent. Choose again.
			s.markRefused(err)
			tries++
		default:
			p.logDebug().Err(err).Stringer("client", client).Stringer("endpoint", s.endpoint).
				Msg("sending datagram to endpoint failed; dropped")
			p.metrics.DatagramDropped()
			from, tries = from+1, 0
		}
	}
}

// session returns client's live session, opening one if there is none or the current one was
// refused by its endpoint. It returns nil when no session could be opened. Only the read loop
// calls it, so sessions of one client are never opened concurrently.
func (p *Proxy) session(ct *ctnetlink.Conn, client, to netip.AddrPort) *udpSession {
	p.mu.Lock()
	s := p.sessions[client]
	if s != nil && !s.refused.Load() {
		s.lastActive.Store(p.now()) // under mu: expire sees either this stamp or no session
		p.mu.Unlock()
		return s
	}
	reset := s != nil
	if s != nil {
		delete(p.sessions, client)
		s.release()
	}
	p.mu.Unlock()

	clientAddr := sys.UnmapAddrPort(client)
	dst := p.originalDst(ct, client, to)
	target, backend, ok := p.dialSession(clientAddr, dst, reset, p.admitSession,
		func(t forward.Target) (*net.UDPConn, error) { return p.dialEndpoint(t, clientAddr) })
	if !ok {
		return nil
	}
	ep := target.Endpoint
	s = p.newSession(client, ep, backend, to.Addr())
	s.lastActive.Store(p.now())
	if p.run.Stopping() { // sessions are opened by the read loop only, which Close waits for
		s.release()
		return nil
	}
	p.mu.Lock()
	p.sessions[client] = s
	p.sessionWG.Add(1)
	p.mu.Unlock()
	p.sessionOpened(clientAddr, dst, ep, reset)
	go s.relayReplies()
	return s
}

// newSession returns the session of client to ep through backend, whose replies leave from
// replyFrom when valid.
func (p *Proxy) newSession(client, ep netip.AddrPort, backend *net.UDPConn, replyFrom netip.Addr) *udpSession {
	s := &udpSession{p: p, client: client, endpoint: ep, backend: backend, clientSA: sys.EncodeSockaddr(client)}
	s.rc, _ = backend.SyscallConn() // fails only on a nil conn
	if replyFrom.IsValid() {
		s.replyFrom, s.replyOOB = replyFrom, sys.SourceAddrOOB(replyFrom)
	}
	return s
}

// admitSession takes the descriptor of a new session, making room first when this port is at
// MaxSessions or the Budget is spent: it ends the port's longest-idle session. It reports false
// (and takes nothing) when there is no room to be made.
func (p *Proxy) admitSession() bool {
	return p.admitSessionWithin(func() int {
		p.mu.Lock()
		defer p.mu.Unlock()
		return len(p.sessions)
	}, p.evictIdlest)
}

// evictIdlest ends the session that has been idle longest and reports whether there was one.
// It scans the port's sessions: eviction happens only at a limit, and the limit bounds the scan.
func (p *Proxy) evictIdlest() bool {
	return evictIdlestOf(&p.mu, &p.sessions, func(s *udpSession) int64 { return s.lastActive.Load() },
		(*udpSession).release, p.metrics)
}

// release closes the session's socket and returns its descriptor to the budget, once.
func (s *udpSession) release() {
	if s.released.CompareAndSwap(false, true) {
		s.backend.Close()
		s.p.Budget.Give(udpSessionFDs)
	}
}

// dialEndpoint opens the session's socket to target's endpoint, from the client's address when
// the target asks for it and that is possible. A transparent socket refused for lack of
// privilege or by the bind falls back to a plain one, with a warning.
func (p *Proxy) dialEndpoint(target forward.Target, client netip.AddrPort) (*net.UDPConn, error) {
	ep := target.Endpoint
	if target.Transparent && sys.CanDialFrom(client.Addr(), ep) {
		c, err := sys.DialUDPFrom(client.Addr(), ep)
		if err == nil || !sys.IsTransparentSetupError(err) {
			return c, err
		}
		logscope.TransparentFallback(logscope.Logger(p.Log), p.LogScope, &p.transparentWarned, err, client, ep)
	}
	return net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(ep))
}

// markRefused records that the endpoint answered with an ICMP error (a connected UDP socket
// reports it on the next read or write), so that the next datagram chooses again.
func (s *udpSession) markRefused(err error) {
	if s.refused.CompareAndSwap(false, true) {
		s.p.flowRefused(s.client, s.endpoint, err)
	}
}

// relayReplies reads the endpoint's datagrams and sends them to the client from the proxy's
// socket, until the session is idle for the timeout or its socket is closed.
//
// While waiting it holds no buffer: it waits for the socket to be readable and takes a batch
// from the pool only to read the datagrams that are there, so idle sessions cost a socket and
// a goroutine, not 64 KiB each.
func (s *udpSession) relayReplies() {
	defer s.p.sessionWG.Done()
	if s.relay() {
		s.park()
		return
	}
	s.finish()
}

// relay is relayReplies' loop. It returns true when a freeze stopped it.
func (s *udpSession) relay() (frozen bool) {
	p := s.p
	if s.rc == nil {
		return false
	}
	var rerr error
	read := func(fd uintptr) bool {
		rerr = s.readReplies(int(fd))
		return rerr != nil
	}
	var deadline time.Time
	for {
		expiry := p.epoch.Add(time.Duration(s.lastActive.Load()) + p.timeout)
		if !time.Now().Before(expiry) {
			if s.expire() {
				return false
			}
			continue
		}
		// The deadline is set lazily: activity only moves the expiry later, so a deadline at an
		// older expiry is never too late; when it fires, the loop finds the new expiry and sets
		// that. Resetting the timer on every datagram would cost more than the datagram.
		if deadline.IsZero() {
			if err := s.backend.SetReadDeadline(expiry); err != nil {
				return false // closed
			}
			deadline = expiry
			if p.frozen.Load() {
				return true // this deadline may have replaced the freeze's
			}
		}
		if err := s.rc.Read(read); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				if p.frozen.Load() {
					return true
				}
				deadline = time.Time{}
				continue // check activity: the client may have kept the session alive
			}
			return false // closed: dropped, replaced, or the proxy is closing
		}
		switch {
		case isUnreachable(rerr):
			s.markRefused(rerr)
		case errors.Is(rerr, net.ErrClosed): // Conn: the proxy is closing
			return false
		default:
			p.logDebug().Err(rerr).Stringer("endpoint", s.endpoint).Msg("reading from endpoint failed; session ended")
			return false
		}
	}
}

// recvBatch reads up to a batch of datagrams from fd (the service port's socket when listener is
// set, else a session's) into a pooled batch. It returns a nil batch when fd is empty (a nil
// error) or reading failed.
func (p *Proxy) recvBatch(fd int, listener bool) (*udpBatch, int, error) {
	if p.testHookRecv != nil {
		p.testHookRecv(fd, listener)
	}
	b := getUDPBatch()
	b.prepareRecv(listener)
	n, err := recvmmsg(fd, b.in[:])
	if err != nil {
		putUDPBatch(b)
		if err == unix.EAGAIN {
			return nil, 0, nil
		}
		return nil, 0, err
	}
	return b, n, nil
}

// readReplies reads the endpoint's datagrams from the session's socket fd in batches and sends
// each batch to the client from Conn, until the socket is empty (it returns nil: wait until it
// is readable) or reading fails. Like readBatches, it takes a short batch for an empty socket.
func (s *udpSession) readReplies(fd int) error {
	p := s.p
	for {
		b, n, err := p.recvBatch(fd, false)
		if b == nil {
			return err // nil: the socket is empty
		}
		p.replyStats.received(n)
		s.lastActive.Store(p.now())
		for i := range n {
			b.setOut(i, i, s.clientSA, s.replyOOB)
		}
		s.fromEndpoint.Add(b.outBytes(0, n))
		err = s.sendReplies(b, n)
		putUDPBatch(b)
		if err != nil {
			return err
		}
		if n < len(b.in) || p.frozen.Load() {
			return nil
		}
	}
}

// sendReplies sends the first n sends of b from Conn. A reply that cannot be sent is dropped;
// the error is net.ErrClosed's when Conn is closed.
func (s *udpSession) sendReplies(b *udpBatch, n int) error {
	p := s.p
	for from := 0; from < n; {
		sent, err := b.sendOut(p.connRC, from, n, &p.replyStats)
		from += sent
		if err == nil {
			break
		}
		if errors.Is(err, net.ErrClosed) {
			return err
		}
		p.logDebug().Err(err).Stringer("client", s.client).Msg("sending reply to client failed; dropped")
		from++
	}
	return nil
}

// expire removes the session if it is still idle, and reports whether it did.
func (s *udpSession) expire() bool {
	p := s.p
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.now()-s.lastActive.Load() < int64(p.timeout) {
		return false // a datagram from the client arrived meanwhile
	}
	if p.sessions[s.client] == s {
		delete(p.sessions, s.client)
	}
	return true
}

// finish removes the session from the map if it is still there, closes its socket and reports
// it.
func (s *udpSession) finish() {
	p := s.p
	p.mu.Lock()
	if p.sessions[s.client] == s {
		delete(p.sessions, s.client)
	}
	p.mu.Unlock()
	s.release()
	p.sessionEnded(s.client, s.endpoint, s.toEndpoint.Load(), s.fromEndpoint.Load())
}
