//go:build linux

package tcp

import (
	"io"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/proxyproto"
)

// dstChooser is a forwardtest.Chooser that says whether it needs the original destination.
type dstChooser struct {
	forwardtest.Chooser
	needs bool
}

func (c *dstChooser) NeedsOriginalDst() bool { return c.needs }

var _ forward.OriginalDstChooser = (*dstChooser)(nil)

// TestOriginalDstAskedOnlyWhenNeeded checks the saving of a getsockopt(2) per connection: the
// proxy asks for SO_ORIGINAL_DST only when the chooser needs it (or does not say), or when the
// target asks for a PROXY protocol header, which names the original destination. It fails if
// the proxy asks regardless.
func TestOriginalDstAskedOnlyWhenNeeded(t *testing.T) {
	cases := []struct {
		name    string
		chooser func(backend netip.AddrPort) forward.Chooser
		want    int32 // asks per connection
	}{
		{"chooser does not need it", func(b netip.AddrPort) forward.Chooser {
			return &dstChooser{Chooser: forwardtest.Chooser{Endpoints: []netip.AddrPort{b}}}
		}, 0},
		{"chooser needs it", func(b netip.AddrPort) forward.Chooser {
			return &dstChooser{Chooser: forwardtest.Chooser{Endpoints: []netip.AddrPort{b}}, needs: true}
		}, 1},
		{"chooser does not say", func(b netip.AddrPort) forward.Chooser {
			return &forwardtest.Chooser{Endpoints: []netip.AddrPort{b}}
		}, 1},
		{"PROXY protocol header", func(b netip.AddrPort) forward.Chooser {
			return &dstChooser{Chooser: forwardtest.Chooser{Endpoints: []netip.AddrPort{b}, ProxyProtocol: proxyproto.V1}}
		}, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			checkNoLeaks(t)
			var asked atomic.Int32
			testHookOriginalDst = func() { asked.Add(1) }
			t.Cleanup(func() { testHookOriginalDst = nil }) // after the proxy's cleanup: registered first
			backend := forwardtest.StartTCPServer(t, forwardtest.Loopback("4"), func(c *net.TCPConn) { io.Copy(io.Discard, c) })
			r := startTCPProxy(t, "4", tc.chooser(backend), nil)
			const conns = 3
			for range conns {
				c := forwardtest.DialTCP(t, r.addr)
				if _, err := c.Write([]byte("x")); err != nil {
					t.Fatalf("write: %v", err)
				}
				c.CloseWrite()
				if _, err := io.ReadAll(c); err != nil { // the proxy dialled and relayed: EOF back
					t.Fatalf("read: %v", err)
				}
				c.Close()
			}
			if got := asked.Load(); got != tc.want*conns {
				t.Errorf("SO_ORIGINAL_DST asked %d times for %d connections; want %d", got, conns, tc.want*conns)
			}
		})
	}
}
