package forward

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestEventLoopRelay checks the benchmark's reference event loop (evloop_bench_test.go): it
// relays bytes both ways, including more than the sockets buffer (its pending buffers), passes
// each EOF on as a half-close, closes both sockets once both directions ended, and closes the
// client's when the endpoint refuses, with either way of waiting.
func TestEventLoopRelay(t *testing.T) {
	for _, block := range []bool{true, false} {
		name := "NetpollWait"
		if block {
			name = "BlockingWait"
		}
		t.Run(name, func(t *testing.T) {
			t.Run("bulk echo", func(t *testing.T) {
				l := startEvLoop(t, startTCPEcho(t, loopback("4")), block)
				c := dialTCPTest(t, l.addr)
				msg := make([]byte, 8<<20)
				for i := range msg {
					msg[i] = byte(rand.Uint32())
				}
				werr := make(chan error, 1)
				go func() {
					_, err := c.Write(msg)
					if err == nil {
						err = c.CloseWrite()
					}
					werr <- err
				}()
				time.Sleep(100 * time.Millisecond) // the relay's writes to the client block meanwhile
				got, err := io.ReadAll(c)
				if err != nil || !bytes.Equal(got, msg) {
					t.Fatalf("echo: %d of %d bytes, equal %v, %v", len(got), len(msg), bytes.Equal(got, msg), err)
				}
				if err := <-werr; err != nil {
					t.Fatalf("write: %v", err)
				}
				c.Close()
				eventually(t, "the connection closed", func() bool { return l.liveConns() == 0 })
				l.Close()
				if l.pended == 0 {
					t.Error("no write left data pending: the test did not cover the pending buffers")
				}
			})
			t.Run("server half-closes first", func(t *testing.T) {
				got := make(chan string, 1)
				backend := startTCPServer(t, loopback("4"), func(c *net.TCPConn) {
					c.Write([]byte("hi"))
					c.CloseWrite()
					b, _ := io.ReadAll(c)
					got <- string(b)
				})
				l := startEvLoop(t, backend, block)
				c := dialTCPTest(t, l.addr)
				if b, err := io.ReadAll(c); err != nil || string(b) != "hi" {
					t.Fatalf("got %q, %v", b, err)
				}
				if _, err := c.Write([]byte("still here")); err != nil {
					t.Fatal(err)
				}
				c.CloseWrite()
				if g := <-got; g != "still here" {
					t.Fatalf("server got %q", g)
				}
				eventually(t, "the connection closed", func() bool { return l.liveConns() == 0 })
			})
			t.Run("client half-closes first", func(t *testing.T) {
				backend := startTCPServer(t, loopback("4"), func(c *net.TCPConn) {
					got, err := io.ReadAll(c) // to the client's EOF
					if err == nil {
						c.Write(append([]byte("got "), got...))
					}
				})
				l := startEvLoop(t, backend, block)
				c := dialTCPTest(t, l.addr)
				if _, err := c.Write([]byte("hello")); err != nil {
					t.Fatal(err)
				}
				if err := c.CloseWrite(); err != nil {
					t.Fatal(err)
				}
				got, err := io.ReadAll(c) // a reset would fail it
				if err != nil || string(got) != "got hello" {
					t.Fatalf("got %q, %v", got, err)
				}
				eventually(t, "the connection closed", func() bool { return l.liveConns() == 0 })
			})
			t.Run("server closes first", func(t *testing.T) {
				l := startEvLoop(t, startTCPServer(t, loopback("4"), requestServer), block)
				for range 20 {
					c := dialTCPTest(t, l.addr)
					req := bytes.Repeat([]byte("r"), 64)
					if _, err := c.Write(req); err != nil {
						t.Fatal(err)
					}
					got, err := io.ReadAll(c)
					if err != nil || !bytes.Equal(got, req) {
						t.Fatalf("got %q, %v", got, err)
					}
					// The client's direction is still open: it can write on (into the closed
					// server, which resets, so the loop closes), or close.
					c.Close()
				}
				eventually(t, "the connections closed", func() bool { return l.liveConns() == 0 })
			})
			t.Run("endpoint refuses", func(t *testing.T) {
				l := startEvLoop(t, closedTCPPort(t, loopback("4")), block)
				c := dialTCPTest(t, l.addr)
				c.Write([]byte("hello"))
				if got, err := io.ReadAll(c); len(got) != 0 || (err != nil && !isReset(err)) {
					t.Fatalf("got %q, %v; want EOF", got, err)
				}
				eventually(t, "the connection closed", func() bool { return l.liveConns() == 0 })
			})
			t.Run("close with open connections", func(t *testing.T) {
				l := startEvLoop(t, startTCPEcho(t, loopback("4")), block)
				c := dialTCPTest(t, l.addr)
				if _, err := roundTrip(c, []byte("ping")); err != nil {
					t.Fatal(err)
				}
				l.Close()
				if got, err := io.ReadAll(c); len(got) != 0 || err != nil {
					t.Fatalf("got %q, %v; want EOF", got, err)
				}
				if _, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(l.addr)); err == nil {
					t.Fatal("the listener still accepts")
				}
			})
		})
	}
}

// TestEventLoopInheritsNoDelay checks what the reference event loop relies on to save a system
// call per connection: accept4 returns sockets with the listener's TCP_NODELAY and SO_KEEPALIVE.
func TestEventLoopInheritsNoDelay(t *testing.T) {
	l, err := newEvLoop(netip.MustParseAddrPort("127.0.0.1:9"), true)
	if err != nil {
		t.Fatal(err)
	}
	defer l.closeFDs()
	c := dialTCPTest(t, l.addr)
	defer c.Close()
	fd, _, err := unix.Accept4(l.lfd, unix.SOCK_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	for _, o := range []struct {
		name       string
		level, opt int
	}{{"TCP_NODELAY", unix.IPPROTO_TCP, unix.TCP_NODELAY}, {"SO_KEEPALIVE", unix.SOL_SOCKET, unix.SO_KEEPALIVE}} {
		if v, err := unix.GetsockoptInt(fd, o.level, o.opt); err != nil || v == 0 {
			t.Errorf("accepted socket's %s: %d, %v; want it set", o.name, v, err)
		}
	}
}

func isReset(err error) bool { return errors.Is(err, unix.ECONNRESET) }
