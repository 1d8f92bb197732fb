//go:build linux

package sys

import (
	"encoding/binary"
	"net/netip"
	"testing"

	"golang.org/x/sys/unix"
)

// sockaddrBytes encodes ap as the kernel does in a struct sockaddr_in / sockaddr_in6.
func sockaddrBytes(ap netip.AddrPort) []byte {
	if ap.Addr().Is4() {
		b := make([]byte, unix.SizeofSockaddrInet4)
		binary.NativeEndian.PutUint16(b, unix.AF_INET)
		binary.BigEndian.PutUint16(b[2:], ap.Port())
		a := ap.Addr().As4()
		copy(b[4:], a[:])
		return b
	}
	b := make([]byte, unix.SizeofSockaddrInet6)
	binary.NativeEndian.PutUint16(b, unix.AF_INET6)
	binary.BigEndian.PutUint16(b[2:], ap.Port())
	a := ap.Addr().As16()
	copy(b[8:], a[:])
	return b
}

// cmsg encodes one control message as recvmsg(2) fills it in.
func cmsg(level, typ int, data []byte) []byte { return AppendCmsg(nil, level, typ, data) }

func TestOrigDstFromOOB(t *testing.T) {
	v4 := netip.MustParseAddrPort("10.96.0.10:53")
	v6 := netip.MustParseAddrPort("[fd00:96::10]:53")
	mapped := netip.AddrPortFrom(netip.AddrFrom16(v4.Addr().As16()), 53)
	for _, tc := range []struct {
		name string
		oob  []byte
		want netip.AddrPort
	}{
		{"empty", nil, netip.AddrPort{}},
		{"IPv4", cmsg(unix.SOL_IP, unix.IP_ORIGDSTADDR, sockaddrBytes(v4)), v4},
		{"IPv6", cmsg(unix.SOL_IPV6, unix.IPV6_ORIGDSTADDR, sockaddrBytes(v6)), v6},
		{"IPv4-mapped IPv6 is unmapped", cmsg(unix.SOL_IPV6, unix.IPV6_ORIGDSTADDR, sockaddrBytes(mapped)), v4},
		{"after another message", append(cmsg(unix.SOL_IP, unix.IP_TTL, []byte{64, 0, 0, 0}), cmsg(unix.SOL_IP, unix.IP_ORIGDSTADDR, sockaddrBytes(v4))...), v4},
		{"other message only", cmsg(unix.SOL_IP, unix.IP_TTL, []byte{64, 0, 0, 0}), netip.AddrPort{}},
		{"truncated header", cmsg(unix.SOL_IP, unix.IP_ORIGDSTADDR, sockaddrBytes(v4))[:8], netip.AddrPort{}},
		{"truncated address", cmsg(unix.SOL_IP, unix.IP_ORIGDSTADDR, sockaddrBytes(v4)[:6]), netip.AddrPort{}},
		{"wrong family", cmsg(unix.SOL_IP, unix.IP_ORIGDSTADDR, make([]byte, 16)), netip.AddrPort{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := OrigDstFromOOB(tc.oob); got != tc.want {
				t.Errorf("OrigDstFromOOB = %v, want %v", got, tc.want)
			}
		})
	}
}

// FuzzOrigDstFromOOB checks the hand-written parser against x/sys/unix's on arbitrary input:
// it must never panic, and must find what ParseSocketControlMessage finds.
func FuzzOrigDstFromOOB(f *testing.F) {
	f.Add(cmsg(unix.SOL_IP, unix.IP_ORIGDSTADDR, sockaddrBytes(netip.MustParseAddrPort("10.0.0.1:80"))))
	f.Add(cmsg(unix.SOL_IPV6, unix.IPV6_ORIGDSTADDR, sockaddrBytes(netip.MustParseAddrPort("[::1]:80"))))
	f.Add(append(cmsg(unix.SOL_IP, unix.IP_TTL, []byte{1, 0, 0, 0}), cmsg(unix.SOL_IP, unix.IP_ORIGDSTADDR, sockaddrBytes(netip.MustParseAddrPort("10.0.0.1:80")))...))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, oob []byte) {
		got := OrigDstFromOOB(oob)
		msgs, err := unix.ParseSocketControlMessage(oob)
		if err != nil {
			return // malformed: any answer is acceptable, as long as there was no panic
		}
		var want netip.AddrPort
		for _, m := range msgs {
			if (m.Header.Level == unix.SOL_IP && m.Header.Type == unix.IP_ORIGDSTADDR) ||
				(m.Header.Level == unix.SOL_IPV6 && m.Header.Type == unix.IPV6_ORIGDSTADDR) {
				if ap, ok := ParseSockaddr(m.Data); ok {
					want = UnmapAddrPort(ap)
					break
				}
			}
		}
		if got != want && want.IsValid() {
			t.Errorf("OrigDstFromOOB = %v, ParseSocketControlMessage finds %v", got, want)
		}
	})
}
