package forward

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
)

// withParking gives p a Poller of its own (closed after the test's other cleanups, so after
// the proxy's Shutdown) and parks idle directions after after: what Start does with the
// proxier's Poller. It returns the Poller.
func withParking(t testing.TB, p *TCPProxy, after time.Duration) *Poller {
	t.Helper()
	poller, err := NewPoller()
	if err != nil {
		t.Fatalf("poller: %v", err)
	}
	t.Cleanup(func() { poller.Close() })
	p.poller, p.ParkIdleAfter = poller, after
	return poller
}

// copierGoroutines counts the goroutines copying a direction of a connection: waiting in
// their copy or running it.
func copierGoroutines() int { return countCopiers(false) }

// waitingCopiers counts the copier goroutines waiting in the runtime's network poller (not
// spinning).
func waitingCopiers() int { return countCopiers(true) }

func countCopiers(waiting bool) int {
	buf := allStacks()
	n := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "forward.(*direction)") && (!waiting || strings.Contains(g, "[IO wait")) {
			n++
		}
	}
	return n
}

// idleConns dials n connections through the proxy at addr and echoes a message on each.
func idleConns(t *testing.T, addr netip.AddrPort, n int) []*net.TCPConn {
	t.Helper()
	conns := make([]*net.TCPConn, n)
	for i := range conns {
		conns[i] = dialTCPTest(t, addr)
		msg := fmt.Sprintf("hello %d", i)
		if got, err := roundTrip(conns[i], []byte(msg)); err != nil || string(got) != msg {
			t.Fatalf("connection %d: %q, %v", i, got, err)
		}
	}
	return conns
}

// awaitParked waits until no goroutine copies for the proxy's connections.
func awaitParked(t *testing.T) {
	t.Helper()
	eventually(t, "idle directions to give their goroutines up", func() bool { return copierGoroutines() == 0 })
}

// TestTCPIdleConnectionsHoldNoGoroutine: idle connections of a proxy with a Poller give up
// their copier goroutines (after ParkIdleAfter, or at once), and each still works afterwards,
// both ways, with half-closes passed on; ParkIdleAfter < 0 keeps them (the check of the check).
func TestTCPIdleConnectionsHoldNoGoroutine(t *testing.T) {
	const n = 40
	for _, tc := range []struct {
		name  string
		after time.Duration
	}{
		{"at once", time.Nanosecond},
		{"after 50ms", 50 * time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkNoLeaks(t)
			checkNoFDLeaks(t)
			backend := startTCPEcho(t, loopback("4"))
			metrics := &fakeMetrics{}
			p := startTCPProxy(t, "4", &fakeChooser{endpoints: []netip.AddrPort{backend}}, func(p *TCPProxy) {
				p.Metrics = metrics
				withParking(t, p, tc.after)
			})
			goroutines := runtime.NumGoroutine()
			conns := idleConns(t, p.addr, n)
			deadline := time.Now().Add(waitTimeout)
			for copierGoroutines() > 0 && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
			// The echo server holds one goroutine per connection; the proxy must hold none.
			if got, extra := copierGoroutines(), runtime.NumGoroutine()-goroutines; got > 0 || extra >= 2*n {
				t.Fatalf("%d idle connections hold %d copier goroutines (%d goroutines more in all)", n, got, extra)
			}
			var sent int64 // each way: what the echo server sends back
			for i := range conns {
				sent += int64(len(fmt.Sprintf("hello %d", i)))
			}
			for round := range 2 { // the second after parking again: splicers shelved twice
				for i, c := range conns {
					msg := strings.Repeat(fmt.Sprintf("again %d ", i), 1+i*100) // some fill the copy buffer: spliced
					if got, err := roundTrip(c, []byte(msg)); err != nil || string(got) != msg {
						t.Fatalf("round %d, connection %d after parking: %d bytes, %v", round, i, len(got), err)
					}
					sent += int64(len(msg))
				}
				awaitParked(t)
			}
			// Half-close: the client's EOF reaches the echo server, whose EOF comes back,
			// through directions that were parked.
			for i, c := range conns {
				if err := c.CloseWrite(); err != nil {
					t.Fatal(err)
				}
				if rest, err := io.ReadAll(c); err != nil || len(rest) != 0 {
					t.Fatalf("connection %d after its half-close: %q, %v", i, rest, err)
				}
			}
			eventually(t, "connections closed", func() bool { return metrics.snapshot().closed == n })
			// The bytes of every park-and-resume counted: parked directions carry what their
			// splicers wrote (see direction.shelve).
			if s := metrics.snapshot(); s.toEndpoint != sent || s.fromEndpoint != sent {
				t.Fatalf("bytes copied: %d to endpoints and %d from them, want %d each way", s.toEndpoint, s.fromEndpoint, sent)
			}
		})
	}
}

// TestTCPParkedIdleTimeout: a connection whose directions are parked is still reset after
// IdleTimeout without data, and not before.
func TestTCPParkedIdleTimeout(t *testing.T) {
	checkNoLeaks(t)
	checkNoFDLeaks(t)
	const idle = 300 * time.Millisecond
	backend := startTCPEcho(t, loopback("4"))
	metrics := &fakeMetrics{}
	p := startTCPProxy(t, "4", &fakeChooser{endpoints: []netip.AddrPort{backend}}, func(p *TCPProxy) {
		p.Metrics, p.IdleTimeout = metrics, idle
		withParking(t, p, time.Nanosecond)
	})
	c := idleConns(t, p.addr, 1)[0]
	awaitParked(t)
	// Data one way keeps the connection (both directions share the clock).
	time.Sleep(idle / 2)
	if _, err := roundTrip(c, []byte("keep")); err != nil {
		t.Fatalf("round trip within the idle timeout: %v", err)
	}
	start := time.Now()
	awaitParked(t)
	c.SetReadDeadline(time.Now().Add(waitTimeout))
	_, err := c.Read(make([]byte, 1))
	elapsed := time.Since(start)
	if !errors.Is(err, syscall.ECONNRESET) && !errors.Is(err, io.EOF) {
		t.Fatalf("read of an idle connection: %v, want a reset", err)
	}
	if elapsed < idle-20*time.Millisecond || elapsed > idle+time.Second {
		t.Errorf("idle connection ended after %v, want about %v", elapsed, idle)
	}
	eventually(t, "connection closed", func() bool { return metrics.snapshot().closed == 1 })
}

// TestTCPShutdownCutsParked: Shutdown whose context ends cuts connections whose directions are
// parked: their clients see a reset, and no goroutine or descriptor is left. Shutdown without
// a deadline waits for them as for any connection.
func TestTCPShutdownCutsParked(t *testing.T) {
	checkNoLeaks(t)
	checkNoFDLeaks(t)
	const n = 10
	backend := startTCPEcho(t, loopback("4"))
	p := startTCPProxy(t, "4", &fakeChooser{endpoints: []netip.AddrPort{backend}}, func(p *TCPProxy) {
		withParking(t, p, time.Nanosecond)
	})
	conns := idleConns(t, p.addr, n)
	awaitParked(t)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	if err := p.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Shutdown: %v, want the deadline's error", err)
	}
	if d := time.Since(start); d < 150*time.Millisecond {
		t.Errorf("Shutdown returned after %v, before its deadline: it did not wait for the parked connections", d)
	}
	for i, c := range conns {
		c.SetReadDeadline(time.Now().Add(waitTimeout))
		if _, err := c.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
			t.Errorf("connection %d after Shutdown: %v, want a reset", i, err)
		}
	}
}

// TestTCPParkedPeerReset: a reset from the endpoint wakes the parked direction, which resets
// the client.
func TestTCPParkedPeerReset(t *testing.T) {
	checkNoLeaks(t)
	checkNoFDLeaks(t)
	reset := make(chan struct{})
	backend := startTCPServer(t, loopback("4"), func(c *net.TCPConn) {
		buf := make([]byte, 5)
		io.ReadFull(c, buf)
		c.Write(buf)
		<-reset
		resetConn(c)
	})
	metrics := &fakeMetrics{}
	p := startTCPProxy(t, "4", &fakeChooser{endpoints: []netip.AddrPort{backend}}, func(p *TCPProxy) {
		p.Metrics = metrics
		withParking(t, p, time.Nanosecond)
	})
	c := dialTCPTest(t, p.addr)
	if _, err := roundTrip(c, []byte("hello")); err != nil {
		t.Fatal(err)
	}
	awaitParked(t)
	close(reset)
	if _, err := io.ReadAll(c); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("client read after the endpoint's reset: %v, want ECONNRESET", err)
	}
	eventually(t, "connection closed", func() bool { return metrics.snapshot().closed == 1 })
}

// TestTCPHandOverParked: Freeze stops connections whose directions are parked (no deadline
// wakes them: the freeze must) and the adopter carries on; Thaw does likewise.
func TestTCPHandOverParked(t *testing.T) {
	for _, thaw := range []bool{false, true} {
		t.Run(fmt.Sprintf("thaw=%v", thaw), func(t *testing.T) {
			checkNoLeaks(t)
			checkNoFDLeaks(t)
			const n = 5
			backend := startTCPEcho(t, loopback("4"))
			chooser := &fakeChooser{endpoints: []netip.AddrPort{backend}}
			a := startTCPProxy(t, "4", chooser, func(p *TCPProxy) { withParking(t, p, time.Nanosecond) })
			conns := idleConns(t, a.addr, n)
			awaitParked(t)
			ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
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
				_, plain := handOverTCP(t, a, false, chooser, func(p *TCPProxy) { withParking(t, p, time.Nanosecond) })
				if len(plain) != n {
					t.Errorf("Freeze exported %d connections, want %d", len(plain), n)
				}
			}
			for i, c := range conns {
				msg := fmt.Sprintf("after %d", i)
				if got, err := roundTrip(c, []byte(msg)); err != nil || string(got) != msg {
					t.Fatalf("connection %d after the hand-over: %q, %v", i, got, err)
				}
			}
			awaitParked(t) // parked again, on the adopter's Poller
			for i, c := range conns {
				c.CloseWrite()
				if rest, err := io.ReadAll(c); err != nil || len(rest) != 0 {
					t.Fatalf("connection %d after its half-close: %q, %v", i, rest, err)
				}
			}
		})
	}
}

// TestTCPPollerClosedUnderParked: closing the Poller under parked connections resumes them; they
// go on with goroutines of their own.
func TestTCPPollerClosedUnderParked(t *testing.T) {
	checkNoLeaks(t)
	checkNoFDLeaks(t)
	const n = 5
	backend := startTCPEcho(t, loopback("4"))
	var poller *Poller
	p := startTCPProxy(t, "4", &fakeChooser{endpoints: []netip.AddrPort{backend}}, func(p *TCPProxy) {
		poller = withParking(t, p, time.Nanosecond)
	})
	conns := idleConns(t, p.addr, n)
	awaitParked(t)
	if err := poller.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	eventually(t, "directions back on goroutines", func() bool { return copierGoroutines() == 2*n })
	for i, c := range conns {
		msg := fmt.Sprintf("after %d", i)
		if got, err := roundTrip(c, []byte(msg)); err != nil || string(got) != msg {
			t.Fatalf("connection %d after the Poller closed: %q, %v", i, got, err)
		}
	}
	// They tried to park again, failed, and wait on their goroutines (no spinning).
	eventually(t, "directions waiting on their goroutines", func() bool { return waitingCopiers() == 2*n })
}

// TestTCPAdoptBeforeStartParks: connections adopted before Start (as the proxier does) park on
// Start's Poller; adopted before Serve, which has none, they keep waiting on their goroutines.
func TestTCPAdoptBeforeStartParks(t *testing.T) {
	for _, start := range []bool{true, false} {
		t.Run(fmt.Sprintf("start=%v", start), func(t *testing.T) {
			checkNoLeaks(t)
			checkNoFDLeaks(t)
			const n = 4
			backend := startTCPEcho(t, loopback("4"))
			chooser := &fakeChooser{endpoints: []netip.AddrPort{backend}}
			a := startTCPProxy(t, "4", chooser, func(p *TCPProxy) { p.ParkIdleAfter = -1 })
			conns := idleConns(t, a.addr, n)
			st, err := a.Freeze(context.Background())
			if err != nil {
				t.Fatalf("Freeze: %v", err)
			}
			<-a.served
			a.served <- nil
			ln, err := TCPListenerFromFile(st.Listener)
			if err != nil {
				t.Fatal(err)
			}
			poller, err := NewPoller()
			if err != nil {
				t.Fatal(err)
			}
			defer poller.Close()
			b := &TCPProxy{Listener: ln, Chooser: chooser, Log: new(testLogger(t)), ParkIdleAfter: 20 * time.Millisecond}
			if err := b.Adopt(st.Conns); err != nil {
				t.Fatalf("Adopt: %v", err)
			}
			a.Release()
			served := make(chan error, 1)
			if start {
				if err := b.Start(poller); err != nil {
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
			if start {
				awaitParked(t)
			} else {
				time.Sleep(100 * time.Millisecond) // a few park deadlines
				eventually(t, "directions waiting on their goroutines", func() bool { return waitingCopiers() == 2*n })
				time.Sleep(50 * time.Millisecond)
				if got := waitingCopiers(); got != 2*n {
					t.Fatalf("%d copiers waiting on their goroutines, want %d: spinning?", got, 2*n)
				}
			}
			for i, c := range conns {
				msg := fmt.Sprintf("adopted %d", i)
				if got, err := roundTrip(c, []byte(msg)); err != nil || string(got) != msg {
					t.Fatalf("connection %d after adoption: %q, %v", i, got, err)
				}
			}
		})
	}
}

// TestTCPParkedChurn: connections that end while others park and new ones reuse their
// descriptors' numbers: each socket is taken off the Poller before it is closed, so no stale
// registration or Disarm reaches a new connection's (which would then never be woken).
func TestTCPParkedChurn(t *testing.T) {
	checkNoLeaks(t)
	checkNoFDLeaks(t)
	backend := startTCPEcho(t, loopback("4"))
	metrics := &fakeMetrics{}
	p := startTCPProxy(t, "4", &fakeChooser{endpoints: []netip.AddrPort{backend}}, func(p *TCPProxy) {
		p.Metrics = metrics
		withParking(t, p, time.Nanosecond)
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
					c.SetDeadline(time.Now().Add(waitTimeout))
					msg := fmt.Sprintf("round %d conn %d", round, i)
					var got []byte
					if got, err = roundTrip(c, []byte(msg)); err == nil && string(got) != msg {
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
				resetConn(c)
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
		awaitParked(t)
		for i, c := range live {
			msg := fmt.Sprintf("check %d %d", round, i)
			if got, err := roundTrip(c, []byte(msg)); err != nil || string(got) != msg {
				t.Fatalf("round %d: live connection %d: %q, %v", round, i, got, err)
			}
		}
	}
	for _, c := range live {
		c.Close()
	}
	eventually(t, "connections closed", func() bool { return metrics.snapshot().closed == opened })
}
