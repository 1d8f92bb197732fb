//go:build !linux

package forward

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"syscall"
)

// On systems other than Linux a TCPProxy and a UDPProxy serve with the portable relays
// (relay_tcp.go, relay_udp.go), under the same connection policy as Linux's event loops. What
// needs Linux says so: the hand-over (Freeze, Adopt, the sockets from files), the original
// destination (conntrack), transparent dialing.

// ErrNotSupported is returned (wrapped) for what needs Linux.
var ErrNotSupported = errors.New("not supported on this OS")

// Loops stands for the event loops of Linux: the relays need none.
type Loops struct{}

// NewLoops returns a Loops for TCPProxy.Loops; n is unused here.
func NewLoops(int) (*Loops, error) { return &Loops{}, nil }

// Close does nothing: the relays' goroutines belong to their proxies.
func (ls *Loops) Close() error { return nil }

// Served returns 0: the relays' connections are counted by their proxies' Metrics.
func (ls *Loops) Served() uint64 { return 0 }

// Poller stands for Linux's poller of idle UDP listeners: here a UDP proxy's read loop runs
// from Start to Close.
type Poller struct{}

// NewPoller returns a Poller for UDPProxy.Start.
func NewPoller() (*Poller, error) { return &Poller{}, nil }

// Close does nothing.
func (*Poller) Close() error { return nil }

// pipePool, loopProxy and udpBatchStats are Linux's splice pipes, loop state and batch
// counters: none here.
type (
	pipePool      struct{ budget *Budget }
	loopProxy     struct{}
	udpBatchStats struct{}
)

func (*pipePool) dropIdle() int { return 0 }
func (*pipePool) closeAll()     {}

// osPendingConnErrnos: none beyond isPendingConnError's.
var osPendingConnErrnos []syscall.Errno

// ListenTCP opens a TCP listener for a TCPProxy at laddr ("tcp4" or "tcp6" network).
func ListenTCP(network string, laddr *net.TCPAddr) (*net.TCPListener, error) {
	return net.ListenTCP(network, laddr)
}

// RaiseFileLimit reports 0: no descriptor limit is known here, so the data path has no Budget.
func RaiseFileLimit() (uint64, error) { return 0, nil }

// tcpRelayOf returns p's relay, made at its first use.
func (p *TCPProxy) tcpRelayOf() *tcpRelay {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.relay == nil {
		newTCPRelay(p)
	}
	return p.relay
}

// serveOnLoop is Serve: the relay accepts and relays until Close.
func (p *TCPProxy) serveOnLoop() error {
	ok, err := p.run.Start("TCP proxy")
	if !ok {
		return err
	}
	defer p.run.Ended()
	return p.tcpRelayOf().serve()
}

// startOnLoop is Start: the relay's accept loop runs on a goroutine of its own, which Close
// waits for.
func (p *TCPProxy) startOnLoop() (bool, error) {
	ok, err := p.run.Start("TCP proxy")
	if !ok {
		return false, err
	}
	r := p.tcpRelayOf()
	go func() {
		defer p.run.Ended()
		_ = r.serve() // an accept error is logged by serve
	}()
	return true, nil
}

// loopListenerCloser closes the proxy's relay, and so its listener.
type loopListenerCloser struct{ p *TCPProxy }

func (c loopListenerCloser) Close() error { return c.p.tcpRelayOf().close() }

// cutLoopConns resets every connection of the proxy.
func (p *TCPProxy) cutLoopConns() int { return p.tcpRelayOf().cut() }

// Freeze fails: the hand-over needs Linux.
func (p *TCPProxy) Freeze(context.Context) (TCPState, error) {
	return TCPState{}, fmt.Errorf("freeze TCP proxy: %w", ErrNotSupported)
}

// Thaw fails: the hand-over needs Linux.
func (p *TCPProxy) Thaw() error { return fmt.Errorf("thaw TCP proxy: %w", ErrNotSupported) }

// Release does nothing: a proxy here is never frozen.
func (p *TCPProxy) Release() {}

// Adopt fails and closes the state's files: the hand-over needs Linux.
func (p *TCPProxy) Adopt(conns []TCPConnState) error {
	_ = TCPState{Conns: conns}.Close()
	return fmt.Errorf("adopt TCP connections: %w", ErrNotSupported)
}

// TCPListenerFromFile fails and closes f: the hand-over needs Linux.
func TCPListenerFromFile(f *os.File) (*net.TCPListener, error) {
	_ = closeFile(f)
	return nil, fmt.Errorf("TCP listener from file: %w", ErrNotSupported)
}

// udpRelayOf returns p's relay, made at its first use.
func (p *UDPProxy) udpRelayOf() *udpRelay {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.relay == nil {
		newUDPRelay(p)
	}
	return p.relay
}

// Serve reads datagrams from Conn and forwards them until Close. It returns nil after Close, or
// the read error that stopped it. It may be called once.
func (p *UDPProxy) Serve() error {
	if p.Conn == nil || p.Chooser == nil {
		return errors.New("serve UDP proxy: Conn and Chooser are required")
	}
	return p.udpRelayOf().serve()
}

// Start serves like Serve on a goroutine of its own, which Close waits for; poller is unused.
func (p *UDPProxy) Start(*Poller) error {
	if p.Conn == nil || p.Chooser == nil {
		return errors.New("start UDP proxy: Conn and Chooser are required")
	}
	r := p.udpRelayOf()
	ok, err := r.start()
	if !ok {
		return err
	}
	go func() { _ = r.run() }() // a read error is logged by run; close waits for it
	return nil
}

// Close closes Conn and every session, and returns once Serve and the sessions have ended.
func (p *UDPProxy) Close() error { return p.udpRelayOf().close() }

// DropSessions ends the sessions whose endpoint keep rejects and returns how many it ended.
func (p *UDPProxy) DropSessions(keep func(endpoint netip.AddrPort) bool) int {
	return p.udpRelayOf().dropSessions(keep)
}

// Freeze fails: the hand-over needs Linux.
func (p *UDPProxy) Freeze(context.Context) (UDPState, error) {
	return UDPState{}, fmt.Errorf("freeze UDP proxy: %w", ErrNotSupported)
}

// Thaw fails: the hand-over needs Linux.
func (p *UDPProxy) Thaw() error { return fmt.Errorf("thaw UDP proxy: %w", ErrNotSupported) }

// Release does nothing: a proxy here is never frozen.
func (p *UDPProxy) Release() {}

// Adopt fails and closes the sessions' files: the hand-over needs Linux.
func (p *UDPProxy) Adopt(sessions []UDPSessionState) error {
	_ = UDPState{Sessions: sessions}.Close()
	return fmt.Errorf("adopt UDP sessions: %w", ErrNotSupported)
}

// UDPConnFromFile fails and closes f: the hand-over needs Linux.
func UDPConnFromFile(f *os.File) (*net.UDPConn, error) {
	_ = closeFile(f)
	return nil, fmt.Errorf("UDP socket from file: %w", ErrNotSupported)
}
