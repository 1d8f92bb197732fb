package userspace

import (
	"fmt"
	"io"
	"net/netip"
	"os"
	"syscall"
)

// bindTCP holds a TCP port with a socket that is bound but never listens: no other process can
// bind the port, and a connection that reaches it (one the portal rules did not redirect, say to
// an address --nodeport-addresses leaves out) is refused with a reset instead of completing a
// handshake nobody will serve. An unspecified address binds both families.
func bindTCP(ap netip.AddrPort) (io.Closer, error) {
	family, sa := syscall.AF_INET6, syscall.Sockaddr(&syscall.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()})
	if ap.Addr().Is4() {
		family, sa = syscall.AF_INET, &syscall.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	}
	fd, err := syscall.Socket(family, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	if family == syscall.AF_INET6 && ap.Addr().IsUnspecified() {
		_ = syscall.SetsockoptInt(fd, syscall.IPPROTO_IPV6, syscall.IPV6_V6ONLY, 0)
	}
	if err := syscall.Bind(fd, sa); err != nil {
		_ = syscall.Close(fd)
		return nil, fmt.Errorf("hold tcp %s: %w", ap, os.NewSyscallError("bind", err))
	}
	return os.NewFile(uintptr(fd), "held tcp "+ap.String()), nil
}

// resetFile closes a TCP socket with a reset (SO_LINGER 0), so that its peer learns at once.
func resetFile(f *os.File) {
	if f == nil {
		return
	}
	if rc, err := f.SyscallConn(); err == nil { // not f.Fd(), which makes the socket blocking
		_ = rc.Control(func(fd uintptr) {
			_ = syscall.SetsockoptLinger(int(fd), syscall.SOL_SOCKET, syscall.SO_LINGER, &syscall.Linger{Onoff: 1, Linger: 0})
		})
	}
	_ = f.Close()
}
