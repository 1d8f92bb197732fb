package userspace

import (
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
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

// checkProxySocket checks that f is a socket this proxier could have opened as a proxy port's:
// a listening TCP socket or an unconnected UDP socket of proto, bound to want (an unspecified
// address: either family's, as Go binds it), in this process's network namespace.
func checkProxySocket(f *os.File, proto v1.Protocol, want netip.AddrPort) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	ownCookie, err := netnsCookie()
	if err != nil {
		return err
	}
	var cerr error
	if err := rc.Control(func(u uintptr) { cerr = checkProxyFD(int(u), proto, want, ownCookie) }); err != nil {
		return err
	}
	return cerr
}

func checkProxyFD(fd int, proto v1.Protocol, want netip.AddrPort, ownCookie uint64) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return os.NewSyscallError("fstat", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return fmt.Errorf("not a socket (mode %#o)", st.Mode)
	}
	typ, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE)
	if err != nil {
		return os.NewSyscallError("getsockopt SO_TYPE", err)
	}
	wantType := unix.SOCK_STREAM
	if proto == v1.ProtocolUDP {
		wantType = unix.SOCK_DGRAM
	}
	if typ != wantType {
		return fmt.Errorf("socket type %d, want %d for %s", typ, wantType, proto)
	}
	if cookie, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE); err != nil {
		return os.NewSyscallError("getsockopt SO_NETNS_COOKIE", err)
	} else if cookie != ownCookie {
		return fmt.Errorf("a socket of another network namespace (cookie %d, ours %d)", cookie, ownCookie)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return os.NewSyscallError("getsockname", err)
	}
	var got netip.AddrPort
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		got = netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port))
	case *unix.SockaddrInet6:
		got = netip.AddrPortFrom(netip.AddrFrom16(a.Addr), uint16(a.Port))
	default:
		return fmt.Errorf("bound to a %T, not an IP address", sa)
	}
	if got != want && !(want.Addr().IsUnspecified() && got.Addr().IsUnspecified() && got.Port() == want.Port()) {
		return fmt.Errorf("bound to %s, want %s", got, want)
	}
	switch proto {
	case v1.ProtocolTCP:
		acc, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ACCEPTCONN)
		if err != nil {
			return os.NewSyscallError("getsockopt SO_ACCEPTCONN", err)
		}
		if acc == 0 {
			return errors.New("the socket does not listen")
		}
	case v1.ProtocolUDP:
		if _, err := unix.Getpeername(fd); err == nil {
			return errors.New("the UDP socket is connected")
		}
	}
	return nil
}

var ownNetnsCookie struct {
	once   sync.Once
	cookie uint64
	err    error
}

// netnsCookie returns this process's network namespace cookie (SO_NETNS_COOKIE of a socket
// of its own).
func netnsCookie() (uint64, error) {
	c := &ownNetnsCookie
	c.once.Do(func() {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			c.err = os.NewSyscallError("socket", err)
			return
		}
		defer unix.Close(fd)
		c.cookie, err = unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_NETNS_COOKIE)
		if err != nil {
			c.err = os.NewSyscallError("getsockopt SO_NETNS_COOKIE", err)
		}
	})
	return c.cookie, c.err
}
