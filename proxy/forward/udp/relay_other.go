//go:build !linux

package udp

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
)

// Poller stands for Linux's poller of idle UDP listeners: here a UDP proxy's read loop runs
// from Start to Close.
type Poller struct{}

// NewPoller returns a Poller for Proxy.Start.
func NewPoller() (*Poller, error) { return &Poller{}, nil }

// Close does nothing.
func (*Poller) Close() error { return nil }

// udpBatchStats are Linux's batch counters: none here.
type udpBatchStats struct{}

// udpRelayOf returns p's relay, made at its first use.
func (p *Proxy) udpRelayOf() *udpRelay {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.relay == nil {
		newUDPRelay(p)
	}
	return p.relay
}

// Serve reads datagrams from Conn and forwards them until Close. It returns nil after Close, or
// the read error that stopped it. It may be called once.
func (p *Proxy) Serve() error {
	if p.Conn == nil || p.Chooser == nil {
		return errors.New("serve UDP proxy: Conn and Chooser are required")
	}
	return p.udpRelayOf().serve()
}

// Start serves like Serve on a goroutine of its own, which Close waits for; poller is unused.
func (p *Proxy) Start(*Poller) error {
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
func (p *Proxy) Close() error { return p.udpRelayOf().close() }

// DropSessions ends the sessions whose endpoint keep rejects and returns how many it ended.
func (p *Proxy) DropSessions(keep func(endpoint netip.AddrPort) bool) int {
	return p.udpRelayOf().dropSessions(keep)
}

// Freeze fails: the hand-over needs Linux.
func (p *Proxy) Freeze(context.Context) (forward.UDPState, error) {
	return forward.UDPState{}, fmt.Errorf("freeze UDP proxy: %w", forward.ErrNotSupported)
}

// Thaw fails: the hand-over needs Linux.
func (p *Proxy) Thaw() error { return fmt.Errorf("thaw UDP proxy: %w", forward.ErrNotSupported) }

// Release does nothing: a proxy here is never frozen.
func (p *Proxy) Release() {}

// Adopt fails and closes the sessions' files: the hand-over needs Linux.
func (p *Proxy) Adopt(sessions []forward.UDPSessionState) error {
	_ = forward.UDPState{Sessions: sessions}.Close()
	return fmt.Errorf("adopt UDP sessions: %w", forward.ErrNotSupported)
}

// ConnFromFile fails and closes f: the hand-over needs Linux.
func ConnFromFile(f *os.File) (*net.UDPConn, error) {
	_ = forward.UDPState{Conn: f}.Close()
	return nil, fmt.Errorf("UDP socket from file: %w", forward.ErrNotSupported)
}
