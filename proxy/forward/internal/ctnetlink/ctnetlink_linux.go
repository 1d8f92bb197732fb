package ctnetlink

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/sys"
	"golang.org/x/sys/unix"
)

// UDP has no SO_ORIGINAL_DST, and IP_ORIGDSTADDR reports the destination in the IP header, which
// for a REDIRECTed or DNATed datagram is the proxy's own address (it is the pre-mangling address
// only under TPROXY). So for UDP the proxy asks conntrack itself, over ctnetlink, once per new
// session: "which flow has the reply tuple proxy-address → client?", and reads the original
// destination from the answer.

// ctnetlink attribute and message numbers (linux/netfilter/nfnetlink_conntrack.h), which
// golang.org/x/sys/unix does not name.
const (
	ipctnlMsgCtNew = 0
	ipctnlMsgCtGet = 1

	ctaTupleOrig  = 1
	ctaTupleReply = 2

	ctaTupleIP    = 1
	ctaTupleProto = 2

	ctaIPv4Src = 1
	ctaIPv4Dst = 2
	ctaIPv6Src = 3
	ctaIPv6Dst = 4

	ctaProtoNum     = 1
	ctaProtoSrcPort = 2
	ctaProtoDstPort = 3

	nlaTypeMask = ^uint16(unix.NLA_F_NESTED | unix.NLA_F_NET_BYTEORDER)

	// conntrackTimeout bounds the wait for the kernel's answer, which normally comes at once.
	conntrackTimeout = 100 * time.Millisecond
)

// Conn is a ctnetlink socket for looking up original destinations. It is not safe for
// concurrent use: the UDP read loop owns it.
type Conn struct {
	fd  int
	seq uint32
	buf []byte
}

// Open opens a ctnetlink socket in the process's network namespace. It fails without
// CAP_NET_ADMIN or when the kernel lacks nf_conntrack_netlink.
func Open() (*Conn, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
	if err != nil {
		return nil, fmt.Errorf("open ctnetlink socket: %w", err)
	}
	tv := unix.NsecToTimeval(int64(conntrackTimeout))
	if err := unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("set ctnetlink receive timeout: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("bind ctnetlink socket: %w", err)
	}
	return &Conn{fd: fd, buf: make([]byte, 8192)}, nil
}

func (c *Conn) Close() error { return unix.Close(c.fd) }

// OriginalDst returns the original destination of the conntrack flow of protocol proto whose
// replies go from local (the proxy's address the datagram arrived at, after NAT) to client. It
// returns an error wrapping unix.ENOENT when there is no such flow.
func (c *Conn) OriginalDst(proto uint8, client, local netip.AddrPort) (netip.AddrPort, error) {
	client, local = sys.UnmapAddrPort(client), sys.UnmapAddrPort(local)
	if client.Addr().Is4() != local.Addr().Is4() {
		return netip.AddrPort{}, fmt.Errorf("conntrack lookup %s→%s: mixed address families", local, client)
	}
	c.seq++
	req := conntrackGetRequest(c.seq, proto, local, client)
	if err := unix.Sendto(c.fd, req, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return netip.AddrPort{}, fmt.Errorf("conntrack lookup: send: %w", err)
	}
	for {
		n, _, err := unix.Recvfrom(c.fd, c.buf, 0)
		if err != nil {
			return netip.AddrPort{}, fmt.Errorf("conntrack lookup: receive: %w", err)
		}
		dst, seq, err := parseConntrackReply(c.buf[:n])
		if seq != c.seq {
			continue // the answer to an earlier request that timed out
		}
		return dst, err
	}
}

// conntrackGetRequest builds an IPCTNL_MSG_CT_GET request for the flow with the given reply
// tuple (src → dst).
func conntrackGetRequest(seq uint32, proto uint8, src, dst netip.AddrPort) []byte {
	family, srcType, dstType := uint8(unix.AF_INET), uint16(ctaIPv4Src), uint16(ctaIPv4Dst)
	if src.Addr().Is6() {
		family, srcType, dstType = unix.AF_INET6, ctaIPv6Src, ctaIPv6Dst
	}
	b := make([]byte, unix.NLMSG_HDRLEN, 128)
	b = append(b, family, unix.NFNETLINK_V0, 0, 0) // struct nfgenmsg; res_id 0
	tuple := nestStart(&b, ctaTupleReply)
	ip := nestStart(&b, ctaTupleIP)
	b = appendAttr(b, srcType, src.Addr().AsSlice())
	b = appendAttr(b, dstType, dst.Addr().AsSlice())
	nestEnd(b, ip)
	pr := nestStart(&b, ctaTupleProto)
	b = appendAttr(b, ctaProtoNum, []byte{proto})
	b = appendAttr(b, ctaProtoSrcPort, binary.BigEndian.AppendUint16(nil, src.Port()))
	b = appendAttr(b, ctaProtoDstPort, binary.BigEndian.AppendUint16(nil, dst.Port()))
	nestEnd(b, pr)
	nestEnd(b, tuple)

	binary.NativeEndian.PutUint32(b[0:], uint32(len(b)))
	binary.NativeEndian.PutUint16(b[4:], unix.NFNL_SUBSYS_CTNETLINK<<8|ipctnlMsgCtGet)
	binary.NativeEndian.PutUint16(b[6:], unix.NLM_F_REQUEST)
	binary.NativeEndian.PutUint32(b[8:], seq)
	binary.NativeEndian.PutUint32(b[12:], 0) // to the kernel
	return b
}

func nlaAlign(n int) int { return (n + unix.NLA_ALIGNTO - 1) &^ (unix.NLA_ALIGNTO - 1) }

// appendAttr appends one netlink attribute, padded to the attribute alignment.
func appendAttr(b []byte, typ uint16, data []byte) []byte {
	b = binary.NativeEndian.AppendUint16(b, uint16(unix.NLA_HDRLEN+len(data)))
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = append(b, data...)
	for len(b) != nlaAlign(len(b)) {
		b = append(b, 0)
	}
	return b
}

// nestStart appends the header of a nested attribute and returns its offset for nestEnd.
func nestStart(b *[]byte, typ uint16) int {
	off := len(*b)
	*b = binary.NativeEndian.AppendUint16(*b, 0)
	*b = binary.NativeEndian.AppendUint16(*b, typ|unix.NLA_F_NESTED)
	return off
}

// nestEnd sets the length of the nested attribute started at off.
func nestEnd(b []byte, off int) {
	binary.NativeEndian.PutUint16(b[off:], uint16(len(b)-off))
}

// parseConntrackReply decodes the kernel's answer to a CT_GET request: the original tuple's
// destination, or the error the kernel reported. It also returns the message's sequence number.
func parseConntrackReply(b []byte) (netip.AddrPort, uint32, error) {
	if len(b) < unix.NLMSG_HDRLEN {
		return netip.AddrPort{}, 0, errors.New("conntrack reply: short message")
	}
	msgLen := int(binary.NativeEndian.Uint32(b))
	typ := binary.NativeEndian.Uint16(b[4:])
	seq := binary.NativeEndian.Uint32(b[8:])
	if msgLen < unix.NLMSG_HDRLEN || msgLen > len(b) {
		return netip.AddrPort{}, seq, errors.New("conntrack reply: bad length")
	}
	body := b[unix.NLMSG_HDRLEN:msgLen]
	switch {
	case typ == unix.NLMSG_ERROR:
		if len(body) < 4 {
			return netip.AddrPort{}, seq, errors.New("conntrack reply: short error message")
		}
		if errno := -int32(binary.NativeEndian.Uint32(body)); errno != 0 {
			return netip.AddrPort{}, seq, fmt.Errorf("conntrack lookup: %w", unix.Errno(errno))
		}
		return netip.AddrPort{}, seq, errors.New("conntrack lookup: acknowledged without an answer")
	case typ != unix.NFNL_SUBSYS_CTNETLINK<<8|ipctnlMsgCtNew:
		return netip.AddrPort{}, seq, fmt.Errorf("conntrack reply: unexpected message type %#x", typ)
	}
	if len(body) < 4 {
		return netip.AddrPort{}, seq, errors.New("conntrack reply: no nfgenmsg")
	}
	orig, ok := findAttr(body[4:], ctaTupleOrig)
	if !ok {
		return netip.AddrPort{}, seq, errors.New("conntrack reply: no original tuple")
	}
	ipAttrs, ok1 := findAttr(orig, ctaTupleIP)
	protoAttrs, ok2 := findAttr(orig, ctaTupleProto)
	port, ok3 := findAttr(protoAttrs, ctaProtoDstPort)
	if !ok1 || !ok2 || !ok3 || len(port) != 2 {
		return netip.AddrPort{}, seq, errors.New("conntrack reply: incomplete original tuple")
	}
	var addr netip.Addr
	if a, ok := findAttr(ipAttrs, ctaIPv4Dst); ok && len(a) == 4 {
		addr = netip.AddrFrom4([4]byte(a))
	} else if a, ok := findAttr(ipAttrs, ctaIPv6Dst); ok && len(a) == 16 {
		addr = netip.AddrFrom16([16]byte(a))
	} else {
		return netip.AddrPort{}, seq, errors.New("conntrack reply: no original destination address")
	}
	return netip.AddrPortFrom(addr, binary.BigEndian.Uint16(port)), seq, nil
}

// findAttr returns the payload of the first netlink attribute of type typ in b.
func findAttr(b []byte, typ uint16) ([]byte, bool) {
	for len(b) >= unix.NLA_HDRLEN {
		l := int(binary.NativeEndian.Uint16(b))
		if l < unix.NLA_HDRLEN || l > len(b) {
			return nil, false
		}
		if binary.NativeEndian.Uint16(b[2:])&nlaTypeMask == typ {
			return b[unix.NLA_HDRLEN:l], true
		}
		next := nlaAlign(l)
		if next >= len(b) {
			return nil, false
		}
		b = b[next:]
	}
	return nil, false
}
