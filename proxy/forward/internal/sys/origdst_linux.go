package sys

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Socket options that read the pre-NAT destination from conntrack: SO_ORIGINAL_DST
// (linux/netfilter_ipv4.h) at SOL_IP and IP6T_SO_ORIGINAL_DST (linux/netfilter_ipv6/ip6_tables.h)
// at SOL_IPV6. golang.org/x/sys/unix does not name them.
const (
	soOriginalDst     = 80
	ip6tSoOriginalDst = 80
)

// OriginalDst returns the destination of the connection of socket fd before the portal's
// REDIRECT/DNAT, or the zero AddrPort when it is unknown: conntrack is not loaded
// (ENOPROTOOPT), the connection has no conntrack entry (ENOENT), or it was not NATed (conntrack
// then returns the local address).
func OriginalDst(fd int) netip.AddrPort {
	local := LocalAddr(fd)
	if !local.IsValid() {
		return netip.AddrPort{}
	}
	level, opt := unix.SOL_IP, soOriginalDst // see tcpOriginalDst
	if local.Addr().Is6() {
		level, opt = unix.SOL_IPV6, ip6tSoOriginalDst
	}
	dst, err := getsockoptSockaddr(fd, level, opt)
	if err != nil {
		return netip.AddrPort{}
	}
	if dst = UnmapAddrPort(dst); dst == local {
		return netip.AddrPort{}
	}
	return dst
}

// getsockoptSockaddr reads a socket option whose value is a struct sockaddr_in or sockaddr_in6.
func getsockoptSockaddr(fd, level, opt int) (netip.AddrPort, error) {
	var buf [unix.SizeofSockaddrAny]byte
	size := uint32(len(buf))
	_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt),
		uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&size)), 0)
	if errno != 0 {
		return netip.AddrPort{}, errno
	}
	if int(size) > len(buf) {
		return netip.AddrPort{}, fmt.Errorf("getsockopt(%d, %d): %d-byte value", level, opt, size)
	}
	ap, ok := ParseSockaddr(buf[:size])
	if !ok {
		return netip.AddrPort{}, fmt.Errorf("getsockopt(%d, %d): not a sockaddr_in/sockaddr_in6", level, opt)
	}
	return ap, nil
}

// ParseSockaddr decodes a struct sockaddr_in or sockaddr_in6 (family in host byte order, port in
// network byte order).
func ParseSockaddr(b []byte) (netip.AddrPort, bool) {
	if len(b) < 2 {
		return netip.AddrPort{}, false
	}
	switch binary.NativeEndian.Uint16(b) {
	case unix.AF_INET:
		if len(b) < 8 { // family, port, address; sin_zero may be cut
			return netip.AddrPort{}, false
		}
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte(b[4:8])), binary.BigEndian.Uint16(b[2:4])), true
	case unix.AF_INET6:
		if len(b) < 24 { // family, port, flowinfo, address; scope id may be cut
			return netip.AddrPort{}, false
		}
		return netip.AddrPortFrom(netip.AddrFrom16([16]byte(b[8:24])), binary.BigEndian.Uint16(b[2:4])), true
	}
	return netip.AddrPort{}, false
}

// OrigDstOOBSize is enough out-of-band space for one IP_ORIGDSTADDR or IPV6_ORIGDSTADDR message,
// with room to spare.
var OrigDstOOBSize = 2 * unix.CmsgSpace(unix.SizeofSockaddrInet6)

// EnableOrigDst asks the kernel to attach to every datagram received on conn the destination
// address and port in its headers (IP_RECVORIGDSTADDR; IPV6_RECVORIGDSTADDR on AF_INET6
// sockets, whose IPv4 clients arrive as mapped addresses and need the IPv4 option too). Despite
// the name, after REDIRECT/DNAT this is the NATed destination, the proxy's own address: the
// original one comes from conntrack (conntrackConn). The proxy needs it for that lookup, and to
// send replies from exactly the address the client's datagram reached.
func EnableOrigDst(conn *net.UDPConn) error {
	rc, err := conn.SyscallConn()
	if err != nil {
		return fmt.Errorf("enable IP_RECVORIGDSTADDR: %w", err)
	}
	var serr error
	cerr := rc.Control(func(fd uintptr) {
		domain, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_DOMAIN)
		if err != nil {
			serr = fmt.Errorf("getsockopt SO_DOMAIN: %w", err)
			return
		}
		if domain == unix.AF_INET6 {
			if err := unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_RECVORIGDSTADDR, 1); err != nil {
				serr = fmt.Errorf("setsockopt IPV6_RECVORIGDSTADDR: %w", err)
				return
			}
		}
		if err := unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_RECVORIGDSTADDR, 1); err != nil && domain == unix.AF_INET {
			// On an IPv6-only socket the IPv4 option is useless; only IPv4 sockets need it.
			serr = fmt.Errorf("setsockopt IP_RECVORIGDSTADDR: %w", err)
		}
	})
	if cerr != nil {
		return fmt.Errorf("enable IP_RECVORIGDSTADDR: %w", cerr)
	}
	return serr
}

// SourceAddrOOB returns the control message that makes sendmsg(2) use src as the source address
// (IP_PKTINFO / IPV6_PKTINFO with no interface), or nil for an invalid src. IP_PKTINFO also
// serves IPv4-mapped destinations on an AF_INET6 socket (ip_cmsg_send handles SOL_IP there).
func SourceAddrOOB(src netip.Addr) []byte {
	src = src.Unmap()
	switch {
	case src.Is4():
		var info [unix.SizeofInet4Pktinfo]byte // ifindex, spec_dst, addr
		a := src.As4()
		copy(info[4:8], a[:])
		return AppendCmsg(nil, unix.SOL_IP, unix.IP_PKTINFO, info[:])
	case src.Is6():
		var info [unix.SizeofInet6Pktinfo]byte // addr, ifindex
		a := src.As16()
		copy(info[:16], a[:])
		return AppendCmsg(nil, unix.SOL_IPV6, unix.IPV6_PKTINFO, info[:])
	}
	return nil
}

// AppendCmsg appends one control message, padded to the control message alignment.
func AppendCmsg(b []byte, level, typ int, data []byte) []byte {
	start := len(b)
	b = append(b, make([]byte, unix.CmsgSpace(len(data)))...)
	m := b[start:]
	if unix.SizeofPtr == 8 {
		binary.NativeEndian.PutUint64(m, uint64(unix.CmsgLen(len(data))))
	} else {
		binary.NativeEndian.PutUint32(m, uint32(unix.CmsgLen(len(data))))
	}
	binary.NativeEndian.PutUint32(m[unix.SizeofPtr:], uint32(level))
	binary.NativeEndian.PutUint32(m[unix.SizeofPtr+4:], uint32(typ))
	copy(m[unix.CmsgLen(0):], data)
	return b
}

// OrigDstFromOOB returns the address of the first IP_ORIGDSTADDR or IPV6_ORIGDSTADDR control
// message in oob (as filled by recvmsg), unmapped, or the zero AddrPort. It does not allocate.
func OrigDstFromOOB(oob []byte) netip.AddrPort {
	hdrSpace := unix.CmsgLen(0) // the header, aligned: where the data starts
	for len(oob) >= hdrSpace {
		var msgLen uint64
		if unix.SizeofPtr == 8 {
			msgLen = binary.NativeEndian.Uint64(oob)
		} else {
			msgLen = uint64(binary.NativeEndian.Uint32(oob))
		}
		if msgLen < uint64(hdrSpace) || msgLen > uint64(len(oob)) {
			return netip.AddrPort{}
		}
		level := int32(binary.NativeEndian.Uint32(oob[unix.SizeofPtr:]))
		typ := int32(binary.NativeEndian.Uint32(oob[unix.SizeofPtr+4:]))
		if (level == unix.SOL_IP && typ == unix.IP_ORIGDSTADDR) || (level == unix.SOL_IPV6 && typ == unix.IPV6_ORIGDSTADDR) {
			if ap, ok := ParseSockaddr(oob[hdrSpace:msgLen]); ok {
				return UnmapAddrPort(ap)
			}
		}
		next := unix.CmsgSpace(int(msgLen) - hdrSpace) // msgLen rounded up to the alignment
		if next >= len(oob) {
			return netip.AddrPort{}
		}
		oob = oob[next:]
	}
	return netip.AddrPort{}
}
