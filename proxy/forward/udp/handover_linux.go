package udp

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/runstate"
)

// Freeze stops the proxy for a hand-over and exports its socket and sessions (see UDPState). It
// stops reading Conn and every session's socket where they stand (a datagram read is always
// forwarded first; those not yet read stay in the kernel's buffers, which the duplicates share)
// and returns duplicates of every socket. Serve returns nil. ctx is unused: nothing waits for
// the network.
//
// After Freeze the proxy serves nothing and holds its own descriptors until Release (or Close,
// which releases a frozen proxy). Freeze fails on a closed or frozen proxy; when duplicating a
// socket fails, it returns the error and the proxy stays frozen.
func (p *Proxy) Freeze(_ context.Context) (forward.UDPState, error) {
	if err := p.run.Freeze("UDP proxy", p.wakeReadLoop); err != nil {
		return forward.UDPState{}, err
	}
	p.closeStartCT() // the loop is over; Thaw and Start open another
	p.freezeSessions()
	p.sessionWG.Wait() // frozen sessions stop at once
	return p.export()
}

// wakeReadLoop makes a pending read of Conn return, leaving the socket open.
func (p *Proxy) wakeReadLoop() {
	_ = p.Conn.SetReadDeadline(freezeDeadline)
}

// freezeSessions sets the frozen flag and wakes every session's goroutine with a read deadline
// in the past; Adopt admits no more sessions.
func (p *Proxy) freezeSessions() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.frozen.Store(true)
	for _, s := range p.sessions {
		_ = s.backend.SetReadDeadline(freezeDeadline)
	}
}

// park leaves a session stopped by a freeze in the map with its socket open, reporting the
// bytes this process moved and nothing closed.
func (s *udpSession) park() {
	s.parked.Store(true)
	s.p.metrics.BytesCopied(s.toEndpoint.Load(), s.fromEndpoint.Load())
}

// Thaw undoes a Freeze that no Release followed (the hand-over failed): the proxy serves again
// on its own sockets, every parked session relays on where it stopped, and no descriptor is
// needed. Call Serve again. What Freeze exported is the caller's to close. Thaw fails on a
// proxy that is not frozen or was released.
func (p *Proxy) Thaw() error {
	if !p.run.Thaw() {
		return errors.New("thaw UDP proxy: not frozen, or released")
	}
	if p.Conn != nil {
		_ = p.Conn.SetReadDeadline(time.Time{})
	}
	p.mu.Lock()
	p.frozen.Store(false)
	var parked []*udpSession
	for _, s := range p.sessions {
		if s.parked.Load() && !s.released.Load() {
			s.parked.Store(false)
			p.sessionWG.Add(1)
			parked = append(parked, s)
		}
	}
	p.mu.Unlock()
	for _, s := range parked {
		go s.relayReplies() // it sets its own read deadline (the session's expiry) first
	}
	return nil
}

// export duplicates Conn and the socket of every parked session.
func (p *Proxy) export() (forward.UDPState, error) {
	var st forward.UDPState
	if p.Conn != nil {
		f, err := p.Conn.File()
		if err != nil {
			return forward.UDPState{}, fmt.Errorf("freeze UDP proxy: duplicate the socket: %w", err)
		}
		st.Conn = f
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.now()
	for _, s := range p.sessions {
		if !s.parked.Load() || s.released.Load() {
			continue
		}
		f, err := s.backend.File()
		if err != nil {
			_ = st.Close()
			return forward.UDPState{}, fmt.Errorf("freeze UDP proxy: duplicate the socket of the session of %s: %w", s.client, err)
		}
		st.Sessions = append(st.Sessions, forward.UDPSessionState{Backend: f, Client: s.client, Endpoint: s.endpoint,
			ReplyFrom: s.replyFrom, Idle: time.Duration(max(now-s.lastActive.Load(), 0)), Refused: s.refused.Load()})
	}
	return st, nil
}

// Release closes a frozen proxy's own descriptors (Conn and the sessions' sockets), which
// touches no socket since the exported duplicates keep them open, returns their descriptors to
// the Budget and reports nothing closed (see HandoverMetrics). It does nothing on a proxy that
// is not frozen, or was released before.
func (p *Proxy) Release() {
	if !p.run.Release() {
		return
	}
	p.sessionWG.Wait()
	if p.Conn != nil {
		_ = p.Conn.Close()
	}
	p.mu.Lock()
	sessions := p.sessions
	p.sessions = map[netip.AddrPort]*udpSession{}
	p.mu.Unlock()
	hm, _ := p.metrics.(forward.HandoverMetrics)
	for _, s := range sessions {
		s.release()
		if hm != nil {
			hm.UDPSessionReleased()
		}
	}
}

// Adopt takes over sessions exported by Freeze (of this process or another one), before Serve
// (after it, a session whose client already has one is refused). Each session keeps its
// endpoint, the address its replies leave from and its idle clock, counts in MaxSessions and
// the Budget (never refused for them: it was admitted before) and is reported opened. Conn is
// required: replies leave through it.
//
// Adopt owns the files from the call on: it closes them, or keeps the sockets as sessions. A
// session that cannot be adopted is closed and reported in the joined error; the others go on.
// It fails for all of them on a closed or frozen proxy.
func (p *Proxy) Adopt(sessions []forward.UDPSessionState) error {
	closed, frozen := p.run.Status()
	var err error
	switch {
	case closed || frozen:
		err = runstate.Err(closed, frozen)
	case p.Conn == nil:
		err = errors.New("the Conn field is required")
	}
	if err != nil {
		_ = forward.UDPState{Sessions: sessions}.Close()
		return fmt.Errorf("adopt UDP sessions: %w", err)
	}
	p.prepare()
	var errs []error
	for _, ss := range sessions {
		if err := p.adoptSession(ss); err != nil {
			errs = append(errs, fmt.Errorf("adopt UDP session of %s to %s: %w", ss.Client, ss.Endpoint, err))
		}
	}
	return errors.Join(errs...)
}

// adoptSession starts one adopted session.
func (p *Proxy) adoptSession(ss forward.UDPSessionState) error {
	backend, err := udpConnFromFile(ss.Backend, true)
	if err != nil {
		return fmt.Errorf("session socket: %w", err)
	}
	s := p.newSession(ss.Client, ss.Endpoint, backend, ss.ReplyFrom)
	s.lastActive.Store(p.now() - int64(max(ss.Idle, 0)))
	s.refused.Store(ss.Refused)
	if err := p.admitAdopted(s); err != nil {
		_ = backend.Close()
		return err
	}
	p.metrics.UDPSessionOpened()
	go s.relayReplies()
	return nil
}

// admitAdopted registers an adopted session, counting it in the Budget even above its limit.
func (p *Proxy) admitAdopted(s *udpSession) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if closed, frozen := p.run.Status(); closed || frozen || p.frozen.Load() {
		return runstate.Err(closed, true)
	}
	if _, dup := p.sessions[s.client]; dup {
		return errors.New("the client has a session already")
	}
	p.sessions[s.client] = s
	p.Budget.Force(udpSessionFDs)
	p.sessionWG.Add(1)
	return nil
}

// ConnFromFile turns a received service port socket (UDPState.Conn) back into what
// Proxy.Conn needs, taking ownership of f. The options the proxy needs on it
// (IP_RECVORIGDSTADDR) are kernel state that came with the socket, and Serve sets them anyway.
func ConnFromFile(f *os.File) (*net.UDPConn, error) {
	c, err := udpConnFromFile(f, false)
	if err != nil {
		return nil, fmt.Errorf("UDP socket from file: %w", err)
	}
	return c, nil
}

// udpConnFromFile turns a received UDP socket into a *net.UDPConn, connected or not as asked,
// and closes f.
func udpConnFromFile(f *os.File, connected bool) (*net.UDPConn, error) {
	if f == nil {
		return nil, errors.New("no file")
	}
	defer f.Close()
	pc, err := net.FilePacketConn(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", f.Name(), err)
	}
	uc, ok := pc.(*net.UDPConn)
	if !ok || (uc.RemoteAddr() != nil) != connected {
		_ = pc.Close()
		return nil, fmt.Errorf("%s: not a UDP socket, or connected: %v, want %v", f.Name(), ok && uc.RemoteAddr() != nil, connected)
	}
	return uc, nil
}
