//go:build linux

package tcp

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// Idle connections on the event loops: they hold no goroutine, and every event that ends or
// moves one (data, a timeout, a reset, Shutdown, a hand-over, descriptor reuse) still reaches
// it.

// idleConns dials n connections through the proxy at addr and echoes a message on each.
func idleConns(t *testing.T, addr netip.AddrPort, n int) []*net.TCPConn {
	t.Helper()
	conns := make([]*net.TCPConn, n)
	for i := range conns {
		conns[i] = forwardtest.DialTCP(t, addr)
		msg := fmt.Sprintf("hello %d", i)
		if got, err := forwardtest.RoundTrip(conns[i], []byte(msg)); err != nil || string(got) != msg {
			t.Fatalf("connection %d: %q, %v", i, got, err)
		}
	}
	return conns
}

// settle lets the loops finish the turn of the last exchange, so that the connections are idle
// when the test goes on.
func settle() { time.Sleep(20 * time.Millisecond) }

// TestTCPIdleConnectionsHoldNoGoroutine: idle connections hold no goroutine of the proxy, and
// each still works afterwards, both ways, spliced or copied, with half-closes passed on.
func TestTCPIdleConnectionsHoldNoGoroutine(t *testing.T) {
	const n = 40
	checkNoLeaks(t)
	forwardtest.CheckNoFDLeaks(t)
	backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	metrics := &forwardtest.Metrics{}
	p := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.Metrics = metrics
	})
	goroutines := runtime.NumGoroutine()
	conns := idleConns(t, p.addr, n)
	// The echo server holds one goroutine per connection; the proxy must hold none.
	if extra := runtime.NumGoroutine() - goroutines; extra > n {
		t.Fatalf("%d idle connections: %d goroutines more in all, want at most the echo server's %d", n, extra, n)
	}
	var sent int64 // each way: what the echo server sends back
	for i := range conns {
		sent += int64(len(fmt.Sprintf("hello %d", i)))
	}
	for round := range 2 {
		for i, c := range conns {
			msg := strings.Repeat(fmt.Sprintf("again %d ", i), 1+i*100) // some fill the loop's buffer: spliced
			if got, err := forwardtest.RoundTrip(c, []byte(msg)); err != nil || string(got) != msg {
				t.Fatalf("round %d, connection %d after idling: %d bytes, %v", round, i, len(got), err)
			}
			sent += int64(len(msg))
		}
		settle()
	}
	// Half-close: the client's EOF reaches the echo server, whose EOF comes back,
	// through directions that were idle.
	for i, c := range conns {
		if err := c.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		if rest, err := io.ReadAll(c); err != nil || len(rest) != 0 {
			t.Fatalf("connection %d after its half-close: %q, %v", i, rest, err)
		}
	}
	forwardtest.Eventually(t, "connections closed", func() bool { return metrics.Snapshot().Closed == n })
	// The bytes of every exchange counted.
	if s := metrics.Snapshot(); s.ToEndpoint != sent || s.FromEndpoint != sent {
		t.Fatalf("bytes copied: %d to endpoints and %d from them, want %d each way", s.ToEndpoint, s.FromEndpoint, sent)
	}
}

// TestTCPIdleTimeoutRenewedByData: data one way renews a connection's IdleTimeout (both
// directions share the clock); it is reset after IdleTimeout without data, and not before.
func TestTCPIdleTimeoutRenewedByData(t *testing.T) {
	checkNoLeaks(t)
	forwardtest.CheckNoFDLeaks(t)
	const idle = 300 * time.Millisecond
	backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	metrics := &forwardtest.Metrics{}
	p := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.Metrics, p.IdleTimeout = metrics, idle
	})
	c := idleConns(t, p.addr, 1)[0]
	// Data one way keeps the connection (both directions share the clock).
	time.Sleep(idle / 2)
	if _, err := forwardtest.RoundTrip(c, []byte("keep")); err != nil {
		t.Fatalf("round trip within the idle timeout: %v", err)
	}
	start := time.Now()
	c.SetReadDeadline(time.Now().Add(forwardtest.WaitTimeout))
	_, err := c.Read(make([]byte, 1))
	elapsed := time.Since(start)
	if !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, io.EOF) {
		t.Fatalf("read of an idle connection: %v, want a reset", err)
	}
	if elapsed < idle-20*time.Millisecond || elapsed > idle+time.Second {
		t.Errorf("idle connection ended after %v, want about %v", elapsed, idle)
	}
	forwardtest.Eventually(t, "connection closed", func() bool { return metrics.Snapshot().Closed == 1 })
}

// TestTCPShutdownCutsIdle: Shutdown waits for idle connections until its context ends, then
// cuts them: their clients see a reset, and no goroutine or descriptor is left.
func TestTCPShutdownCutsIdle(t *testing.T) {
	checkNoLeaks(t)
	forwardtest.CheckNoFDLeaks(t)
	const n = 10
	backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	p := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, nil)
	conns := idleConns(t, p.addr, n)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	if err := p.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shutdown: %v, want the deadline's error", err)
	}
	if d := time.Since(start); d < 150*time.Millisecond {
		t.Errorf("Shutdown returned after %v, before its deadline: it did not wait for the idle connections", d)
	}
	for i, c := range conns {
		c.SetReadDeadline(time.Now().Add(forwardtest.WaitTimeout))
		if _, err := c.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
			t.Errorf("connection %d after Shutdown: %v, want a reset", i, err)
		}
	}
}

// TestTCPIdlePeerReset: a reset from the endpoint of an idle connection reaches its client as
// a reset.
func TestTCPIdlePeerReset(t *testing.T) {
	checkNoLeaks(t)
	forwardtest.CheckNoFDLeaks(t)
	reset := make(chan struct{})
	backend := forwardtest.StartTCPServer(t, forwardtest.Loopback("4"), func(c *net.TCPConn) {
		buf := make([]byte, 5)
		io.ReadFull(c, buf)
		c.Write(buf)
		<-reset
		forwardtest.ResetConn(c)
	})
	metrics := &forwardtest.Metrics{}
	p := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.Metrics = metrics
	})
	c := forwardtest.DialTCP(t, p.addr)
	if _, err := forwardtest.RoundTrip(c, []byte("hello")); err != nil {
		t.Fatal(err)
	}
	settle()
	close(reset)
	if _, err := io.ReadAll(c); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("client read after the endpoint's reset: %v, want ECONNRESET", err)
	}
	forwardtest.Eventually(t, "connection closed", func() bool { return metrics.Snapshot().Closed == 1 })
}

// TestTCPHandOverIdle: Freeze stops idle connections (no event wakes them: the freeze must)
// and the adopter carries on; Thaw does likewise.
func TestTCPHandOverIdle(t *testing.T) {
	for _, thaw := range []bool{false, true} {
		t.Run(fmt.Sprintf("thaw=%v", thaw), func(t *testing.T) {
			checkNoLeaks(t)
			forwardtest.CheckNoFDLeaks(t)
			const n = 5
			backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
			chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}
			a := startTCPProxy(t, "4", chooser, nil)
			conns := idleConns(t, a.addr, n)
			settle()
			ctx, cancel := context.WithTimeout(context.Background(), forwardtest.WaitTimeout)
			defer cancel()
			if thaw {
				st, err := a.Freeze(ctx)
				if err != nil {
					t.Fatalf("Freeze: %v", err)
				}
				if len(st.Conns) != n {
					t.Errorf("Freeze exported %d connections, want %d", len(st.Conns), n)
				}
				st.Close()
				<-a.served
				if err := a.Thaw(); err != nil {
					t.Fatalf("Thaw: %v", err)
				}
				go func() { a.served <- a.Serve() }()
			} else {
				_, plain := handOverTCP(t, a, false, chooser, nil)
				if len(plain) != n {
					t.Errorf("Freeze exported %d connections, want %d", len(plain), n)
				}
			}
			for i, c := range conns {
				msg := fmt.Sprintf("after %d", i)
				if got, err := forwardtest.RoundTrip(c, []byte(msg)); err != nil || string(got) != msg {
					t.Fatalf("connection %d after the hand-over: %q, %v", i, got, err)
				}
			}
			settle() // idle again, on the adopter's loops
			for i, c := range conns {
				c.CloseWrite()
				if rest, err := io.ReadAll(c); err != nil || len(rest) != 0 {
					t.Fatalf("connection %d after its half-close: %q, %v", i, rest, err)
				}
			}
		})
	}
}

// TestTCPAdoptBeforeStart: connections adopted before Start (as the proxier does) or Serve
// relay once the proxy serves.
func TestTCPAdoptBeforeStart(t *testing.T) {
	for _, start := range []bool{true, false} {
		t.Run(fmt.Sprintf("start=%v", start), func(t *testing.T) {
			checkNoLeaks(t)
			forwardtest.CheckNoFDLeaks(t)
			const n = 4
			backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
			chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}
			a := startTCPProxy(t, "4", chooser, nil)
			conns := idleConns(t, a.addr, n)
			st, err := a.Freeze(context.Background())
			if err != nil {
				t.Fatalf("Freeze: %v", err)
			}
			<-a.served
			a.served <- nil
			ln, err := ListenerFromFile(st.Listener)
			if err != nil {
				t.Fatal(err)
			}
			b := &Proxy{Listener: ln, Chooser: chooser, Log: new(forwardtest.Logger(t)), Loops: newTestLoops(t, 2)}
			if err := b.Adopt(st.Conns); err != nil {
				t.Fatalf("Adopt: %v", err)
			}
			a.Release()
			served := make(chan error, 1)
			if start {
				if err := b.Start(); err != nil {
					t.Fatal(err)
				}
				served <- nil
			} else {
				go func() { served <- b.Serve() }()
			}
			defer func() {
				ctx, cancel := context.WithCancel(context.Background())
				cancel()
				b.Shutdown(ctx)
				<-served
			}()
			for i, c := range conns {
				msg := fmt.Sprintf("adopted %d", i)
				if got, err := forwardtest.RoundTrip(c, []byte(msg)); err != nil || string(got) != msg {
					t.Fatalf("connection %d after adoption: %q, %v", i, got, err)
				}
			}
		})
	}
}

// TestTCPIdleChurn: connections that end while others idle and new ones reuse their
// descriptors' numbers: each socket is taken off its loop's epoll set before it is closed, so no
// stale registration reaches a new connection's (which would then never be woken).
func TestTCPIdleChurn(t *testing.T) {
	checkNoLeaks(t)
	forwardtest.CheckNoFDLeaks(t)
	backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	metrics := &forwardtest.Metrics{}
	p := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.Metrics = metrics
	})
	var live []*net.TCPConn
	opened := 0
	for round := range 6 {
		fresh := make(chan *net.TCPConn, 16)
		errs := make(chan error, 16)
		go func() { // new connections while old ones close
			for i := range 16 {
				c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(p.addr))
				if err == nil {
					c.SetDeadline(time.Now().Add(forwardtest.WaitTimeout))
					msg := fmt.Sprintf("round %d conn %d", round, i)
					var got []byte
					if got, err = forwardtest.RoundTrip(c, []byte(msg)); err == nil && string(got) != msg {
						err = fmt.Errorf("echo %q, want %q", got, msg)
					}
				}
				errs <- err
				fresh <- c
			}
		}()
		// Half of the live ones end: some with a reset, some with a close.
		for i, c := range live[:len(live)/2] {
			if i%2 == 0 {
				forwardtest.ResetConn(c)
			} else {
				c.Close()
			}
		}
		live = live[len(live)/2:]
		for range 16 {
			if err := <-errs; err != nil {
				t.Fatalf("round %d: new connection: %v", round, err)
			}
			c := <-fresh
			t.Cleanup(func() { c.Close() })
			live = append(live, c)
			opened++
		}
		settle()
		for i, c := range live {
			msg := fmt.Sprintf("check %d %d", round, i)
			if got, err := forwardtest.RoundTrip(c, []byte(msg)); err != nil || string(got) != msg {
				t.Fatalf("round %d: live connection %d: %q, %v", round, i, got, err)
			}
		}
	}
	for _, c := range live {
		c.Close()
	}
	forwardtest.Eventually(t, "connections closed", func() bool { return metrics.Snapshot().Closed == opened })
}
