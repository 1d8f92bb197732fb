package forward

import (
	"bytes"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"syscall"
	"testing"
)

// openPipeFDs counts this process's descriptors that are pipes.
func openPipeFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatalf("list fds: %v", err)
	}
	n := 0
	for _, e := range ents {
		if target, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.HasPrefix(target, "pipe:") {
			n++
		}
	}
	return n
}

// TestIdleConnectionsHoldNoPipe checks that the splice pipes are pooled, not held per
// connection: after data went both ways on many connections that then stay open and idle, the
// process holds at most the pool's pipes, far fewer than the two per connection that holding one
// per direction would take.
func TestIdleConnectionsHoldNoPipe(t *testing.T) {
	cases := []struct {
		name  string
		conns int
		msg   []byte
	}{
		{name: "small messages", conns: 3 * pipePoolMax, msg: []byte("hello\n")},
		{name: "messages larger than a pipe", conns: pipePoolMax + 8, msg: bytes.Repeat([]byte("x"), 3*pipeSize/2)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			checkNoLeaks(t)
			// An echo that copies through user space: io.Copy between sockets would splice,
			// holding pipes of its own in this process.
			backend := startTCPServer(t, loopback("4"), func(c *net.TCPConn) {
				buf := make([]byte, 64<<10)
				for {
					n, err := c.Read(buf)
					if n > 0 {
						if _, werr := c.Write(buf[:n]); werr != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			})
			r := startTCPProxy(t, "4", &fakeChooser{endpoints: []netip.AddrPort{backend}}, nil)
			before := openPipeFDs(t)
			for range tc.conns {
				c := dialTCPTest(t, r.addr)
				got, err := roundTrip(c, tc.msg)
				if err != nil || !bytes.Equal(got, tc.msg) {
					t.Fatalf("round trip through the proxy: %d bytes back, err %v", len(got), err)
				}
			}
			held := openPipeFDs(t) - before
			if held > 2*pipePoolMax {
				t.Errorf("%d idle connections hold %d pipe descriptors; want at most the pool's %d", tc.conns, held, 2*pipePoolMax)
			}
			t.Logf("%d idle connections: %d pipe descriptors open", tc.conns, held)
		})
	}
}

// TestCopyWithoutPipes checks that a connection still carries its bytes, both ways and with the
// half-close, when no pipe can be created (out of descriptors): it copies through user space.
func TestCopyWithoutPipes(t *testing.T) {
	cases := []struct {
		name string
		msg  []byte
	}{
		{name: "small", msg: []byte("hello\n")},
		{name: "larger than a chunk", msg: bytes.Repeat([]byte("y"), 5*copyChunkSize+7)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			checkNoLeaks(t)
			backend := startTCPEcho(t, loopback("4"))
			r := startTCPProxy(t, "4", &fakeChooser{endpoints: []netip.AddrPort{backend}}, func(p *TCPProxy) {
				p.pipes.testHookNewPipe = func() (*pipe, error) { return nil, syscall.EMFILE }
			})
			c := dialTCPTest(t, r.addr)
			if _, err := c.Write(tc.msg); err != nil {
				t.Fatalf("write: %v", err)
			}
			if err := c.CloseWrite(); err != nil {
				t.Fatalf("close write: %v", err)
			}
			got, err := io.ReadAll(c) // the echo closes after our EOF: the half-close went through
			if err != nil || !bytes.Equal(got, tc.msg) {
				t.Fatalf("got %d bytes back (want %d), err %v", len(got), len(tc.msg), err)
			}
		})
	}
}
