package tcp

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/runstate"
	"golang.org/x/sys/unix"
)

// Freeze stops the proxy for a hand-over and exports its sockets (see TCPState). It stops
// accepting without closing the listening socket, lets connections still dialling finish their
// dial (when ctx ends first, their dials are abandoned and they are exported undialled), stops
// every connection where it stands, and returns duplicates of every socket with the bytes in
// flight. Connections that end meanwhile end as usual. Serve returns nil.
//
// After Freeze the proxy serves nothing and holds its own descriptors until Release (or Close,
// or Shutdown, which release a frozen proxy). Freeze fails on a closed or frozen proxy. When
// duplicating a socket fails (out of descriptors: a hand-over needs one more per socket for a
// while), it returns the error, closes the duplicates it made and the proxy stays frozen.
func (p *Proxy) Freeze(ctx context.Context) (forward.TCPState, error) {
	if err := p.run.Freeze("TCP proxy", p.detachFromLoop); err != nil {
		return forward.TCPState{}, err
	}
	p.mu.Lock()
	p.freezing = true
	p.mu.Unlock()
	p.freezeLoopConns(ctx)
	return p.export()
}

// Thaw undoes a Freeze that no Release followed (the hand-over failed): the proxy serves again
// on its own sockets, without a descriptor more. Every frozen connection relays on where it
// stopped (its pending bytes first; one frozen undialled is dialled now). Call Serve again.
// What Freeze exported is the caller's to close. Thaw fails on a proxy that is not frozen or
// was released.
func (p *Proxy) Thaw() error {
	if !p.run.Thaw() {
		return errors.New("thaw TCP proxy: not frozen, or released")
	}
	p.thawLoopConns()
	p.mu.Lock()
	p.freezing = false
	p.mu.Unlock()
	return nil
}

// export duplicates the listening socket and the sockets of every frozen connection.
func (p *Proxy) export() (forward.TCPState, error) {
	var st forward.TCPState
	if p.Listener != nil {
		f, err := p.Listener.File()
		if err != nil {
			return forward.TCPState{}, fmt.Errorf("freeze TCP proxy: duplicate the listening socket: %w", err)
		}
		st.Listener = f
	}
	if err := p.exportLoopConns(&st); err != nil {
		_ = st.Close()
		return forward.TCPState{}, fmt.Errorf("freeze TCP proxy: %w", err)
	}
	return st, nil
}

// Release closes a frozen proxy's own descriptors (its listening socket, the sockets of its
// frozen connections, its idle pipes) without touching the sockets: no FIN, no RST, since the
// exported duplicates keep them open. It returns their descriptors to the Budget, reports
// nothing closed or failed (see HandoverMetrics), and returns once every goroutine of the proxy
// has ended. It does nothing on a proxy that is not frozen, or was released before.
func (p *Proxy) Release() {
	if !p.run.Release() {
		return
	}
	p.releaseLoopConns()
	p.connWG.Wait() // every connection has stopped or ended
	if p.Listener != nil {
		_ = p.Listener.Close()
	}
	p.pipes.closeAll()
}

// Adopt takes over connections exported by Freeze (of this process or another one), before or
// after Serve. For each one it writes the pending bytes first, in order, leaves a direction that
// was done half-closed, then relays as usual: IdleTimeout applies (its clock starts afresh),
// Shutdown cuts adopted connections too, and each counts in MaxConns and the Budget (adopted
// connections are never refused: they were admitted before; new ones wait for room). A
// connection exported undialled is dialled as if just accepted, which needs the Chooser.
// Metrics sees each as accepted.
//
// Adopt owns the files from the call on: it closes them, or keeps the sockets as connections.
// A connection that cannot be adopted is closed and reported in the joined error; the others
// go on. It fails for all of them on a closed or frozen proxy.
func (p *Proxy) Adopt(conns []forward.TCPConnState) error {
	if closed, frozen := p.run.Status(); closed || frozen {
		for _, c := range conns {
			_ = c.Close()
		}
		return fmt.Errorf("adopt TCP connections: %w", runstate.Err(closed, frozen))
	}
	var errs []error
	for i := range conns {
		if err := p.adoptConn(conns[i]); err != nil {
			errs = append(errs, fmt.Errorf("adopt TCP connection from %s to %s: %w", conns[i].ClientAddr, conns[i].Endpoint, err))
		}
	}
	return errors.Join(errs...)
}

// adoptConn starts one adopted connection.
func (p *Proxy) adoptConn(cs forward.TCPConnState) error {
	if p.Loops == nil {
		_ = cs.Close()
		return errors.New("adopting needs the proxy's Loops")
	}
	return p.adoptOnLoop(cs)
}

// endedSocket reports whether fd, not connected, is the socket of a connection that ended since
// it was frozen (both FINs crossed: the kernel moved the connection to TIME_WAIT; or it was
// reset): closed, not listening, and it has received segments (a socket never connected has
// none). Such a socket is adopted too: it still holds what the peer sent before its FIN, then
// the EOF (or the reset), which the relay passes on as it would have without the hand-over.
func endedSocket(fd int) bool {
	info, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
	if err != nil {
		return false
	}
	listening, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN)
	return err == nil && listening == 0 && info.State == tcpClose && info.Segs_in > 0
}

// tcpClose is the kernel's TCP_CLOSE state (include/net/tcp_states.h).
const tcpClose = 7

// ListenerFromFile turns a received listening socket (TCPState.Listener) back into what
// Proxy.Listener needs, taking ownership of f. It sets the keepalive options Listen sets,
// so that a socket from an older process gets them too.
func ListenerFromFile(f *os.File) (*net.TCPListener, error) {
	if f == nil {
		return nil, errors.New("TCP listener from file: no file")
	}
	defer f.Close()
	ln, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("TCP listener from file %s: %w", f.Name(), err)
	}
	tl, ok := ln.(*net.TCPListener)
	if !ok {
		_ = ln.Close()
		return nil, fmt.Errorf("TCP listener from file %s: not a TCP socket (%T)", f.Name(), ln)
	}
	if err := checkListening(tl); err != nil {
		_ = tl.Close()
		return nil, fmt.Errorf("TCP listener from file %s: %w", f.Name(), err)
	}
	return tl, nil
}

// checkListening fails unless the socket listens, and sets Listen's keepalive options.
func checkListening(tl *net.TCPListener) error {
	rc, err := tl.SyscallConn()
	if err != nil {
		return err
	}
	var acc int
	var gerr error
	if err := rc.Control(func(fd uintptr) {
		acc, gerr = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_ACCEPTCONN)
	}); err != nil {
		return err
	}
	if gerr != nil {
		return fmt.Errorf("getsockopt SO_ACCEPTCONN: %w", gerr)
	}
	if acc == 0 {
		return errors.New("the socket does not listen")
	}
	return listenerKeepAlive("", "", rc)
}
