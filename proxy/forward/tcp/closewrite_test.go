//go:build linux

package tcp

import (
	"bytes"
	"io"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// TestSecondEOFLeftToClose checks the short connection's saving of a system call: the direction
// whose EOF comes second passes it on with the close of both sockets rather than a CloseWrite
// first, once per connection, whichever side closes first, and each peer still gets its bytes
// and a clean EOF (a FIN, no reset). It fails if the connection falls back to CloseWrite.
func TestSecondEOFLeftToClose(t *testing.T) {
	cases := []struct {
		name         string
		server       func(*net.TCPConn)
		clientCloses bool // the client half-closes first; else the server closes first
	}{
		{name: "client closes first", server: forwardtest.EchoTCP, clientCloses: true},
		{name: "server closes first", server: func(c *net.TCPConn) {
			buf := make([]byte, 5)
			if _, err := io.ReadFull(c, buf); err == nil {
				c.Write(buf)
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			checkNoLeaks(t)
			var skipped atomic.Int32
			testHookCloseWriteSkipped = func() { skipped.Add(1) }
			t.Cleanup(func() { testHookCloseWriteSkipped = nil }) // after the proxy's cleanup: registered first
			backend := forwardtest.StartTCPServer(t, forwardtest.Loopback("4"), tc.server)
			r := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, nil)
			const conns = 5
			for range conns {
				c := forwardtest.DialTCP(t, r.addr)
				msg := []byte("hello")
				if _, err := c.Write(msg); err != nil {
					t.Fatalf("write: %v", err)
				}
				if tc.clientCloses {
					if err := c.CloseWrite(); err != nil {
						t.Fatalf("close write: %v", err)
					}
				}
				got, err := io.ReadAll(c) // a reset would fail it
				if err != nil || !bytes.Equal(got, msg) {
					t.Fatalf("got %q, %v; want %q and EOF", got, err, msg)
				}
				if !tc.clientCloses {
					if err := c.CloseWrite(); err != nil {
						t.Fatalf("close write: %v", err)
					}
				}
				c.Close()
			}
			deadline := time.Now().Add(forwardtest.WaitTimeout)
			for skipped.Load() < conns && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
			if n := skipped.Load(); n != conns {
				t.Errorf("%d of %d connections left their second EOF to the close; want all", n, conns)
			}
		})
	}
}
