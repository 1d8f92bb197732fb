package tcp

import (
	"bytes"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/proxyproto"
)

// TestTCPProxyProtocolHeader runs a connection through the proxy to an endpoint that records
// what arrives first: the PROXY header naming the client and the address it connected to (the
// listener's, as there is no NAT here), then the payload, echoed.
func TestTCPProxyProtocolHeader(t *testing.T) {
	for _, tt := range []struct {
		name   string
		v      proxyproto.Version
		family string
	}{
		{"v1 IPv4", proxyproto.V1, "4"},
		{"v2 IPv4", proxyproto.V2, "4"},
		{"v1 IPv6", proxyproto.V1, "6"},
		{"v2 IPv6", proxyproto.V2, "6"},
		{"none", proxyproto.None, "4"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			checkNoLeaks(t)
			got := make(chan []byte, 1)
			backend := forwardtest.StartTCPServer(t, forwardtest.Loopback(tt.family), func(c *net.TCPConn) {
				c.SetDeadline(time.Now().Add(10 * time.Second))
				b, _ := io.ReadAll(c)
				got <- b
			})
			chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}, ProxyProtocol: tt.v}
			p := startTCPProxy(t, tt.family, chooser, nil)
			c := forwardtest.DialTCP(t, p.addr)
			client := netip.MustParseAddrPort(c.LocalAddr().String())
			if _, err := c.Write([]byte("payload")); err != nil {
				t.Fatal(err)
			}
			c.CloseWrite()
			var b []byte
			select {
			case b = <-got:
			case <-time.After(10 * time.Second):
				t.Fatal("endpoint got nothing")
			}
			c.Close()
			want := []byte("payload")
			if tt.v != proxyproto.None {
				hdr, err := proxyproto.AppendHeader(nil, tt.v, true, client, p.addr)
				if err != nil {
					t.Fatal(err)
				}
				want = append(hdr, want...)
			}
			if !bytes.Equal(b, want) {
				t.Fatalf("endpoint got %q, want %q", b, want)
			}
		})
	}
}
