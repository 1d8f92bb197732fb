package proxyproto

import (
	"bytes"
	"encoding/hex"
	"net/netip"
	"strings"
	"testing"
)

// unhex decodes a hex string written with spaces between groups.
func unhex(t *testing.T, s string) []byte {
	t.Helper()
	b, err := hex.DecodeString(strings.ReplaceAll(s, " ", ""))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestAppendProxyHeader checks the headers byte for byte against the examples and layouts of
// the PROXY protocol specification (haproxy.org/download/2.9/doc/proxy-protocol.txt): section
// 2.1's TCP4 example and maximal lines, and section 2.2's binary layout (signature, 0x21 =
// version 2 + PROXY, 0x11/0x21 = TCP over IPv4/IPv6, 0x12 = UDP over IPv4, big-endian length,
// addresses, ports).
func TestAppendProxyHeader(t *testing.T) {
	const sig = "0d0a0d0a000d0a515549540a"
	ap := netip.MustParseAddrPort
	tests := []struct {
		name     string
		v        Version
		stream   bool
		src, dst netip.AddrPort
		want     []byte
		wantErr  bool
	}{
		{name: "v1 spec example", v: V1, stream: true,
			src: ap("192.168.0.1:56324"), dst: ap("192.168.0.11:443"),
			want: []byte("PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\n")},
		{name: "v1 longest TCP4 line", v: V1, stream: true,
			src: ap("255.255.255.255:65535"), dst: ap("255.255.255.255:65535"),
			want: []byte("PROXY TCP4 255.255.255.255 255.255.255.255 65535 65535\r\n")},
		{name: "v1 TCP6", v: V1, stream: true,
			src: ap("[2001:db8::1]:1234"), dst: ap("[2001:db8::2]:80"),
			want: []byte("PROXY TCP6 2001:db8::1 2001:db8::2 1234 80\r\n")},
		{name: "v1 mapped IPv4 is unmapped", v: V1, stream: true,
			src: ap("[::ffff:10.0.0.9]:40000"), dst: ap("10.96.0.10:53"),
			want: []byte("PROXY TCP4 10.0.0.9 10.96.0.10 40000 53\r\n")},
		{name: "v1 mixed families are both IPv6", v: V1, stream: true,
			src: ap("10.0.0.9:40000"), dst: ap("[fd00::10]:53"),
			want: []byte("PROXY TCP6 ::ffff:10.0.0.9 fd00::10 40000 53\r\n")},
		{name: "v1 has no UDP", v: V1, stream: false,
			src: ap("10.0.0.9:40000"), dst: ap("10.96.0.10:53"), wantErr: true},
		{name: "v2 TCP4", v: V2, stream: true,
			src: ap("192.168.0.1:56324"), dst: ap("192.168.0.11:443"),
			want: unhex(t, sig+"21 11 000c c0a80001 c0a8000b dc04 01bb")},
		{name: "v2 UDP4", v: V2, stream: false,
			src: ap("10.0.0.9:40000"), dst: ap("10.96.0.10:53"),
			want: unhex(t, sig+"21 12 000c 0a000009 0a60000a 9c40 0035")},
		{name: "v2 TCP6", v: V2, stream: true,
			src: ap("[2001:db8::1]:1234"), dst: ap("[2001:db8::2]:80"),
			want: unhex(t, sig+"21 21 0024 20010db8000000000000000000000001 20010db8000000000000000000000002 04d2 0050")},
		{name: "missing destination", v: V2, stream: true,
			src: ap("10.0.0.9:40000"), wantErr: true},
		{name: "unknown version", v: Version(7), stream: true,
			src: ap("10.0.0.9:40000"), dst: ap("10.96.0.10:53"), wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			prefix := []byte("x")
			got, err := AppendHeader(prefix, tt.v, tt.stream, tt.src, tt.dst)
			if tt.wantErr {
				if err == nil {
					t.Fatalf("got %q, want an error", got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.HasPrefix(got, prefix) || !bytes.Equal(got[1:], tt.want) {
				t.Fatalf("header\n got % x\nwant % x", got[1:], tt.want)
			}
			if tt.v == V1 && len(got)-1 > 107 {
				t.Fatalf("v1 header of %d bytes exceeds the specification's 107", len(got)-1)
			}
		})
	}
}
