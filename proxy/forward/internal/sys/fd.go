package sys

import (
	"net/netip"
	"syscall"
)

// FD returns the descriptor of a socket (or of an *os.File, without Fd(), which would put
// it into blocking mode); it stays valid until the socket is closed.
func FD(sc syscall.Conn) (int, error) {
	rc, err := sc.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	if err := rc.Control(func(s uintptr) { fd = int(s) }); err != nil {
		return -1, err
	}
	return fd, nil
}

// UnmapAddrPort returns ap with an IPv4-mapped IPv6 address turned into IPv4.
func UnmapAddrPort(ap netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}
