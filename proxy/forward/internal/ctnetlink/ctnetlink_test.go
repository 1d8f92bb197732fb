//go:build linux

package ctnetlink

import (
	"encoding/binary"
	"errors"
	"net/netip"
	"testing"

	"golang.org/x/sys/unix"
)

// conntrackReply builds a ctnetlink CT_NEW message with the given original tuple, as the kernel
// answers a CT_GET.
func conntrackReply(seq uint32, src, dst netip.AddrPort) []byte {
	srcType, dstType := uint16(ctaIPv4Src), uint16(ctaIPv4Dst)
	family := uint8(unix.AF_INET)
	if src.Addr().Is6() {
		srcType, dstType, family = ctaIPv6Src, ctaIPv6Dst, unix.AF_INET6
	}
	b := make([]byte, unix.NLMSG_HDRLEN)
	b = append(b, family, unix.NFNETLINK_V0, 0, 0)
	b = appendAttr(b, 3, []byte{0, 0, 0, 8}) // CTA_STATUS before the tuple
	orig := nestStart(&b, ctaTupleOrig)
	ip := nestStart(&b, ctaTupleIP)
	b = appendAttr(b, srcType, src.Addr().AsSlice())
	b = appendAttr(b, dstType, dst.Addr().AsSlice())
	nestEnd(b, ip)
	pr := nestStart(&b, ctaTupleProto)
	b = appendAttr(b, ctaProtoNum, []byte{unix.IPPROTO_UDP})
	b = appendAttr(b, ctaProtoSrcPort, binary.BigEndian.AppendUint16(nil, src.Port()))
	b = appendAttr(b, ctaProtoDstPort, binary.BigEndian.AppendUint16(nil, dst.Port()))
	nestEnd(b, pr)
	nestEnd(b, orig)
	binary.NativeEndian.PutUint32(b, uint32(len(b)))
	binary.NativeEndian.PutUint16(b[4:], unix.NFNL_SUBSYS_CTNETLINK<<8|ipctnlMsgCtNew)
	binary.NativeEndian.PutUint32(b[8:], seq)
	return b
}

func conntrackError(seq uint32, errno unix.Errno) []byte {
	b := make([]byte, unix.NLMSG_HDRLEN+4+unix.NLMSG_HDRLEN)
	binary.NativeEndian.PutUint32(b, uint32(len(b)))
	binary.NativeEndian.PutUint16(b[4:], unix.NLMSG_ERROR)
	binary.NativeEndian.PutUint32(b[8:], seq)
	binary.NativeEndian.PutUint32(b[unix.NLMSG_HDRLEN:], uint32(-int32(errno)))
	return b
}

func TestParseConntrackReply(t *testing.T) {
	client := netip.MustParseAddrPort("192.0.2.7:40000")
	service := netip.MustParseAddrPort("10.96.0.10:53")
	client6 := netip.MustParseAddrPort("[fd00::7]:40000")
	service6 := netip.MustParseAddrPort("[fd00:96::10]:53")
	for _, tc := range []struct {
		name    string
		msg     []byte
		want    netip.AddrPort
		wantSeq uint32
		wantErr error // nil: success; errAny: some error
	}{
		{"IPv4 flow", conntrackReply(5, client, service), service, 5, nil},
		{"IPv6 flow", conntrackReply(6, client6, service6), service6, 6, nil},
		{"no such flow", conntrackError(7, unix.ENOENT), netip.AddrPort{}, 7, unix.ENOENT},
		{"not permitted", conntrackError(8, unix.EPERM), netip.AddrPort{}, 8, unix.EPERM},
		{"truncated", conntrackReply(9, client, service)[:30], netip.AddrPort{}, 9, errAny},
		{"short", []byte{1, 2, 3}, netip.AddrPort{}, 0, errAny},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, seq, err := parseConntrackReply(tc.msg)
			switch {
			case tc.wantErr == nil && err != nil:
				t.Fatalf("error %v", err)
			case tc.wantErr == errAny && err == nil, tc.wantErr != nil && tc.wantErr != errAny && !errors.Is(err, tc.wantErr):
				t.Fatalf("error %v, want %v", err, tc.wantErr)
			}
			if got != tc.want || seq != tc.wantSeq {
				t.Errorf("got %v seq %d, want %v seq %d", got, seq, tc.want, tc.wantSeq)
			}
		})
	}
}

var errAny = errors.New("any error")

func FuzzParseConntrackReply(f *testing.F) {
	f.Add(conntrackReply(1, netip.MustParseAddrPort("192.0.2.7:40000"), netip.MustParseAddrPort("10.96.0.10:53")))
	f.Add(conntrackReply(2, netip.MustParseAddrPort("[fd00::7]:1"), netip.MustParseAddrPort("[fd00::10]:53")))
	f.Add(conntrackError(3, unix.ENOENT))
	f.Fuzz(func(t *testing.T, b []byte) {
		got, _, err := parseConntrackReply(b)
		if err == nil && !got.IsValid() {
			t.Errorf("no error but no address")
		}
	})
}
