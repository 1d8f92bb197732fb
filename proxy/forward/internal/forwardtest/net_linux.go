package forwardtest

import (
	"net/netip"
	"testing"

	"golang.org/x/sys/unix"
)

// ClosedTCPPort returns a loopback address where nothing listens.
//
// The port stays bound (not listening, without SO_REUSEADDR) until the test ends: connections
// to it are refused, nobody else can take it, and the kernel cannot pick it as the source port
// of a dial to it, which would connect a socket to itself on loopback.
func ClosedTCPPort(t testing.TB, addr netip.Addr) netip.AddrPort {
	t.Helper()
	family, sa := unix.AF_INET, unix.Sockaddr(&unix.SockaddrInet4{Addr: addr.As4()})
	if addr.Is6() && !addr.Is4In6() {
		family, sa = unix.AF_INET6, &unix.SockaddrInet6{Addr: addr.As16()}
	}
	fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Bind(fd, sa); err != nil {
		t.Fatal(err)
	}
	bound, err := unix.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	switch b := bound.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(addr, uint16(b.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(addr, uint16(b.Port))
	}
	t.Fatalf("unexpected socket address %T", bound)
	return netip.AddrPort{}
}
