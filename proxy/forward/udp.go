package forward

import (
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
	"golang.org/x/sys/unix"
)

// DefaultUDPTimeout is the idle timeout of a UDP session when UDPProxy.Timeout is zero.
//
// kube-proxy's 250ms broke DNS forwarders, which wait seconds for an upstream answer (glibc's
// resolver retries after 5 s): the session, and the affinity of the flow to one endpoint, were
// gone before the answer came. 30 s is the kernel's conntrack timeout for a UDP flow
// (nf_conntrack_udp_timeout; replied flows get 120 s), so a session never outlives the conntrack
// entry that un-NATs its replies, and the proxy holds a socket per client no longer than the
// kernel holds the flow's state anyway.
const DefaultUDPTimeout = 30 * time.Second

// udpBufSize is the size of every datagram buffer: more than the largest UDP payload (65,507
// bytes over IPv4, 65,527 over IPv6), so no datagram is ever truncated.
const udpBufSize = 64 << 10

// UDPProxy forwards the datagrams received on Conn to endpoints picked by Chooser, one session
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
// the proxy closes. When the endpoint answers with ICMP port unreachable, the next datagram
// from the client asks Choose again with reset=true. A datagram with no usable endpoint is
// dropped (iptables rules elsewhere send the ICMP reject).
type UDPProxy struct {
	// Conn is the service port's listening socket. Required. The proxy owns it from Serve on:
	// Close closes it.
	Conn *net.UDPConn
	// Chooser picks the endpoint of each new session. Required.
	Chooser Chooser
	// Timeout is how long a session lives without traffic in either direction; zero means
	// DefaultUDPTimeout.
	Timeout time.Duration
	// Log receives the proxy's events; the zero Logger discards them. Scope it to the service
	// port. Per-session and per-drop events are at debug level.
	Log zerolog.Logger
	// Metrics receives traffic events; nil means none.
	Metrics Metrics

	// Resolved by Serve before the first session starts.
	metrics Metrics
	timeout time.Duration
	epoch   time.Time // session activity is kept as the monotonic time since epoch
	bufs    sync.Pool // *[]byte of udpBufSize

	sessionWG sync.WaitGroup // one count per session goroutine

	transparentWarned atomic.Bool // a failed transparent socket was logged at warning level

	mu       sync.Mutex // guards the following fields
	run      runState
	sessions map[netip.AddrPort]*udpSession
}

// udpSession is one client address's flow to one endpoint. Its goroutine (relayReplies) owns it.
type udpSession struct {
	p        *UDPProxy
	client   netip.AddrPort // as received on Conn (an IPv4 client of an AF_INET6 socket is mapped)
	endpoint netip.AddrPort
	backend  *net.UDPConn // connected to endpoint
	replyOOB []byte       // IP_PKTINFO setting the replies' source; nil when unknown

	lastActive   atomic.Int64 // p.now() of the last datagram either way
	refused      atomic.Bool  // the endpoint answered with an ICMP error
	toEndpoint   atomic.Int64 // payload bytes
	fromEndpoint atomic.Int64
}

// Serve reads datagrams from Conn and forwards them until Close. It returns nil after Close, or
// an error if reading fails for a reason other than a shortage of memory (which pauses
// reading). It may be called once.
func (p *UDPProxy) Serve() error {
	if p.Conn == nil || p.Chooser == nil {
		return errors.New("serve UDP proxy: Conn and Chooser are required")
	}
	p.mu.Lock()
	p.initLocked()
	done, ok, err := p.run.startLocked("UDP proxy")
	if !ok {
		p.mu.Unlock()
		return err
	}
	p.metrics = metricsOrNone(p.Metrics)
	p.timeout = p.Timeout
	if p.timeout <= 0 {
		p.timeout = DefaultUDPTimeout
	}
	p.epoch = time.Now()
	p.bufs.New = func() any {
		b := make([]byte, udpBufSize)
		return &b
	}
	p.mu.Unlock()
	defer close(done)

	var ct *conntrackConn
	if err := enableOrigDst(p.Conn); err != nil {
		p.Log.Warn().Err(err).Msg("destinations of datagrams unavailable: original destinations unknown, replies leave from the routing's choice of source")
	} else if ct, err = openConntrack(); err != nil {
		p.Log.Warn().Err(err).Msg("conntrack unavailable: original destinations of UDP flows unknown")
	} else {
		defer ct.Close()
	}
	return p.readLoop(ct)
}

func (p *UDPProxy) initLocked() {
	p.run.initLocked()
	if p.sessions == nil {
		p.sessions = make(map[netip.AddrPort]*udpSession)
	}
}

// Close closes Conn, waits for Serve's loop to return, then ends every session and waits for
// their goroutines. Unlike TCP connections, sessions cannot outlive the proxy: their replies
// leave through Conn. Close may be called more than once, and before Serve.
func (p *UDPProxy) Close() error {
	var sock io.Closer
	if p.Conn != nil {
		sock = p.Conn
	}
	_, err := p.run.close(&p.mu, p.initLocked, sock, "UDP proxy socket")
	p.DropSessions(func(netip.AddrPort) bool { return false })
	p.sessionWG.Wait()
	return err
}

// DropSessions ends at once every session whose endpoint keep rejects and returns how many it
// ended. The next datagram from such a client opens a new session, to an endpoint Choose picks.
// Call it after each change of the service's endpoints.
func (p *UDPProxy) DropSessions(keep func(endpoint netip.AddrPort) bool) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for client, s := range p.sessions {
		if !keep(s.endpoint) {
			delete(p.sessions, client)
			s.backend.Close() // its goroutine sees the close and finishes the session
			n++
		}
	}
	return n
}

// now is the monotonic time since Serve started, for session activity stamps.
func (p *UDPProxy) now() int64 { return int64(time.Since(p.epoch)) }

// readLoop is Serve's loop: one buffer, reused for every datagram. ct is nil when conntrack
// cannot be asked.
func (p *UDPProxy) readLoop(ct *conntrackConn) error {
	local := p.Conn.LocalAddr()
	buf := make([]byte, udpBufSize)
	oob := make([]byte, origDstOOBSize)
	var pause resourcePause
	for {
		n, oobn, _, src, err := p.Conn.ReadMsgUDPAddrPort(buf, oob)
		if err != nil {
			if p.run.stopping() {
				return nil
			}
			if isResourceExhausted(err) {
				if pause.attempts == 0 {
					p.Log.Warn().Err(err).Msg("receive: out of memory; pausing")
				}
				if !sleepUnlessStopped(pause.next(), p.run.stop) {
					return nil
				}
				continue
			}
			return fmt.Errorf("read from UDP proxy socket %s: %w", local, err)
		}
		pause = resourcePause{}
		p.forward(ct, buf[:n], src, origDstFromOOB(oob[:oobn]))
	}
}

// originalDst asks conntrack where the flow from client that reached the proxy at to was
// addressed before NAT. It returns the zero AddrPort when that is unknown or when the flow was
// not NATed.
func (p *UDPProxy) originalDst(ct *conntrackConn, client, to netip.AddrPort) netip.AddrPort {
	if ct == nil || !to.IsValid() {
		return netip.AddrPort{}
	}
	dst, err := ct.originalDst(unix.IPPROTO_UDP, client, to)
	if err != nil {
		if !errors.Is(err, unix.ENOENT) { // ENOENT: conntrack does not track the flow
			p.Log.Debug().Err(err).Stringer("client", client).Msg("conntrack lookup failed")
		}
		return netip.AddrPort{}
	}
	if dst = unmapAddrPort(dst); dst == to {
		return netip.AddrPort{}
	}
	return dst
}

// forward sends one client datagram, which reached the proxy at to, to the client's session,
// opening one if needed. A session found closed or refused is replaced once.
func (p *UDPProxy) forward(ct *conntrackConn, payload []byte, client, to netip.AddrPort) {
	for range 2 {
		s := p.session(ct, client, to)
		if s == nil {
			p.metrics.DatagramDropped()
			return
		}
		n, err := s.backend.Write(payload)
		if err == nil {
			s.toEndpoint.Add(int64(n))
			return
		}
		if errors.Is(err, net.ErrClosed) {
			continue // dropped or expired meanwhile: open a new session
		}
		if isUnreachable(err) {
			// An earlier datagram drew an ICMP error: this one was not sent. Choose again.
			s.markRefused(err)
			continue
		}
		p.Log.Debug().Err(err).Stringer("client", client).Stringer("endpoint", s.endpoint).
			Msg("sending datagram to endpoint failed; dropped")
		break
	}
	p.metrics.DatagramDropped()
}

// session returns client's live session, opening one if there is none or the current one was
// refused by its endpoint. It returns nil when no session could be opened. Only the read loop
// calls it, so sessions of one client are never opened concurrently.
func (p *UDPProxy) session(ct *conntrackConn, client, to netip.AddrPort) *udpSession {
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
		s.backend.Close()
	}
	p.mu.Unlock()

	clientAddr := unmapAddrPort(client)
	dst := p.originalDst(ct, client, to)
	target, err := p.Chooser.Choose(clientAddr, dst, reset)
	if err != nil {
		p.Log.Debug().Err(err).Stringer("client", clientAddr).Stringer("dst", dst).
			Msg("no endpoint; datagram dropped")
		return nil
	}
	ep := target.Endpoint
	backend, err := p.dialEndpoint(target, clientAddr)
	if err != nil {
		p.metrics.DialFailed(ep)
		p.Log.Debug().Err(err).Stringer("client", clientAddr).Stringer("endpoint", ep).
			Msg("cannot open a socket to the endpoint; datagram dropped")
		return nil
	}
	s = &udpSession{p: p, client: client, endpoint: ep, backend: backend, replyOOB: sourceAddrOOB(to.Addr())}
	s.lastActive.Store(p.now())
	p.mu.Lock()
	if p.run.closed {
		p.mu.Unlock()
		backend.Close()
		return nil
	}
	p.sessions[client] = s
	p.sessionWG.Add(1)
	p.mu.Unlock()
	p.metrics.UDPSessionOpened()
	p.Log.Debug().Stringer("client", clientAddr).Stringer("dst", dst).Stringer("endpoint", ep).
		Bool("reset", reset).Msg("UDP session opened")
	go s.relayReplies()
	return s
}

// dialEndpoint opens the session's socket to target's endpoint, from the client's address when
// the target asks for it and that is possible. A transparent socket refused for lack of
// privilege or by the bind falls back to a plain one, with a warning.
func (p *UDPProxy) dialEndpoint(target Target, client netip.AddrPort) (*net.UDPConn, error) {
	ep := target.Endpoint
	if target.Transparent && canDialFrom(client.Addr(), ep) {
		c, err := dialUDPFrom(client.Addr(), ep)
		if err == nil || !isTransparentSetupError(err) {
			return c, err
		}
		logTransparentFallback(p.Log, &p.transparentWarned, err, client, ep)
	}
	return net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(ep))
}

// markRefused records that the endpoint answered with an ICMP error (a connected UDP socket
// reports it on the next read or write), so that the next datagram chooses again.
func (s *udpSession) markRefused(err error) {
	if s.refused.CompareAndSwap(false, true) {
		s.p.metrics.DialFailed(s.endpoint)
		s.p.Log.Debug().Err(err).Stringer("client", s.client).Stringer("endpoint", s.endpoint).
			Msg("endpoint refused the flow")
	}
}

// relayReplies reads the endpoint's datagrams and sends them to the client from the proxy's
// socket, until the session is idle for the timeout or its socket is closed.
//
// While waiting it holds no buffer: it polls the socket for readability and takes a buffer from
// the pool only to read a datagram that is there, so idle sessions cost a socket and a
// goroutine, not 64 KiB each.
func (s *udpSession) relayReplies() {
	p := s.p
	defer p.sessionWG.Done()
	defer s.finish()

	rc, err := s.backend.SyscallConn()
	if err != nil {
		return
	}
	var (
		got  *[]byte
		n    int
		rerr error
	)
	read := func(fd uintptr) bool {
		b := p.bufs.Get().(*[]byte)
		for {
			n, rerr = unix.Read(int(fd), *b)
			if rerr != unix.EINTR {
				break
			}
		}
		if rerr == unix.EAGAIN {
			p.bufs.Put(b)
			return false // wait until readable
		}
		got = b
		return true
	}
	var deadline time.Time
	for {
		expiry := p.epoch.Add(time.Duration(s.lastActive.Load()) + p.timeout)
		if !time.Now().Before(expiry) {
			if s.expire() {
				return
			}
			continue
		}
		// The deadline is set lazily: activity only moves the expiry later, so a deadline at an
		// older expiry is never too late; when it fires, the loop finds the new expiry and sets
		// that. Resetting the timer on every datagram would cost more than the datagram.
		if deadline.IsZero() {
			if err := s.backend.SetReadDeadline(expiry); err != nil {
				return // closed
			}
			deadline = expiry
		}
		if err := rc.Read(read); err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				deadline = time.Time{}
				continue // check activity: the client may have kept the session alive
			}
			return // closed: dropped, replaced, or the proxy is closing
		}
		b := got
		got = nil
		if rerr != nil {
			p.bufs.Put(b)
			if isUnreachable(rerr) {
				s.markRefused(rerr)
				continue
			}
			p.Log.Debug().Err(rerr).Stringer("endpoint", s.endpoint).Msg("reading from endpoint failed; session ended")
			return
		}
		s.lastActive.Store(p.now())
		s.fromEndpoint.Add(int64(n))
		_, _, werr := p.Conn.WriteMsgUDPAddrPort((*b)[:n], s.replyOOB, s.client)
		p.bufs.Put(b)
		if werr != nil {
			if errors.Is(werr, net.ErrClosed) {
				return
			}
			p.Log.Debug().Err(werr).Stringer("client", s.client).Msg("sending reply to client failed; dropped")
		}
	}
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
	s.backend.Close()
	p.metrics.BytesCopied(s.toEndpoint.Load(), s.fromEndpoint.Load())
	p.metrics.UDPSessionClosed()
	p.Log.Debug().Stringer("client", s.client).Stringer("endpoint", s.endpoint).
		Int64("toEndpoint", s.toEndpoint.Load()).Int64("fromEndpoint", s.fromEndpoint.Load()).
		Msg("UDP session closed")
}

// sessionCount returns the number of live sessions (for tests).
func (p *UDPProxy) sessionCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.sessions)
}

// isUnreachable reports whether err is an ICMP error reported on a connected UDP socket: the
// endpoint's port is closed or its host cannot be reached.
func isUnreachable(err error) bool {
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EHOSTUNREACH) ||
		errors.Is(err, syscall.ENETUNREACH) || errors.Is(err, syscall.EHOSTDOWN)
}
