//go:build linux

package tcp

import (
	"bytes"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
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
			backend := forwardtest.StartTCPServer(t, forwardtest.Loopback("4"), func(c *net.TCPConn) {
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
			r := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, nil)
			before := openPipeFDs(t)
			for range tc.conns {
				c := forwardtest.DialTCP(t, r.addr)
				got, err := forwardtest.RoundTrip(c, tc.msg)
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
		{name: "larger than a chunk", msg: bytes.Repeat([]byte("y"), 5*loopBufSize+7)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			checkNoLeaks(t)
			backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
			r := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
				p.pipes.testHookNewPipe = func() (*pipe, error) { return nil, syscall.EMFILE }
			})
			c := forwardtest.DialTCP(t, r.addr)
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

// TestTCPCopyThenSplice checks splice-auto (see loop_linux.go): request/response traffic moves
// through the user-space buffer and takes no pipe, and a direction switches to splice once a
// read fills the buffer. It fails if either path silently falls back to the other.
func TestTCPCopyThenSplice(t *testing.T) {
	checkNoLeaks(t)
	var copied, spliced, pipes atomic.Int64
	testHookCopied = func(n int64) { copied.Add(n) }
	testHookSpliced = func(n int64) { spliced.Add(n) }
	t.Cleanup(func() { testHookCopied, testHookSpliced = nil, nil }) // after the proxy's cleanup: registered first
	backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	r := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.pipes.testHookNewPipe = func() (*pipe, error) {
			pipes.Add(1)
			return newPipe()
		}
	})
	c := forwardtest.DialTCP(t, r.addr)
	msg := bytes.Repeat([]byte("r"), 100)
	const rounds = 50
	for range rounds {
		if got, err := forwardtest.RoundTrip(c, msg); err != nil || !bytes.Equal(got, msg) {
			t.Fatalf("round trip: %d bytes, %v", len(got), err)
		}
	}
	// The client can read a response before the proxy's hook has counted its write: wait for
	// the count to catch up, then check it exactly.
	want := int64(2 * rounds * len(msg))
	forwardtest.Eventually(t, "the request/response bytes counted", func() bool { return copied.Load()+spliced.Load() >= want })
	if got := copied.Load(); got != want || spliced.Load() != 0 || pipes.Load() != 0 {
		t.Fatalf("request/response: %d bytes copied (want %d), %d spliced, %d pipes made (want 0)",
			got, want, spliced.Load(), pipes.Load())
	}
	bulk := make([]byte, 4<<20)
	rand.NewChaCha8([32]byte{5}).Read(bulk)
	werr := make(chan error, 1)
	go func() {
		_, err := c.Write(bulk)
		werr <- err
	}()
	got := make([]byte, len(bulk))
	if _, err := io.ReadFull(c, got); err != nil || <-werr != nil || !bytes.Equal(got, bulk) {
		t.Fatalf("bulk echo through the proxy: %v", err)
	}
	forwardtest.Eventually(t, "the bulk bytes counted", func() bool { return copied.Load()+spliced.Load() >= want+int64(2*len(bulk)) })
	// Each direction copies at most until its first full buffer (a read returns what has
	// arrived, so a few short reads may come first), then splices.
	if s := spliced.Load(); s < int64(len(bulk)) || pipes.Load() == 0 {
		t.Errorf("bulk: %d bytes spliced (want most of 2 × %d), %d pipes made, %d bytes copied",
			s, len(bulk), pipes.Load(), copied.Load()-int64(2*rounds*len(msg)))
	}
	t.Logf("bulk: %d bytes spliced, %d copied, %d pipes made", spliced.Load(), copied.Load()-int64(2*rounds*len(msg)), pipes.Load())
}
