package proxyproto

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"testing"
)

// Flags of FuzzProxyHeader's flags argument.
const (
	fuzzMapSrc  = 1 << iota // write an IPv4 source in its IPv4-mapped IPv6 form
	fuzzMapDst              // the same for the destination
	fuzzZoneSrc             // give an IPv6 source a zone
	fuzzZoneDst             // the same for the destination
)

// fuzzAddr makes an address of b: none when b is empty, IPv4 from up to 4 bytes, IPv6 from up
// to 16 (zero-padded), mapped to IPv6 or with a zone as asked.
func fuzzAddr(b []byte, mapped, zone bool) netip.Addr {
	var a netip.Addr
	switch {
	case len(b) == 0:
		return a
	case len(b) <= 4:
		var a4 [4]byte
		copy(a4[:], b)
		a = netip.AddrFrom4(a4)
		if mapped {
			a = netip.AddrFrom16(a.As16())
		}
	default:
		var a16 [16]byte
		copy(a16[:], b)
		a = netip.AddrFrom16(a16)
	}
	if zone && a.Is6() {
		a = a.WithZone("eth0")
	}
	return a
}

// FuzzProxyHeader checks AppendHeader against a parser of the PROXY protocol written from
// the specification (haproxy.org/download/2.9/doc/proxy-protocol.txt), for any addresses,
// ports, families, transports and versions: the header must parse back to the client and
// destination addresses as the writer documents them (IPv4-mapped addresses unmapped, zones
// dropped, both sides IPv6 when their families differ), the bytes before it must be kept, and
// what it refuses (a missing address, a UDP header of version 1, an unknown version) must be
// refused without touching the buffer.
func FuzzProxyHeader(f *testing.F) {
	v4 := func(s string) []byte { a := netip.MustParseAddr(s).As4(); return a[:] }
	v6 := func(s string) []byte { a := netip.MustParseAddr(s).As16(); return a[:] }
	for _, v := range []uint8{1, 2} {
		for _, stream := range []bool{true, false} {
			f.Add([]byte("x"), v, stream, v4("192.168.0.1"), uint16(56324), v4("192.168.0.11"), uint16(443), uint8(0))
			f.Add([]byte{}, v, stream, v6("2001:db8::1"), uint16(1234), v6("2001:db8::2"), uint16(80), uint8(fuzzZoneSrc))
			f.Add([]byte{}, v, stream, v4("10.0.0.9"), uint16(40000), v6("fd00::10"), uint16(53), uint8(fuzzMapSrc))
			f.Add([]byte("GET"), v, stream, v4("255.255.255.255"), uint16(65535), v4("255.255.255.255"), uint16(65535), uint8(fuzzMapSrc|fuzzMapDst))
		}
	}
	f.Add([]byte{}, uint8(0), true, v4("10.0.0.9"), uint16(1), v4("10.0.0.10"), uint16(2), uint8(0))
	f.Add([]byte{}, uint8(2), true, []byte{}, uint16(1), v4("10.0.0.10"), uint16(2), uint8(0))

	f.Fuzz(func(t *testing.T, prefix []byte, version uint8, stream bool, srcIP []byte, srcPort uint16, dstIP []byte, dstPort uint16, flags uint8) {
		src := netip.AddrPortFrom(fuzzAddr(srcIP, flags&fuzzMapSrc != 0, flags&fuzzZoneSrc != 0), srcPort)
		dst := netip.AddrPortFrom(fuzzAddr(dstIP, flags&fuzzMapDst != 0, flags&fuzzZoneDst != 0), dstPort)
		v := Version(version)
		in := append(make([]byte, 0, len(prefix)+8), prefix...)
		out, err := AppendHeader(in, v, stream, src, dst)

		wantErr := !src.Addr().IsValid() || !dst.Addr().IsValid() ||
			(v != V1 && v != V2) || (v == V1 && !stream)
		if wantErr {
			if err == nil {
				t.Fatalf("v=%d stream=%v %v -> %v: got % x, want an error", version, stream, src, dst, out)
			}
			if !bytes.Equal(out, prefix) {
				t.Fatalf("error %v, but the buffer changed: % x, want % x", err, out, prefix)
			}
			return
		}
		if err != nil {
			t.Fatalf("v=%d stream=%v %v -> %v: %v", version, stream, src, dst, err)
		}
		if !bytes.Equal(out[:len(prefix)], prefix) {
			t.Fatalf("prefix changed: % x, want % x", out[:len(prefix)], prefix)
		}
		hdr := out[len(prefix):]

		// What the header must say: unmapped, zoneless addresses, both IPv6 if the families differ.
		wantSrc, wantDst := src.Addr().Unmap().WithZone(""), dst.Addr().Unmap().WithZone("")
		want6 := !wantSrc.Is4() || !wantDst.Is4()
		if want6 {
			wantSrc, wantDst = netip.AddrFrom16(wantSrc.As16()), netip.AddrFrom16(wantDst.As16())
		}
		want := proxyHeader{stream: stream, ipv6: want6, src: netip.AddrPortFrom(wantSrc, srcPort), dst: netip.AddrPortFrom(wantDst, dstPort)}

		var got proxyHeader
		if v == V1 {
			got, err = parseProxyV1(hdr)
		} else {
			got, err = parseProxyV2(hdr)
		}
		if err != nil {
			t.Fatalf("v=%d stream=%v %v -> %v: header %q: %v", version, stream, src, dst, hdr, err)
		}
		if got != want {
			t.Fatalf("v=%d stream=%v %v -> %v: header %q parses as %+v, want %+v", version, stream, src, dst, hdr, got, want)
		}
	})
}

// proxyHeader is what a PROXY protocol header says: the transport, the address family
// (IPv6 or IPv4), and the source and destination.
type proxyHeader struct {
	stream   bool
	ipv6     bool
	src, dst netip.AddrPort
}

// parseProxyV1 parses a whole version 1 header (section 2.1): one line of at most 107 bytes,
// "PROXY" SP ("TCP4" | "TCP6") SP src SP dst SP sport SP dport CRLF, single spaces, addresses
// in the protocol's family, ports decimal in 0..65535 without leading zeros.
func parseProxyV1(b []byte) (proxyHeader, error) {
	var h proxyHeader
	if len(b) > 107 {
		return h, fmt.Errorf("%d bytes, more than 107", len(b))
	}
	line, ok := bytes.CutSuffix(b, []byte("\r\n"))
	if !ok {
		return h, errors.New("not CRLF-terminated")
	}
	for _, c := range line {
		if c < 0x20 || c > 0x7e {
			return h, fmt.Errorf("byte %#x in the line", c)
		}
	}
	f := strings.Split(string(line), " ")
	if len(f) != 6 || f[0] != "PROXY" {
		return h, fmt.Errorf("%d fields (want PROXY and 5 more, single spaces)", len(f))
	}
	switch f[1] {
	case "TCP4":
	case "TCP6":
		h.ipv6 = true
	default:
		return h, fmt.Errorf("protocol %q", f[1])
	}
	h.stream = true
	var addrs [2]netip.Addr
	for i, s := range f[2:4] {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return h, err
		}
		if a.Zone() != "" || a.Is6() != h.ipv6 {
			return h, fmt.Errorf("address %q under %s", s, f[1])
		}
		addrs[i] = a
	}
	var ports [2]uint16
	for i, s := range f[4:6] {
		n, err := strconv.ParseUint(s, 10, 16)
		if err != nil || strconv.FormatUint(n, 10) != s {
			return h, fmt.Errorf("port %q", s)
		}
		ports[i] = uint16(n)
	}
	h.src, h.dst = netip.AddrPortFrom(addrs[0], ports[0]), netip.AddrPortFrom(addrs[1], ports[1])
	return h, nil
}

// parseProxyV2 parses a whole version 2 header (section 2.2): the 12-byte signature, version 2
// and command PROXY, AF_INET or AF_INET6 over STREAM or DGRAM, the big-endian length of the
// rest, which must be exactly the address block (12 or 36 bytes: no TLVs are written).
func parseProxyV2(b []byte) (proxyHeader, error) {
	var h proxyHeader
	if len(b) < 16 {
		return h, fmt.Errorf("%d bytes, less than the fixed 16", len(b))
	}
	if !bytes.Equal(b[:12], v2Signature[:]) {
		return h, errors.New("no signature")
	}
	if b[12] != 0x21 {
		return h, fmt.Errorf("version/command %#x, want 0x21", b[12])
	}
	var alen int
	switch b[13] >> 4 {
	case 1:
		alen = 12
	case 2:
		h.ipv6, alen = true, 36
	default:
		return h, fmt.Errorf("family %#x", b[13]>>4)
	}
	switch b[13] & 0xf {
	case 1:
		h.stream = true
	case 2:
	default:
		return h, fmt.Errorf("transport %#x", b[13]&0xf)
	}
	if n := int(binary.BigEndian.Uint16(b[14:16])); n != len(b)-16 || n != alen {
		return h, fmt.Errorf("length field %d, %d bytes follow, address block %d", n, len(b)-16, alen)
	}
	a := b[16:]
	var s, d netip.Addr
	if h.ipv6 {
		s, d = netip.AddrFrom16([16]byte(a[:16])), netip.AddrFrom16([16]byte(a[16:32]))
		a = a[32:]
	} else {
		s, d = netip.AddrFrom4([4]byte(a[:4])), netip.AddrFrom4([4]byte(a[4:8]))
		a = a[8:]
	}
	h.src = netip.AddrPortFrom(s, binary.BigEndian.Uint16(a[:2]))
	h.dst = netip.AddrPortFrom(d, binary.BigEndian.Uint16(a[2:4]))
	return h, nil
}
