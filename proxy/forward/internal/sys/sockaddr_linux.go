package sys

import (
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// EncodeSockaddr encodes ap as the struct sockaddr_in (a 4-byte address) or sockaddr_in6 (a
// 16-byte one, IPv4-mapped included) that sendmsg(2) takes. A zone is the scope: an interface
// index, or an interface name resolved now. It returns nil for an invalid ap.
func EncodeSockaddr(ap netip.AddrPort) []byte {
	addr := ap.Addr()
	switch {
	case addr.Is4():
		sa := &unix.RawSockaddrInet4{Family: unix.AF_INET, Addr: addr.As4()}
		putPort(&sa.Port, ap.Port())
		return unsafe.Slice((*byte)(unsafe.Pointer(sa)), unix.SizeofSockaddrInet4)
	case addr.Is6():
		sa := &unix.RawSockaddrInet6{Family: unix.AF_INET6, Addr: addr.As16(), Scope_id: zoneIndex(addr.Zone())}
		putPort(&sa.Port, ap.Port())
		return unsafe.Slice((*byte)(unsafe.Pointer(sa)), unix.SizeofSockaddrInet6)
	}
	return nil
}

// putPort stores port in network byte order.
func putPort(p *uint16, port uint16) {
	b := (*[2]byte)(unsafe.Pointer(p))
	b[0], b[1] = byte(port>>8), byte(port)
}

// zoneIndex returns the interface index an IPv6 zone names (a number, as udpBatch.source writes
// it, or an interface name), or 0.
func zoneIndex(zone string) uint32 {
	if zone == "" {
		return 0
	}
	if n, err := strconv.ParseUint(zone, 10, 32); err == nil {
		return uint32(n)
	}
	if ifi, err := net.InterfaceByName(zone); err == nil {
		return uint32(ifi.Index)
	}
	return 0
}

// RawAddrPort decodes accept4's address (unmapped); the zero AddrPort for another family.
func RawAddrPort(sa *unix.RawSockaddrAny) netip.AddrPort {
	switch sa.Addr.Family {
	case unix.AF_INET:
		in := (*unix.RawSockaddrInet4)(unsafe.Pointer(sa))
		return netip.AddrPortFrom(netip.AddrFrom4(in.Addr), ntohs(in.Port))
	case unix.AF_INET6:
		in := (*unix.RawSockaddrInet6)(unsafe.Pointer(sa))
		return UnmapAddrPort(netip.AddrPortFrom(netip.AddrFrom16(in.Addr), ntohs(in.Port)))
	}
	return netip.AddrPort{}
}

// ntohs turns a port in network byte order, as the kernel stores it, into a number.
func ntohs(p uint16) uint16 {
	b := (*[2]byte)(unsafe.Pointer(&p))
	return uint16(b[0])<<8 | uint16(b[1])
}

// LocalAddr returns a socket's local address (unmapped), or the zero AddrPort. The system
// call itself: x/sys/unix's Getsockname asks for SO_PROTOCOL too, to parse the address.
func LocalAddr(fd int) netip.AddrPort {
	var sa unix.RawSockaddrAny
	saLen := uint32(unix.SizeofSockaddrAny)
	_, _, errno := syscall.RawSyscall(syscall.SYS_GETSOCKNAME, uintptr(fd), uintptr(unsafe.Pointer(&sa)), uintptr(unsafe.Pointer(&saLen)))
	if errno != 0 {
		return netip.AddrPort{}
	}
	return RawAddrPort(&sa)
}

// SockaddrAddrPort converts an IPv4 or IPv6 socket address (unmapped); the zero AddrPort for
// another kind.
func SockaddrAddrPort(sa unix.Sockaddr) netip.AddrPort {
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port))
	case *unix.SockaddrInet6:
		return UnmapAddrPort(netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), uint16(sa.Port)))
	}
	return netip.AddrPort{}
}

// DupFile duplicates fd into an *os.File (close-on-exec), for a hand-over.
func DupFile(fd int, name string) (*os.File, error) {
	nfd, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("duplicate the %s socket: %w", name, err)
	}
	return os.NewFile(uintptr(nfd), name), nil
}

// FDFromFile takes a duplicate of f's descriptor, non-blocking, and closes f.
func FDFromFile(f *os.File, what string) (int, error) {
	if f == nil {
		return -1, fmt.Errorf("no %s socket", what)
	}
	defer f.Close()
	rc, err := f.SyscallConn()
	if err != nil {
		return -1, fmt.Errorf("%s socket: %w", what, err)
	}
	fd := -1
	var derr error
	if err := rc.Control(func(s uintptr) { fd, derr = unix.FcntlInt(s, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return -1, fmt.Errorf("%s socket: %w", what, err)
	}
	if derr != nil {
		return -1, fmt.Errorf("duplicate the %s socket: %w", what, derr)
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		_ = unix.Close(fd)
		return -1, fmt.Errorf("%s socket: set non-blocking: %w", what, err)
	}
	return fd, nil
}
