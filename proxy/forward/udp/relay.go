package udp

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/backpressure"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/sys"
)

// udpRelay is the portable UDP engine of a Proxy, for systems without recvmmsg, conntrack
// and IP_PKTINFO (relay_other.go selects it; on Linux its tests run it too): one datagram per
// system call, a session per client address with a connected socket to its endpoint and one
// goroutine that relays the replies, ended after Timeout without a datagram either way. Its
// rules are Proxy's: Choose for a new session (reset=true after the endpoint refused the
// flow), MaxSessions and the Budget with the longest-idle session evicted to make room, a
// datagram dropped when there is no endpoint. It knows no original destination (Choose gets the
// zero AddrPort) and ignores Target.Transparent.
type udpRelay struct {
	p       *Proxy
	timeout time.Duration
	metrics forward.Metrics
	stop    chan struct{} // closed by close: a paused read loop stops waiting
	wg      sync.WaitGroup

	mu       sync.Mutex // guards the following fields
	closed   bool
	serving  bool
	done     chan struct{} // closed when serve returns
	sessions map[netip.AddrPort]*relaySession
}

// relaySession is one client's flow to one endpoint; its goroutine (relayReplies) owns it.
type relaySession struct {
	client, endpoint netip.AddrPort
	backend          *net.UDPConn
	last             atomic.Int64 // time.Now().UnixNano() of the last datagram either way
	refused          atomic.Bool  // the endpoint answered with an ICMP error
	released         atomic.Bool
	toEndpoint       atomic.Int64
	fromEndpoint     atomic.Int64
}

// newUDPRelay returns the relay of p and sets p.relay.
func newUDPRelay(p *Proxy) *udpRelay {
	timeout := p.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	p.relay = &udpRelay{p: p, timeout: timeout, metrics: p.sink(), stop: make(chan struct{}),
		done: make(chan struct{}), sessions: map[netip.AddrPort]*relaySession{}}
	return p.relay
}

// serve reads datagrams from Conn and forwards them until close; nil after close, else the read
// error that stopped it.
func (r *udpRelay) serve() error {
	ok, err := r.start()
	if !ok {
		return err
	}
	return r.run()
}

// start is serve's admission: an error when it was called before, false (and no error) when
// close came first. When ok, the caller calls run, which close then waits for.
func (r *udpRelay) start() (bool, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.serving {
		return false, errors.New("serve UDP proxy: Serve called twice")
	}
	if r.closed {
		return false, nil
	}
	r.serving = true
	return true, nil
}

// run is serve's loop, after start.
func (r *udpRelay) run() error {
	defer close(r.done)
	p := r.p
	buf := make([]byte, udpBufSize)
	var pause backpressure.Pause
	for {
		n, client, err := p.Conn.ReadFromUDPAddrPort(buf)
		if err != nil {
			switch {
			case r.isClosed():
				return nil
			case backpressure.IsResourceExhausted(err):
				if !backpressure.SleepUnlessStopped(pause.Next(), r.stop) {
					return nil
				}
				continue
			case isUnreachable(err) || errors.Is(err, syscall.ECONNRESET):
				continue // an ICMP error for an earlier reply (Windows reports it on the listener)
			}
			err = fmt.Errorf("read UDP on %s: %w", p.Conn.LocalAddr(), err)
			p.logError().Err(err).Msg("UDP proxy stopped")
			return err
		}
		pause = backpressure.Pause{}
		r.forward(client, buf[:n])
	}
}

// forward sends one datagram of client to its session's endpoint, choosing again once when the
// endpoint refused the flow.
func (r *udpRelay) forward(client netip.AddrPort, b []byte) {
	for range 2 {
		s := r.session(client)
		if s == nil {
			break
		}
		_, err := s.backend.Write(b)
		switch {
		case err == nil:
			s.toEndpoint.Add(int64(len(b)))
			return
		case errors.Is(err, net.ErrClosed): // expired or evicted meanwhile: a new session
			continue
		case isUnreachable(err):
			r.markRefused(s, err)
			continue
		}
		r.p.logDebug().Err(err).Stringer("client", s.client).Stringer("endpoint", s.endpoint).
			Msg("sending datagram to endpoint failed; dropped")
		break
	}
	r.metrics.DatagramDropped()
}

// session returns client's session, opening one (Choose, admission, socket) when there is none
// or its endpoint refused the flow; nil when the datagram is to be dropped.
func (r *udpRelay) session(client netip.AddrPort) *relaySession {
	p := r.p
	r.mu.Lock()
	s := r.sessions[client]
	if s != nil && !s.refused.Load() {
		s.last.Store(time.Now().UnixNano())
		r.mu.Unlock()
		return s
	}
	reset := s != nil
	if s != nil {
		delete(r.sessions, client)
		r.release(s)
	}
	r.mu.Unlock()

	clientAddr := sys.UnmapAddrPort(client)
	dst := netip.AddrPort{} // unknown: no conntrack here
	target, backend, ok := p.dialSession(clientAddr, dst, reset, r.admit, func(t forward.Target) (*net.UDPConn, error) {
		ep := t.Endpoint
		return net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(netip.AddrPortFrom(ep.Addr().Unmap(), ep.Port())))
	})
	if !ok {
		return nil
	}
	ep := target.Endpoint
	s = &relaySession{client: client, endpoint: ep, backend: backend}
	s.last.Store(time.Now().UnixNano())
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		r.release(s)
		return nil
	}
	r.sessions[client] = s
	r.wg.Add(1)
	r.mu.Unlock()
	p.sessionOpened(clientAddr, dst, ep, reset)
	go r.relayReplies(s)
	return s
}

// admit takes a session's descriptor within the policy's limits, evicting to make room.
func (r *udpRelay) admit() bool {
	return r.p.admitSessionWithin(func() int {
		r.mu.Lock()
		defer r.mu.Unlock()
		return len(r.sessions)
	}, r.evictIdlest)
}

// evictIdlest ends the longest-idle session; false when there is none.
func (r *udpRelay) evictIdlest() bool {
	return evictIdlestOf(&r.mu, &r.sessions, func(s *relaySession) int64 { return s.last.Load() }, r.release, r.metrics)
}

// release closes a session's socket and returns its descriptor to the Budget, once.
func (r *udpRelay) release(s *relaySession) {
	if s.released.CompareAndSwap(false, true) {
		_ = s.backend.Close()
		r.p.Budget.Give(udpSessionFDs)
	}
}

// markRefused notes that s's endpoint answered with an ICMP error: the next datagram chooses again.
func (r *udpRelay) markRefused(s *relaySession, err error) {
	if s.refused.CompareAndSwap(false, true) {
		r.p.flowRefused(s.client, s.endpoint, err)
	}
}

// relayReplies sends the endpoint's datagrams to the client from Conn, one per call, until the
// session is idle for the timeout or its socket is closed; then it ends the session.
func (r *udpRelay) relayReplies(s *relaySession) {
	defer r.wg.Done()
	p := r.p
	buf := make([]byte, udpBufSize)
	for {
		_ = s.backend.SetReadDeadline(time.Unix(0, s.last.Load()).Add(r.timeout))
		n, err := s.backend.Read(buf)
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) && !r.expire(s) {
				continue // a datagram from the client came meanwhile
			}
			if isUnreachable(err) {
				r.markRefused(s, err)
				continue
			}
			break
		}
		s.last.Store(time.Now().UnixNano())
		if _, err := p.Conn.WriteToUDPAddrPort(buf[:n], s.client); err != nil {
			p.logDebug().Err(err).Stringer("client", s.client).Stringer("endpoint", s.endpoint).
				Msg("sending reply to client failed; dropped")
			continue
		}
		s.fromEndpoint.Add(int64(n))
	}
	r.finish(s)
}

// expire removes s from the sessions if it has been idle for the timeout, and reports whether it did.
func (r *udpRelay) expire(s *relaySession) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if time.Since(time.Unix(0, s.last.Load())) < r.timeout {
		return false
	}
	if r.sessions[s.client] == s {
		delete(r.sessions, s.client)
	}
	return true
}

// finish removes s from the sessions if it is still there, closes its socket and reports it.
func (r *udpRelay) finish(s *relaySession) {
	r.mu.Lock()
	if r.sessions[s.client] == s {
		delete(r.sessions, s.client)
	}
	r.mu.Unlock()
	r.release(s)
	r.p.sessionEnded(s.client, s.endpoint, s.toEndpoint.Load(), s.fromEndpoint.Load())
}

func (r *udpRelay) isClosed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.closed
}

// close closes Conn and every session, and waits for serve and the sessions' goroutines.
func (r *udpRelay) close() error {
	r.mu.Lock()
	first, serving := !r.closed, r.serving
	r.closed = true
	sessions := make([]*relaySession, 0, len(r.sessions))
	for _, s := range r.sessions {
		sessions = append(sessions, s)
	}
	r.mu.Unlock()
	var err error
	if first {
		close(r.stop)
		if cerr := r.p.Conn.Close(); cerr != nil && !errors.Is(cerr, net.ErrClosed) {
			err = fmt.Errorf("close UDP proxy socket: %w", cerr)
		}
	}
	if serving {
		<-r.done
	}
	for _, s := range sessions {
		r.release(s) // its goroutine's read fails: it ends the session
	}
	r.wg.Wait()
	return err
}

// dropSessions ends the sessions whose endpoint keep rejects, and returns how many.
func (r *udpRelay) dropSessions(keep func(endpoint netip.AddrPort) bool) int {
	r.mu.Lock()
	var drop []*relaySession
	for c, s := range r.sessions {
		if !keep(s.endpoint) {
			delete(r.sessions, c)
			drop = append(drop, s)
		}
	}
	r.mu.Unlock()
	for _, s := range drop {
		r.release(s)
	}
	return len(drop)
}
