// Package proxyproto writes the header of the PROXY protocol (HAProxy's "The PROXY protocol",
// versions 1 and 2) that a proxy sends to an endpoint before the client's bytes, so that the
// endpoint learns the client's address and the address the client connected to. Version is the
// protocol version a target asks for (the zero value, None, sends nothing); AppendHeader
// encodes one header. A TCPProxy (package proxy/forward) sends it once connected.
package proxyproto

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"strconv"
)

// Version is a version of the PROXY protocol (HAProxy's "The PROXY protocol", versions 1
// and 2): a header the proxy sends to the endpoint before the client's bytes, naming the
// client's address and the address the client connected to. The zero value sends no header.
type Version uint8

// PROXY protocol versions.
const (
	None Version = iota
	// V1 is the human-readable header: "PROXY TCP4 <src> <dst> <sport> <dport>\r\n".
	V1
	// V2 is the binary header: a 12-byte signature, version/command, family and
	// transport, length, then the addresses and ports.
	V2
)

// String returns "", "v1" or "v2".
func (v Version) String() string {
	switch v {
	case None:
		return ""
	case V1:
		return "v1"
	case V2:
		return "v2"
	}
	return "ProxyProtocol(" + strconv.Itoa(int(v)) + ")"
}

// v2Signature opens every version 2 header.
var v2Signature = [12]byte{0x0D, 0x0A, 0x0D, 0x0A, 0x00, 0x0D, 0x0A, 0x51, 0x55, 0x49, 0x54, 0x0A}

// Version 2 header fields (section 2.2 of the specification).
const (
	proxyV2VerCmdProxy = 0x21 // version 2, command PROXY
	proxyV2FamInet     = 0x10 // AF_INET
	proxyV2FamInet6    = 0x20 // AF_INET6
	proxyV2Stream      = 0x01 // SOCK_STREAM
	proxyV2Dgram       = 0x02 // SOCK_DGRAM
)

// AppendHeader appends the PROXY protocol header of version v for a connection from src to
// dst over TCP (stream) or UDP, and returns the extended buffer. Addresses of different
// families are both sent as IPv6 (an IPv4 address mapped), as the specification requires the
// same family on both sides; IPv4-mapped addresses of the same family are unmapped. Version 1
// describes TCP only: a UDP header of version 1 is an error, as is an invalid address.
func AppendHeader(b []byte, v Version, stream bool, src, dst netip.AddrPort) ([]byte, error) {
	if !src.IsValid() || !dst.IsValid() {
		return b, fmt.Errorf("PROXY protocol header from %v to %v: both addresses are required", src, dst)
	}
	sa, da := src.Addr().Unmap().WithZone(""), dst.Addr().Unmap().WithZone("")
	if sa.Is4() != da.Is4() {
		sa, da = netip.AddrFrom16(sa.As16()), netip.AddrFrom16(da.As16())
	}
	switch v {
	case V1:
		if !stream {
			return b, fmt.Errorf("PROXY protocol v1 header from %v to %v: version 1 has no UDP", src, dst)
		}
		proto := "TCP6"
		if sa.Is4() {
			proto = "TCP4"
		}
		b = append(b, "PROXY "...)
		b = append(b, proto...)
		b = append(b, ' ')
		b = sa.AppendTo(b)
		b = append(b, ' ')
		b = da.AppendTo(b)
		b = append(b, ' ')
		b = strconv.AppendUint(b, uint64(src.Port()), 10)
		b = append(b, ' ')
		b = strconv.AppendUint(b, uint64(dst.Port()), 10)
		return append(b, '\r', '\n'), nil
	case V2:
		transport := byte(proxyV2Stream)
		if !stream {
			transport = proxyV2Dgram
		}
		b = append(b, v2Signature[:]...)
		b = append(b, proxyV2VerCmdProxy)
		if sa.Is4() {
			b = append(b, proxyV2FamInet|transport)
			b = binary.BigEndian.AppendUint16(b, 12)
			s4, d4 := sa.As4(), da.As4()
			b = append(b, s4[:]...)
			b = append(b, d4[:]...)
		} else {
			b = append(b, proxyV2FamInet6|transport)
			b = binary.BigEndian.AppendUint16(b, 36)
			s16, d16 := sa.As16(), da.As16()
			b = append(b, s16[:]...)
			b = append(b, d16[:]...)
		}
		b = binary.BigEndian.AppendUint16(b, src.Port())
		return binary.BigEndian.AppendUint16(b, dst.Port()), nil
	}
	return b, fmt.Errorf("PROXY protocol header: unknown version %v", v)
}
