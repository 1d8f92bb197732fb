package sys

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"

	"golang.org/x/sys/unix"
)

// ErrTransparentSetup marks a failure to make a socket transparent or to bind it to the client's
// address: our own capability or configuration, not the endpoint's fault.
var ErrTransparentSetup = errors.New("cannot send from the client's address")

// transparentControl returns a net.Dialer Control function that sets IP_TRANSPARENT
// (IPV6_TRANSPARENT) on the socket before it is bound. Its failure wraps ErrTransparentSetup.
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
			return fmt.Errorf("%w: set IP_TRANSPARENT: %w", ErrTransparentSetup, err)
		}
		return nil
	}
}

// CanDialFrom reports whether a socket to ep can be bound to client's address: both of the same
// IP family.
func CanDialFrom(client netip.Addr, ep netip.AddrPort) bool {
	return client.IsValid() && client.Unmap().Is4() == ep.Addr().Unmap().Is4()
}

// IsTransparentSetupError reports whether a transparent dial failed before reaching the
// endpoint: the socket option was refused (no CAP_NET_ADMIN) or the bind to the client's address
// failed.
func IsTransparentSetupError(err error) bool {
	if errors.Is(err, ErrTransparentSetup) {
		return true
	}
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "bind" {
		return true
	}
	return errors.Is(err, syscall.EADDRNOTAVAIL)
}

// DialUDPFrom opens a UDP socket bound to client's IP (any port) with IP_TRANSPARENT and
// connects it to ep.
func DialUDPFrom(client netip.Addr, ep netip.AddrPort) (*net.UDPConn, error) {
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
