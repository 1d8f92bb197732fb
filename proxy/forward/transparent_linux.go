package forward

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"
	"syscall"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// errTransparentSetup marks a failure to make a socket transparent or to bind it to the client's
// address: our own capability or configuration, not the endpoint's fault.
var errTransparentSetup = errors.New("cannot send from the client's address")

// transparentControl returns a net.Dialer Control function that sets IP_TRANSPARENT
// (IPV6_TRANSPARENT) on the socket before it is bound. Its failure wraps errTransparentSetup.
func transparentControl(ipv6 bool) func(network, address string, c syscall.RawConn) error {
	return func(_, _ string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			if ipv6 {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
			} else {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1)
			}
		})
		if err == nil {
			err = serr
		}
		if err != nil {
			return fmt.Errorf("%w: set IP_TRANSPARENT: %w", errTransparentSetup, err)
		}
		return nil
	}
}

// canDialFrom reports whether a socket to ep can be bound to client's address: both of the same
// IP family.
func canDialFrom(client netip.Addr, ep netip.AddrPort) bool {
	return client.IsValid() && client.Unmap().Is4() == ep.Addr().Unmap().Is4()
}

// isTransparentSetupError reports whether a transparent dial failed before reaching the
// endpoint: the socket option was refused (no CAP_NET_ADMIN) or the bind to the client's address
// failed.
func isTransparentSetupError(err error) bool {
	if errors.Is(err, errTransparentSetup) {
		return true
	}
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "bind" {
		return true
	}
	return errors.Is(err, syscall.EADDRNOTAVAIL)
}

// dialUDPFrom opens a UDP socket bound to client's IP (any port) with IP_TRANSPARENT and
// connects it to ep.
func dialUDPFrom(client netip.Addr, ep netip.AddrPort) (*net.UDPConn, error) {
	client = client.Unmap()
	d := net.Dialer{
		LocalAddr: &net.UDPAddr{IP: client.AsSlice()},
		Control:   transparentControl(!client.Is4()),
	}
	network := "udp4"
	if !client.Is4() {
		network = "udp6"
	}
	c, err := d.Dial(network, ep.String())
	if err != nil {
		return nil, err
	}
	return c.(*net.UDPConn), nil
}

// logTransparentFallback logs that a transparent socket could not be set up and a plain one is
// used instead: at warning level the first time for a proxy (warned), at debug level after.
func logTransparentFallback(log *zerolog.Logger, scope LogScope, warned *atomic.Bool, err error, client, ep netip.AddrPort) {
	e := log.Debug()
	if warned.CompareAndSwap(false, true) {
		e = log.Warn()
	}
	scoped(scope, e).Err(err).Stringer("client", client).Stringer("endpoint", ep).
		Msg("cannot connect from the client's address (needs CAP_NET_ADMIN); connecting from the node's instead (logged once at warning level)")
}
