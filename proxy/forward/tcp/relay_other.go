//go:build !linux

package tcp

import (
	"context"
	"fmt"
	"net"
	"os"
	"syscall"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
)

// On systems other than Linux a Proxy serves with the portable relay (relay.go), under
// the same connection policy as Linux's event loops (package proxy/forward/udp has the UDP
// proxy's). What needs Linux says so: the hand-over (Freeze, Adopt, the listener from a file),
// the original destination (conntrack), transparent dialing.

// Loops stands for the event loops of Linux: the relays need none.
type Loops struct{}

// NewLoops returns a Loops for Proxy.Loops; n is unused here.
func NewLoops(int) (*Loops, error) { return &Loops{}, nil }

// Close does nothing: the relays' goroutines belong to their proxies.
func (ls *Loops) Close() error { return nil }

// Served returns 0: the relays' connections are counted by their proxies' Metrics.
func (ls *Loops) Served() uint64 { return 0 }

// pipePool and loopProxy are Linux's splice pipes and loop state: none here.
type (
	pipePool  struct{ budget *forward.Budget }
	loopProxy struct{}
)

func (*pipePool) DropIdle() int { return 0 }
func (*pipePool) closeAll()     {}

// osPendingConnErrnos: none beyond isPendingConnError's.
var osPendingConnErrnos []syscall.Errno

// Listen opens a TCP listener for a Proxy at laddr ("tcp4" or "tcp6" network).
func Listen(network string, laddr *net.TCPAddr) (*net.TCPListener, error) {
	return net.ListenTCP(network, laddr)
}

// tcpRelayOf returns p's relay, made at its first use.
func (p *Proxy) tcpRelayOf() *tcpRelay {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.relay == nil {
		newTCPRelay(p)
	}
	return p.relay
}

// serveOnLoop is Serve: the relay accepts and relays until Close.
func (p *Proxy) serveOnLoop() error {
	ok, err := p.run.Start("TCP proxy")
	if !ok {
		return err
	}
	defer p.run.Ended()
	return p.tcpRelayOf().serve()
}

// startOnLoop is Start: the relay's accept loop runs on a goroutine of its own, which Close
// waits for.
func (p *Proxy) startOnLoop() (bool, error) {
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
type loopListenerCloser struct{ p *Proxy }

func (c loopListenerCloser) Close() error { return c.p.tcpRelayOf().close() }

// cutLoopConns resets every connection of the proxy.
func (p *Proxy) cutLoopConns() int { return p.tcpRelayOf().cut() }

// Freeze fails: the hand-over needs Linux.
func (p *Proxy) Freeze(context.Context) (forward.TCPState, error) {
	return forward.TCPState{}, fmt.Errorf("freeze TCP proxy: %w", forward.ErrNotSupported)
}

// Thaw fails: the hand-over needs Linux.
func (p *Proxy) Thaw() error { return fmt.Errorf("thaw TCP proxy: %w", forward.ErrNotSupported) }

// Release does nothing: a proxy here is never frozen.
func (p *Proxy) Release() {}

// Adopt fails and closes the state's files: the hand-over needs Linux.
func (p *Proxy) Adopt(conns []forward.TCPConnState) error {
	_ = forward.TCPState{Conns: conns}.Close()
	return fmt.Errorf("adopt TCP connections: %w", forward.ErrNotSupported)
}

// ListenerFromFile fails and closes f: the hand-over needs Linux.
func ListenerFromFile(f *os.File) (*net.TCPListener, error) {
	_ = forward.TCPState{Listener: f}.Close()
	return nil, fmt.Errorf("TCP listener from file: %w", forward.ErrNotSupported)
}
