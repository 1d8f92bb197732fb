//go:build linux

package tcp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"reflect"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
	"golang.org/x/sys/unix"
)

func TestTCPEcho(t *testing.T) {
	for _, tc := range []struct {
		name   string
		family string
		size   int
	}{
		{"IPv4 one byte", "4", 1},
		{"IPv4 64 KiB", "4", 64 << 10},
		{"IPv4 1 MiB", "4", 1 << 20},
		{"IPv6 64 KiB", "6", 64 << 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkNoLeaks(t)
			backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback(tc.family))
			chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}
			metrics := &forwardtest.Metrics{}
			p := startTCPProxy(t, tc.family, chooser, func(p *Proxy) { p.Metrics = metrics })

			c := forwardtest.DialTCP(t, p.addr)
			msg := make([]byte, tc.size)
			rand.NewChaCha8([32]byte{1}).Read(msg)
			var got []byte
			var werr error
			done := make(chan struct{})
			go func() {
				defer close(done)
				_, werr = c.Write(msg)
			}()
			got, err := io.ReadAll(io.LimitReader(c, int64(tc.size)))
			<-done
			if werr != nil || err != nil {
				t.Fatalf("write: %v, read: %v", werr, err)
			}
			if !bytes.Equal(got, msg) {
				t.Fatalf("echo differs: got %d bytes, want %d", len(got), len(msg))
			}
			c.Close()
			forwardtest.Eventually(t, "connection closed", func() bool { return metrics.Snapshot().Closed == 1 })
			m := metrics.Snapshot()
			if m.Accepted != 1 || m.Failed != 0 || m.ToEndpoint != int64(tc.size) || m.FromEndpoint != int64(tc.size) {
				t.Errorf("metrics: %+v, want 1 accepted, 0 failed, %d bytes each way", m, tc.size)
			}
			calls := chooser.Recorded()
			if len(calls) != 1 || calls[0].Reset || calls[0].Client != forwardtest.TCPAddrPort(c.LocalAddr()) || calls[0].Dst.IsValid() {
				t.Errorf("Choose calls %+v, want one from %s with no reset and unknown dst", calls, c.LocalAddr())
			}
		})
	}
}

func TestTCPManyConcurrentConnections(t *testing.T) {
	checkNoLeaks(t)
	b1, b2 := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4")), forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	metrics := &forwardtest.Metrics{}
	p := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{b1, b2}}, func(p *Proxy) { p.Metrics = metrics })

	const conns = 200
	var wg sync.WaitGroup
	errs := make(chan error, conns)
	for i := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(p.addr))
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(forwardtest.WaitTimeout))
			msg := make([]byte, 4096)
			rand.NewChaCha8([32]byte{byte(i), byte(i >> 8)}).Read(msg)
			for range 3 {
				got, err := forwardtest.RoundTrip(c, msg)
				if err != nil {
					errs <- fmt.Errorf("conn %d: %w", i, err)
					return
				}
				if !bytes.Equal(got, msg) {
					errs <- fmt.Errorf("conn %d: echo differs", i)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	forwardtest.Eventually(t, "all connections closed", func() bool { return metrics.Snapshot().Closed == conns })
	if m := metrics.Snapshot(); m.Accepted != conns || m.ToEndpoint != conns*3*4096 {
		t.Errorf("metrics %+v, want %d accepted and %d bytes to endpoints", m, conns, conns*3*4096)
	}
}

// blackholeEndpoint returns a loopback address whose SYNs go unanswered: a listener with a full
// accept queue (backlog 0, never accepting) drops them, so dials time out.
func blackholeEndpoint(t *testing.T) netip.AddrPort {
	t.Helper()
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, err := unix.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	ap := netip.AddrPortFrom(netip.AddrFrom4(sa.(*unix.SockaddrInet4).Addr), uint16(sa.(*unix.SockaddrInet4).Port))
	// Fill the accept queue until a dial times out.
	for i := 0; ; i++ {
		if i == 64 {
			t.Fatal("could not fill the accept queue of the blackhole listener")
		}
		c, err := net.DialTimeout("tcp", ap.String(), 200*time.Millisecond)
		if err != nil {
			break
		}
		t.Cleanup(func() { c.Close() })
	}
	return ap
}

func TestTCPDialFailures(t *testing.T) {
	echo := func(t *testing.T) netip.AddrPort { return forwardtest.StartTCPEcho(t, forwardtest.Loopback("4")) }
	closed := func(t *testing.T) netip.AddrPort { return forwardtest.ClosedTCPPort(t, forwardtest.Loopback("4")) }
	for _, tc := range []struct {
		name      string
		endpoints []func(*testing.T) netip.AddrPort
		noEPs     bool
		timeouts  []time.Duration
		// wantEcho: the connection reaches the last endpoint; else the client is reset.
		wantEcho       bool
		wantResets     []bool // the reset argument of each Choose call
		wantDialFailed []int  // indexes into endpoints
	}{
		{
			name:           "first endpoint refuses, second answers",
			endpoints:      []func(*testing.T) netip.AddrPort{closed, echo},
			wantEcho:       true,
			wantResets:     []bool{false, true},
			wantDialFailed: []int{0},
		},
		{
			name:           "two refuse, third answers",
			endpoints:      []func(*testing.T) netip.AddrPort{closed, closed, echo},
			wantEcho:       true,
			wantResets:     []bool{false, true, true},
			wantDialFailed: []int{0, 1},
		},
		{
			// Refusals spend no timeout: nine endpoints that refuse (nine of ten pods gone at
			// once) are each tried once, then the tenth answers.
			name:           "nine refuse, the tenth answers",
			endpoints:      []func(*testing.T) netip.AddrPort{closed, closed, closed, closed, closed, closed, closed, closed, closed, echo},
			wantEcho:       true,
			wantResets:     []bool{false, true, true, true, true, true, true, true, true, true},
			wantDialFailed: []int{0, 1, 2, 3, 4, 5, 6, 7, 8},
		},
		{
			// Each is tried once: when the Chooser offers one that refused again, there is no
			// other.
			name:           "every endpoint refuses",
			endpoints:      []func(*testing.T) netip.AddrPort{closed, closed},
			timeouts:       []time.Duration{time.Second, time.Second, time.Second},
			wantResets:     []bool{false, true, true},
			wantDialFailed: []int{0, 1},
		},
		{
			name:           "a refusal, then time-outs spend the timeouts",
			endpoints:      []func(*testing.T) netip.AddrPort{closed, blackholeEndpoint, blackholeEndpoint},
			timeouts:       []time.Duration{20 * time.Millisecond, 40 * time.Millisecond},
			wantResets:     []bool{false, true, true},
			wantDialFailed: []int{0, 1, 2},
		},
		{
			name:           "every endpoint times out",
			endpoints:      []func(*testing.T) netip.AddrPort{blackholeEndpoint},
			timeouts:       []time.Duration{20 * time.Millisecond, 40 * time.Millisecond},
			wantResets:     []bool{false, true},
			wantDialFailed: []int{0, 0},
		},
		{
			name:       "no endpoint",
			noEPs:      true,
			wantResets: []bool{false},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkNoLeaks(t)
			var eps []netip.AddrPort
			for _, mk := range tc.endpoints {
				eps = append(eps, mk(t))
			}
			chooser := &forwardtest.Chooser{Endpoints: eps}
			if tc.noEPs {
				chooser.Err = errors.New("service has no endpoints")
			}
			metrics := &forwardtest.Metrics{}
			p := startTCPProxy(t, "4", chooser, func(p *Proxy) {
				p.Metrics = metrics
				p.DialTimeouts = tc.timeouts
			})

			start := time.Now()
			// A reset can arrive before connect(2) reports success: then the dial fails.
			var got []byte
			c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(p.addr))
			if err == nil {
				defer c.Close()
				c.SetDeadline(time.Now().Add(forwardtest.WaitTimeout))
				got, err = forwardtest.RoundTrip(c, []byte("hello"))
			}
			t.Logf("connection ended after %v", time.Since(start))
			if tc.wantEcho {
				if err != nil || string(got) != "hello" {
					t.Fatalf("round trip: %q, %v; want the echo", got, err)
				}
				c.Close()
				forwardtest.Eventually(t, "connection closed", func() bool { return metrics.Snapshot().Closed == 1 })
			} else {
				if !errors.Is(err, syscall.ECONNRESET) {
					t.Fatalf("round trip: %q, %v; want ECONNRESET", got, err)
				}
				forwardtest.Eventually(t, "connection failed", func() bool { return metrics.Snapshot().Failed == 1 })
			}
			if got := chooser.Resets(); !reflect.DeepEqual(got, tc.wantResets) {
				t.Errorf("Choose calls with reset=%v, want %v", got, tc.wantResets)
			}
			var wantFailed []netip.AddrPort
			for _, i := range tc.wantDialFailed {
				wantFailed = append(wantFailed, eps[i])
			}
			if got := metrics.Snapshot().DialFailed; !reflect.DeepEqual(got, wantFailed) {
				t.Errorf("DialFailed for %v, want %v", got, wantFailed)
			}
			if got := chooser.Unreachables(); !reflect.DeepEqual(got, wantFailed) {
				t.Errorf("Unreachable reported %v, want %v", got, wantFailed)
			}
		})
	}
}

// TestTCPSlowDialDoesNotBlockAccept: while one connection waits on a dead endpoint, others are
// accepted and served.
func TestTCPSlowDialDoesNotBlockAccept(t *testing.T) {
	checkNoLeaks(t)
	dead, echo := blackholeEndpoint(t), forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{dead}}
	p := startTCPProxy(t, "4", chooser, func(p *Proxy) { p.DialTimeouts = []time.Duration{time.Hour} })

	stuck := forwardtest.DialTCP(t, p.addr)
	forwardtest.Eventually(t, "the first connection to choose", func() bool { return len(chooser.Recorded()) == 1 })
	chooser.Set(echo)
	c := forwardtest.DialTCP(t, p.addr)
	if got, err := forwardtest.RoundTrip(c, []byte("hi")); err != nil || string(got) != "hi" {
		t.Fatalf("second connection: %q, %v", got, err)
	}
	stuck.Close() // the proxy's cleanup cuts its dial
}

func TestTCPHalfClose(t *testing.T) {
	for _, tc := range []struct {
		name string
		// server and client run on either end of the proxied connection.
		server, client func(*net.TCPConn) error
	}{
		{
			name: "client closes first, then reads the reply",
			server: func(c *net.TCPConn) error {
				got, err := io.ReadAll(c) // until the client's CloseWrite
				if err != nil {
					return err
				}
				_, err = fmt.Fprintf(c, "got %d bytes: %s", len(got), got)
				return err
			},
			client: func(c *net.TCPConn) error {
				if _, err := c.Write([]byte("request")); err != nil {
					return err
				}
				if err := c.CloseWrite(); err != nil {
					return err
				}
				got, err := io.ReadAll(c)
				if err != nil {
					return err
				}
				if want := "got 7 bytes: request"; string(got) != want {
					return fmt.Errorf("reply %q, want %q", got, want)
				}
				return nil
			},
		},
		{
			name: "server closes first, then reads the client's reply",
			server: func(c *net.TCPConn) error {
				if _, err := c.Write([]byte("greeting")); err != nil {
					return err
				}
				if err := c.CloseWrite(); err != nil {
					return err
				}
				got, err := io.ReadAll(c)
				if err != nil {
					return err
				}
				if string(got) != "goodbye" {
					return fmt.Errorf("server read %q, want goodbye", got)
				}
				return nil
			},
			client: func(c *net.TCPConn) error {
				got, err := io.ReadAll(c)
				if err != nil {
					return err
				}
				if string(got) != "greeting" {
					return fmt.Errorf("client read %q, want greeting", got)
				}
				_, err = c.Write([]byte("goodbye"))
				return err
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkNoLeaks(t)
			serverErr := make(chan error, 1)
			backend := forwardtest.StartTCPServer(t, forwardtest.Loopback("4"), func(c *net.TCPConn) {
				c.SetDeadline(time.Now().Add(forwardtest.WaitTimeout))
				serverErr <- tc.server(c)
			})
			metrics := &forwardtest.Metrics{}
			p := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) { p.Metrics = metrics })
			c := forwardtest.DialTCP(t, p.addr)
			if err := tc.client(c); err != nil {
				t.Errorf("client: %v", err)
			}
			c.Close()
			if err := <-serverErr; err != nil {
				t.Errorf("server: %v", err)
			}
			forwardtest.Eventually(t, "connection closed", func() bool { return metrics.Snapshot().Closed == 1 })
		})
	}
}

// TestTCPEndpointResetReachesClient: when the endpoint resets the connection, the client sees a
// reset too, not an orderly end of stream.
func TestTCPEndpointResetReachesClient(t *testing.T) {
	checkNoLeaks(t)
	backend := forwardtest.StartTCPServer(t, forwardtest.Loopback("4"), func(c *net.TCPConn) {
		buf := make([]byte, 5)
		io.ReadFull(c, buf)
		c.Write([]byte("partial"))
		forwardtest.ResetConn(c)
	})
	p := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, nil)
	c := forwardtest.DialTCP(t, p.addr)
	c.Write([]byte("hello"))
	_, err := io.ReadAll(c)
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("client read: %v, want ECONNRESET", err)
	}
}

func TestTCPLargeTransferIntegrity(t *testing.T) {
	checkNoLeaks(t)
	const size = 64 << 20
	backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	p := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, nil)
	c := forwardtest.DialTCP(t, p.addr)
	c.SetDeadline(time.Now().Add(5 * time.Minute))

	sent := sha256.New()
	werr := make(chan error, 1)
	go func() {
		src := io.TeeReader(io.LimitReader(rand.NewChaCha8([32]byte{7}), size), sent)
		_, err := io.CopyBuffer(c, src, make([]byte, 256<<10))
		if err == nil {
			err = c.CloseWrite()
		}
		werr <- err
	}()
	received := sha256.New()
	n, err := io.Copy(received, c)
	if err != nil {
		t.Fatalf("read: %v", err)
	}
	if err := <-werr; err != nil {
		t.Fatalf("write: %v", err)
	}
	if n != size {
		t.Fatalf("received %d bytes, want %d", n, size)
	}
	if !bytes.Equal(sent.Sum(nil), received.Sum(nil)) {
		t.Fatalf("SHA-256 of the echo %x differs from the data sent %x", received.Sum(nil), sent.Sum(nil))
	}
}

func TestTCPCloseStopsAcceptingButKeepsConnections(t *testing.T) {
	checkNoLeaks(t)
	backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	p := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, nil)
	c := forwardtest.DialTCP(t, p.addr)
	if _, err := forwardtest.RoundTrip(c, []byte("before")); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := <-p.served; err != nil {
		t.Fatalf("Serve returned %v after Close, want nil", err)
	}
	p.served <- nil // for the cleanup
	if err := p.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if c2, err := net.Dial("tcp", p.addr.String()); err == nil {
		c2.Close()
		t.Error("a new connection was accepted after Close")
	}
	if got, err := forwardtest.RoundTrip(c, []byte("after")); err != nil || string(got) != "after" {
		t.Fatalf("established connection after Close: %q, %v", got, err)
	}
}

func TestTCPShutdown(t *testing.T) {
	for _, tc := range []struct {
		name string
		// cancel: the context ends while the connection is open; else the client closes.
		cancel bool
	}{
		{name: "waits for connections to end", cancel: false},
		{name: "cuts connections when the context ends", cancel: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkNoLeaks(t)
			backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
			metrics := &forwardtest.Metrics{}
			p := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) { p.Metrics = metrics })
			c := forwardtest.DialTCP(t, p.addr)
			if _, err := forwardtest.RoundTrip(c, []byte("x")); err != nil {
				t.Fatal(err)
			}

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			shut := make(chan error, 1)
			go func() { shut <- p.Shutdown(ctx) }()
			<-p.served // Serve returns once Shutdown has closed the listener
			p.served <- nil

			// The connection still works, and Shutdown waits for it.
			if got, err := forwardtest.RoundTrip(c, []byte("still here")); err != nil || string(got) != "still here" {
				t.Fatalf("round trip during Shutdown: %q, %v", got, err)
			}
			select {
			case err := <-shut:
				t.Fatalf("Shutdown returned %v with a connection open", err)
			default:
			}

			if tc.cancel {
				cancel()
				if err := <-shut; !errors.Is(err, context.Canceled) {
					t.Errorf("Shutdown: %v, want context.Canceled", err)
				}
				if _, err := io.ReadAll(c); !errors.Is(err, syscall.ECONNRESET) {
					t.Errorf("client read after the cut: %v, want ECONNRESET", err)
				}
			} else {
				c.Close()
				if err := <-shut; err != nil {
					t.Errorf("Shutdown: %v", err)
				}
			}
			if m := metrics.Snapshot(); m.Closed != 1 {
				t.Errorf("%d connections closed, want 1", m.Closed)
			}
		})
	}
}

// TestTCPSocketOptions: both proxy sockets keep Go's defaults, TCP_NODELAY and SO_KEEPALIVE.
func TestTCPSocketOptions(t *testing.T) {
	checkNoLeaks(t)
	backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	p := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, nil)
	c := forwardtest.DialTCP(t, p.addr)
	if _, err := forwardtest.RoundTrip(c, []byte("x")); err != nil {
		t.Fatal(err)
	}
	client, endpoint := connSockets(p.Proxy)
	if client == nil || endpoint == nil {
		t.Fatal("no connection registered")
	}
	socks := map[string]syscall.Conn{"client side": client, "endpoint side": endpoint}
	for side, s := range socks {
		for _, opt := range []struct {
			name       string
			level, opt int
		}{
			{"TCP_NODELAY", unix.IPPROTO_TCP, unix.TCP_NODELAY},
			{"SO_KEEPALIVE", unix.SOL_SOCKET, unix.SO_KEEPALIVE},
		} {
			rc, err := s.SyscallConn()
			if err != nil {
				t.Fatal(err)
			}
			var v int
			var gerr error
			rc.Control(func(fd uintptr) { v, gerr = unix.GetsockoptInt(int(fd), opt.level, opt.opt) })
			if gerr != nil || v == 0 {
				t.Errorf("%s: %s = %d, %v; want on", side, opt.name, v, gerr)
			}
		}
	}
}

func TestTCPServeValidation(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    *Proxy
	}{
		{"no listener", &Proxy{Chooser: &forwardtest.Chooser{}, Loops: newTestLoops(t, 1)}},
		{"no chooser", &Proxy{Listener: forwardtest.ListenTCP(t, forwardtest.Loopback("4")), Loops: newTestLoops(t, 1)}},
		{"no loops", &Proxy{Listener: forwardtest.ListenTCP(t, forwardtest.Loopback("4")), Chooser: &forwardtest.Chooser{}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.p.Serve(); err == nil {
				t.Error("Serve succeeded")
			}
			tc.p.Close()
		})
	}
}

func TestTCPCloseBeforeServe(t *testing.T) {
	checkNoLeaks(t)
	p := &Proxy{Listener: forwardtest.ListenTCP(t, forwardtest.Loopback("4")), Chooser: &forwardtest.Chooser{}, Loops: newTestLoops(t, 1)}
	if err := p.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := p.Serve(); err != nil {
		t.Fatalf("Serve after Close: %v, want nil", err)
	}
	if err := p.Shutdown(context.Background()); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
}
