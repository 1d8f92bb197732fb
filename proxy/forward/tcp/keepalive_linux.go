package tcp

import (
	"context"
	"fmt"
	"net"
	"syscall"
	"time"
)

// TCP keepalive of proxied connections. Each side of a connection has its own: a proxied
// connection whose client or endpoint vanished without a FIN or RST (its node lost power, a
// cable was cut) would otherwise hold two descriptors forever.
//
// Socket options cost a system call each, on every connection, so the client side's are set
// once, on the listening socket: Linux copies SO_KEEPALIVE, the TCP_KEEP* settings and
// TCP_NODELAY to every socket accept(2) returns that was set up after them. The endpoint side sets SO_KEEPALIVE and TCP_KEEPIDLE per dial and
// leaves the probe interval and count at the kernel's (net.ipv4.tcp_keepalive_intvl, _probes).
const (
	keepAliveIdle     = 15 * time.Second // Go's default, as kube-proxy's userspace mode had it
	keepAliveInterval = 15 * time.Second
	keepAliveCount    = 9
)

// Listen opens a TCP listener for a Proxy at laddr ("tcp4" or "tcp6" network): the
// sockets it accepts inherit the proxy's keepalive settings and TCP_NODELAY from it, so that
// accepting costs no socket-option calls for them.
func Listen(network string, laddr *net.TCPAddr) (*net.TCPListener, error) {
	lc := net.ListenConfig{KeepAlive: -1, Control: listenerKeepAlive}
	ln, err := lc.Listen(context.Background(), network, laddr.String())
	if err != nil {
		return nil, err
	}
	return ln.(*net.TCPListener), nil
}

// listenerKeepAlive sets the keepalive options and TCP_NODELAY on a listening socket before it
// binds.
func listenerKeepAlive(_, _ string, rc syscall.RawConn) error {
	var serr error
	err := rc.Control(func(fd uintptr) {
		for _, o := range []struct {
			level, opt, value int
			name              string
		}{
			{syscall.SOL_SOCKET, syscall.SO_KEEPALIVE, 1, "SO_KEEPALIVE"},
			{syscall.IPPROTO_TCP, syscall.TCP_KEEPIDLE, int(keepAliveIdle / time.Second), "TCP_KEEPIDLE"},
			{syscall.IPPROTO_TCP, syscall.TCP_KEEPINTVL, int(keepAliveInterval / time.Second), "TCP_KEEPINTVL"},
			{syscall.IPPROTO_TCP, syscall.TCP_KEEPCNT, keepAliveCount, "TCP_KEEPCNT"},
			{syscall.IPPROTO_TCP, syscall.TCP_NODELAY, 1, "TCP_NODELAY"},
		} {
			if err := syscall.SetsockoptInt(int(fd), o.level, o.opt, o.value); err != nil {
				serr = fmt.Errorf("set %s on listening socket: %w", o.name, err)
				return
			}
		}
	})
	if err != nil {
		return err
	}
	return serr
}
