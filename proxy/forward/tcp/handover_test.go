//go:build linux

package tcp

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/proxyproto"
	"golang.org/x/sys/unix"
)

// patternPeriod: the numbered byte pattern of a stream repeats every 251 bytes, a prime, so
// that a lost, repeated or reordered chunk of any power-of-two size shows.
const patternPeriod = 251

// patternChunk is the most patternAt returns at once.
const patternChunk = 64 << 10

var patternBuf = func() []byte {
	b := make([]byte, patternChunk+patternPeriod)
	for i := range b {
		b[i] = byte(i % patternPeriod)
	}
	return b
}()

// patternAt returns n ≤ patternChunk bytes of stream seed's pattern from offset off.
func patternAt(seed, off int64, n int) []byte {
	k := (off + seed) % patternPeriod
	return patternBuf[k : k+int64(n)]
}

// writePattern writes n bytes of seed's pattern to c, then half-closes it.
func writePattern(c *net.TCPConn, seed, n int64) error {
	for off := int64(0); off < n; {
		w, err := c.Write(patternAt(seed, off, int(min(n-off, patternChunk))))
		off += int64(w)
		if err != nil {
			return fmt.Errorf("write at byte %d: %w", off, err)
		}
	}
	return c.CloseWrite()
}

// readPattern reads c until EOF and checks that it got exactly n bytes of seed's pattern: each
// byte once, in order.
func readPattern(c *net.TCPConn, seed, n int64) error {
	buf := make([]byte, patternChunk)
	var off int64
	for {
		m, err := c.Read(buf)
		if m > 0 {
			if off+int64(m) > n {
				return fmt.Errorf("got %d bytes, more than the %d sent", off+int64(m), n)
			}
			if want := patternAt(seed, off, m); !bytes.Equal(buf[:m], want) {
				i := 0
				for buf[i] == want[i] {
					i++
				}
				return fmt.Errorf("byte %d is %d, want %d", off+int64(i), buf[i], want[i])
			}
			off += int64(m)
		}
		switch {
		case errors.Is(err, io.EOF):
			if off != n {
				return fmt.Errorf("EOF after %d bytes, want %d", off, n)
			}
			return nil
		case err != nil:
			return fmt.Errorf("read at byte %d: %w", off, err)
		}
	}
}

// streamPeer sends n bytes of sendSeed's pattern on c, and once gate is closed reads and checks
// n bytes of recvSeed's. Until then it reads nothing, so the data piles up in the proxy.
func streamPeer(c *net.TCPConn, sendSeed, recvSeed, n int64, gate <-chan struct{}) error {
	werr := make(chan error, 1)
	go func() { werr <- writePattern(c, sendSeed, n) }()
	<-gate
	rerr := readPattern(c, recvSeed, n)
	return errors.Join(rerr, <-werr)
}

// streamSize is the size of a stream that certainly fills a proxy's splice pipe while the
// reader reads nothing: more than the largest send buffer of the proxy's outgoing socket plus
// the pipe, with a small receive buffer at the reader.
func streamSize(t *testing.T) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/sys/net/ipv4/tcp_wmem")
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b))
	wmemMax, err := strconv.ParseInt(f[len(f)-1], 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return wmemMax + 4*pipeSize
}

// fixSendBuffer sets SO_SNDBUF on a listening socket, which turns the send buffer's autotuning
// off for the connections it accepts.
func fixSendBuffer(t testing.TB, ln *net.TCPListener, size int) {
	t.Helper()
	rc, err := ln.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_SNDBUF, size)
	}); err != nil || serr != nil {
		t.Fatalf("SO_SNDBUF on the listener: %v %v", err, serr)
	}
}

// serveAdopted serves a new Proxy on ln after adopting conns; the test's cleanup shuts it
// down.
func serveAdopted(t *testing.T, ln *net.TCPListener, chooser forward.Chooser, configure func(*Proxy), conns []forward.TCPConnState) *proxyRun {
	t.Helper()
	p := &Proxy{Listener: ln, Chooser: chooser, Log: new(forwardtest.Logger(t))}
	if configure != nil {
		configure(p)
	}
	loopForTest(t, p)
	if err := p.Adopt(conns); err != nil {
		t.Errorf("Adopt: %v", err)
	}
	r := &proxyRun{Proxy: p, addr: forwardtest.ListenerAddr(ln), served: make(chan error, 1)}
	go func() { r.served <- p.Serve() }()
	t.Cleanup(func() {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		p.Shutdown(ctx)
		if err := <-r.served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return r
}

// plainTCPState is a TCPState's plain data, kept for checks after its files are gone.
func plainTCPState(st forward.TCPState) []forward.TCPConnState {
	var out []forward.TCPConnState
	for _, c := range st.Conns {
		c.Client, c.Backend = nil, nil
		out = append(out, c)
	}
	return out
}

// handOverTCP freezes a and has a new proxy (configured by configure) adopt its state, passed
// through a Unix socket as to another process when wire is set, directly (the resume path)
// otherwise; then a is released. It returns the new proxy and the plain data of the state.
func handOverTCP(t *testing.T, a *proxyRun, wire bool, chooser forward.Chooser, configure func(*Proxy)) (*proxyRun, []forward.TCPConnState) {
	t.Helper()
	st, err := a.Freeze(context.Background())
	if err != nil {
		t.Fatalf("Freeze: %v", err)
	}
	if err := <-a.served; err != nil {
		t.Errorf("Serve of the frozen proxy: %v", err)
	}
	a.served <- nil // for the cleanup
	plain := plainTCPState(st)
	if wire {
		st = passTCPState(t, st)
	}
	ln, err := ListenerFromFile(st.Listener)
	if err != nil {
		t.Fatalf("ListenerFromFile: %v", err)
	}
	b := serveAdopted(t, ln, chooser, configure, st.Conns)
	a.Release()
	return b, plain
}

// midStream is a TCP connection through a proxy (a, counting into metrics) that streams a
// numbered pattern of n bytes both ways while neither side reads, until finish: each direction
// has bytes in a's splice pipe when startMidStream returns.
type midStream struct {
	n                      int64
	a                      *proxyRun
	backend                netip.AddrPort
	chooser                *forwardtest.Chooser
	metrics                *forwardtest.Metrics
	gate                   chan struct{}
	clientErr, endpointErr chan error
}

// startMidStream starts a midStream, with the descriptor and goroutine leak checks of the test.
func startMidStream(t *testing.T) *midStream {
	t.Helper()
	forwardtest.CheckNoFDLeaks(t)
	checkNoLeaks(t)
	ms := &midStream{n: streamSize(t), metrics: &forwardtest.Metrics{}, gate: make(chan struct{}),
		clientErr: make(chan error, 1), endpointErr: make(chan error, 1)}
	ms.backend = forwardtest.StartTCPServer(t, forwardtest.Loopback("4"), func(c *net.TCPConn) {
		c.SetReadBuffer(64 << 10)
		ms.endpointErr <- streamPeer(c, 2, 1, ms.n, ms.gate)
	})
	ms.chooser = &forwardtest.Chooser{Endpoints: []netip.AddrPort{ms.backend}}
	// The proxy's sockets to the client (inherited from the listener) and to the endpoint get
	// fixed send buffers: one that grows (the kernel's autotuning) could drain the pipe toward
	// its peer between the check below and the freeze.
	ms.a = startTCPProxy(t, "4", ms.chooser, func(p *Proxy) {
		p.Metrics = ms.metrics
		fixSendBuffer(t, p.Listener, 64<<10)
	})
	c := forwardtest.DialTCP(t, ms.a.addr)
	c.SetReadBuffer(64 << 10)
	go func() { ms.clientErr <- streamPeer(c, 1, 2, ms.n, ms.gate) }()
	// The loop's pending bytes, which stay until the peers read.
	forwardtest.Eventually(t, "bytes pending both ways on the event loop", func() bool { return loopPendingBoth(ms.a.Proxy) })
	return ms
}

// finish lets both sides read and checks that each received the other's whole stream.
func (ms *midStream) finish(t *testing.T) {
	t.Helper()
	close(ms.gate)
	if err := <-ms.clientErr; err != nil {
		t.Errorf("client: %v", err)
	}
	if err := <-ms.endpointErr; err != nil {
		t.Errorf("endpoint: %v", err)
	}
}

// TestTCPHandOverMidStream streams a numbered pattern both ways through proxy A while neither
// side reads, so that each direction has bytes in A's splice pipe; freezes A, has B adopt the
// connection and releases A; then lets both sides read. Every byte must arrive once and in
// order, the connection must end normally through B, and the byte counts of A and B must add
// up to the streams.
func TestTCPHandOverMidStream(t *testing.T) {
	for _, mode := range []string{"wire", "resume"} {
		t.Run(mode, func(t *testing.T) { testTCPHandOverMidStream(t, mode == "wire") })
	}
}

func testTCPHandOverMidStream(t *testing.T, wire bool) {
	ms := startMidStream(t)
	n, a, chooser, ma, mb := ms.n, ms.a, ms.chooser, ms.metrics, &forwardtest.Metrics{}

	_, st := handOverTCP(t, a, wire, chooser, func(p *Proxy) { p.Metrics = mb })
	if len(st) != 1 {
		t.Fatalf("frozen state has %d connections, want 1", len(st))
	}
	cs := st[0]
	t.Logf("handed over with %d bytes pending to the endpoint, %d to the client", len(cs.ToEndpoint), len(cs.ToClient))
	if len(cs.ToEndpoint) == 0 || len(cs.ToClient) == 0 || cs.ToEndpointDone || cs.ToClientDone || cs.Endpoint != ms.backend {
		t.Errorf("frozen connection: %d and %d bytes pending, done %v/%v, endpoint %v; want bytes pending both ways (they sat in the pipes), nothing done, endpoint %v",
			len(cs.ToEndpoint), len(cs.ToClient), cs.ToEndpointDone, cs.ToClientDone, cs.Endpoint, ms.backend)
	}
	ms.finish(t)
	forwardtest.Eventually(t, "B to close the connection", func() bool { return mb.Snapshot().Closed == 1 })
	sa, sb := ma.Snapshot(), mb.Snapshot()
	if sa.Accepted != 1 || sa.Closed != 0 || sa.Failed != 0 || sb.Accepted != 1 || sb.Failed != 0 {
		t.Errorf("metrics: A %+v, B %+v; want A: 1 accepted, none closed or failed; B: 1 accepted (adopted), 1 closed", sa, sb)
	}
	if to, from := sa.ToEndpoint+sb.ToEndpoint, sa.FromEndpoint+sb.FromEndpoint; to != n || from != n {
		t.Errorf("bytes counted by A and B: %d to and %d from the endpoint, want %d each", to, from, n)
	}
}

// TestTCPHandOverHalfClosed hands over a connection one direction of which has ended: it stays
// half-closed, and the other direction goes on and ends normally.
func TestTCPHandOverHalfClosed(t *testing.T) {
	for _, tc := range []struct {
		name string
		// endpoint and client run on either end; freeze is closed when the connection is
		// half-closed, and the hand-over is done when gate closes.
		endpoint, client   func(c *net.TCPConn, freeze chan<- struct{}, gate <-chan struct{}) error
		wantToEndpointDone bool
		wantToClientDone   bool
	}{
		{
			name: "client closed first",
			endpoint: func(c *net.TCPConn, freeze chan<- struct{}, gate <-chan struct{}) error {
				got, err := io.ReadAll(c)
				if err != nil || string(got) != "request" {
					return fmt.Errorf("endpoint read %q, %v", got, err)
				}
				close(freeze)
				<-gate
				if _, err := c.Write([]byte("reply")); err != nil {
					return err
				}
				return c.CloseWrite()
			},
			client: func(c *net.TCPConn, _ chan<- struct{}, _ <-chan struct{}) error {
				if _, err := c.Write([]byte("request")); err != nil {
					return err
				}
				if err := c.CloseWrite(); err != nil {
					return err
				}
				got, err := io.ReadAll(c)
				if err != nil || string(got) != "reply" {
					return fmt.Errorf("client read %q, %v; want reply", got, err)
				}
				return nil
			},
			wantToEndpointDone: true,
		},
		{
			name: "endpoint closed first",
			endpoint: func(c *net.TCPConn, _ chan<- struct{}, _ <-chan struct{}) error {
				if _, err := c.Write([]byte("greeting")); err != nil {
					return err
				}
				if err := c.CloseWrite(); err != nil {
					return err
				}
				got, err := io.ReadAll(c)
				if err != nil || string(got) != "goodbye" {
					return fmt.Errorf("endpoint read %q, %v; want goodbye", got, err)
				}
				return nil
			},
			client: func(c *net.TCPConn, freeze chan<- struct{}, gate <-chan struct{}) error {
				got, err := io.ReadAll(c)
				if err != nil || string(got) != "greeting" {
					return fmt.Errorf("client read %q, %v", got, err)
				}
				close(freeze)
				<-gate
				if _, err := c.Write([]byte("goodbye")); err != nil {
					return err
				}
				return c.CloseWrite()
			},
			wantToClientDone: true,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			forwardtest.CheckNoFDLeaks(t)
			checkNoLeaks(t)
			freeze, gate := make(chan struct{}), make(chan struct{})
			endpointErr := make(chan error, 1)
			backend := forwardtest.StartTCPServer(t, forwardtest.Loopback("4"), func(c *net.TCPConn) {
				endpointErr <- tc.endpoint(c, freeze, gate)
			})
			chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}
			a := startTCPProxy(t, "4", chooser, nil)
			c := forwardtest.DialTCP(t, a.addr)
			clientErr := make(chan error, 1)
			go func() { clientErr <- tc.client(c, freeze, gate) }()
			<-freeze
			// The proxy passed the EOF on before the other end could read it, so the frozen
			// direction is done.
			mb := &forwardtest.Metrics{}
			_, st := handOverTCP(t, a, true, chooser, func(p *Proxy) { p.Metrics = mb })
			close(gate)
			if len(st) != 1 || st[0].ToEndpointDone != tc.wantToEndpointDone || st[0].ToClientDone != tc.wantToClientDone ||
				len(st[0].ToEndpoint)+len(st[0].ToClient) != 0 {
				t.Errorf("frozen state %+v; want one connection, done to endpoint %v, to client %v, nothing pending",
					st, tc.wantToEndpointDone, tc.wantToClientDone)
			}
			if err := <-clientErr; err != nil {
				t.Errorf("client: %v", err)
			}
			if err := <-endpointErr; err != nil {
				t.Errorf("endpoint: %v", err)
			}
			forwardtest.Eventually(t, "B to close the connection", func() bool { return mb.Snapshot().Closed == 1 })
		})
	}
}

// startPPEcho starts an endpoint that reads a PROXY protocol v1 header line, then echoes; it
// counts connections and headers.
func startPPEcho(t *testing.T) (netip.AddrPort, *atomic.Int32, *atomic.Int32) {
	var conns, headers atomic.Int32
	ep := forwardtest.StartTCPServer(t, forwardtest.Loopback("4"), func(c *net.TCPConn) {
		conns.Add(1)
		r := bufio.NewReader(c)
		line, err := r.ReadString('\n')
		if err != nil {
			return
		}
		if strings.HasPrefix(line, "PROXY TCP4 ") {
			headers.Add(1)
		}
		io.Copy(c, r)
		c.CloseWrite()
	})
	return ep, &conns, &headers
}

// TestTCPHandOverWhileDialling freezes a proxy while a connection is still dialling its
// endpoint (which needs a PROXY protocol header): either Freeze waits for the dial, which fails
// over to a good endpoint, or Freeze's context ends and the connection is handed over undialled
// and dialled by the adopter. Either way the client is served, not reset, and the endpoint sees
// one connection with exactly one header.
func TestTCPHandOverWhileDialling(t *testing.T) {
	for _, tc := range []struct {
		name        string
		giveUp      bool // Freeze's context ends at once
		wantDialled bool
	}{
		{name: "freeze waits for the dial", wantDialled: true},
		{name: "freeze gives up the dial", giveUp: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			forwardtest.CheckNoFDLeaks(t)
			checkNoLeaks(t)
			good, conns, headers := startPPEcho(t)
			hole := blackholeEndpoint(t)
			chooserA := &forwardtest.Chooser{Endpoints: []netip.AddrPort{hole, good}, ProxyProtocol: proxyproto.V1}
			timeouts := []time.Duration{250 * time.Millisecond, forwardtest.WaitTimeout}
			if tc.giveUp {
				chooserA.Endpoints = []netip.AddrPort{hole}
				timeouts = []time.Duration{forwardtest.WaitTimeout}
			}
			ma := &forwardtest.Metrics{}
			a := startTCPProxy(t, "4", chooserA, func(p *Proxy) { p.DialTimeouts, p.Metrics = timeouts, ma })
			c := forwardtest.DialTCP(t, a.addr)
			if _, err := c.Write([]byte("ping")); err != nil {
				t.Fatal(err)
			}
			forwardtest.Eventually(t, "the proxy to dial", func() bool { return len(chooserA.Recorded()) > 0 })
			ctx, cancel := context.WithCancel(context.Background())
			if tc.giveUp {
				cancel()
			}
			defer cancel()
			st, err := a.Freeze(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if len(st.Conns) != 1 || (st.Conns[0].Backend != nil) != tc.wantDialled {
				t.Fatalf("frozen state %+v, want one connection, dialled: %v", st, tc.wantDialled)
			}
			st = passTCPState(t, st)
			ln, err := ListenerFromFile(st.Listener)
			if err != nil {
				t.Fatal(err)
			}
			chooserB := &forwardtest.Chooser{Endpoints: []netip.AddrPort{good}, ProxyProtocol: proxyproto.V1}
			serveAdopted(t, ln, chooserB, nil, st.Conns)
			a.Release()
			got := make([]byte, 4)
			if _, err := io.ReadFull(c, got); err != nil || string(got) != "ping" {
				t.Fatalf("client read %q, %v; want the echo of ping", got, err)
			}
			if got, err := forwardtest.RoundTrip(c, []byte("more")); err != nil || string(got) != "more" {
				t.Fatalf("client round trip after the hand-over: %q, %v", got, err)
			}
			if n, h := conns.Load(), headers.Load(); n != 1 || h != 1 {
				t.Errorf("endpoint saw %d connections and %d headers, want 1 and 1", n, h)
			}
			if s := ma.Snapshot(); s.Failed != 0 || s.Closed != 0 {
				t.Errorf("A's metrics %+v: the connection must be neither failed nor closed", s)
			}
		})
	}
}

// TestTCPHandOverBacklog: connections that arrive while the proxy is frozen wait in the
// listening socket's backlog and are served by the adopter; an established connection goes on.
func TestTCPHandOverBacklog(t *testing.T) {
	forwardtest.CheckNoFDLeaks(t)
	checkNoLeaks(t)
	backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}
	a := startTCPProxy(t, "4", chooser, nil)
	c1 := forwardtest.DialTCP(t, a.addr)
	if got, err := forwardtest.RoundTrip(c1, []byte("before")); err != nil || string(got) != "before" {
		t.Fatalf("before the freeze: %q, %v", got, err)
	}
	st, err := a.Freeze(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	c2 := forwardtest.DialTCP(t, a.addr) // queued in the backlog: nobody accepts
	if _, err := c2.Write([]byte("queued")); err != nil {
		t.Fatal(err)
	}
	st = passTCPState(t, st)
	ln, err := ListenerFromFile(st.Listener)
	if err != nil {
		t.Fatal(err)
	}
	serveAdopted(t, ln, chooser, nil, st.Conns)
	a.Release()
	got := make([]byte, 6)
	if _, err := io.ReadFull(c2, got); err != nil || string(got) != "queued" {
		t.Errorf("connection queued during the freeze: %q, %v", got, err)
	}
	if got, err := forwardtest.RoundTrip(c1, []byte("after")); err != nil || string(got) != "after" {
		t.Errorf("established connection after the hand-over: %q, %v", got, err)
	}
}

// TestTCPFreezeMisuse: Freeze, Adopt, Release and Serve called out of turn fail clearly, close
// what they were given, and panic nowhere.
func TestTCPFreezeMisuse(t *testing.T) {
	forwardtest.CheckNoFDLeaks(t)
	checkNoLeaks(t)
	ctx := context.Background()
	chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))}}

	closed := &Proxy{Listener: forwardtest.ListenTCP(t, forwardtest.Loopback("4")), Chooser: chooser, Loops: newTestLoops(t, 1)}
	closed.Close()
	if _, err := closed.Freeze(ctx); !errors.Is(err, forward.ErrClosed) {
		t.Errorf("Freeze after Close: %v, want ErrClosed", err)
	}
	f := forwardtest.SocketFile(t)
	if err := closed.Adopt([]forward.TCPConnState{{Client: f}}); !errors.Is(err, forward.ErrClosed) {
		t.Errorf("Adopt after Close: %v, want ErrClosed", err)
	}
	if err := f.Close(); !errors.Is(err, os.ErrClosed) {
		t.Errorf("Adopt after Close left its file open (closing it: %v)", err)
	}
	closed.Release() // not frozen: nothing

	r := startTCPProxy(t, "4", chooser, nil)
	r.Release() // not frozen: nothing
	c := forwardtest.DialTCP(t, r.addr)
	if got, err := forwardtest.RoundTrip(c, []byte("x")); err != nil || string(got) != "x" {
		t.Fatalf("after Release of a proxy not frozen: %q, %v", got, err)
	}
	st, err := r.Freeze(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := r.Freeze(ctx); !errors.Is(err, forward.ErrFrozen) {
		t.Errorf("second Freeze: %v, want ErrFrozen", err)
	}
	if err := r.Adopt([]forward.TCPConnState{{Client: forwardtest.SocketFile(t)}}); !errors.Is(err, forward.ErrFrozen) {
		t.Errorf("Adopt on a frozen proxy: %v, want ErrFrozen", err)
	}
	if err := r.Close(); err != nil { // releases
		t.Errorf("Close of a frozen proxy: %v", err)
	}
	r.Release()
	if _, err := r.Freeze(ctx); !errors.Is(err, forward.ErrClosed) {
		t.Errorf("Freeze after Release: %v, want ErrClosed", err)
	}

	idle := &Proxy{Listener: forwardtest.ListenTCP(t, forwardtest.Loopback("4")), Chooser: chooser, Loops: newTestLoops(t, 1)}
	st2, err := idle.Freeze(ctx)
	if err != nil {
		t.Fatalf("Freeze before Serve: %v", err)
	}
	st2.Close()
	if err := idle.Serve(); !errors.Is(err, forward.ErrFrozen) {
		t.Errorf("Serve after Freeze: %v, want ErrFrozen", err)
	}
	idle.Release()

	if _, err := ListenerFromFile(nil); err == nil {
		t.Error("ListenerFromFile(nil) succeeded")
	}
	if _, err := ListenerFromFile(forwardtest.SocketFile(t)); err == nil {
		t.Error("ListenerFromFile of a socket that does not listen succeeded")
	}
	p := &Proxy{Chooser: chooser, Loops: newTestLoops(t, 1)}
	if err := p.Adopt([]forward.TCPConnState{{}, {Client: forwardtest.SocketFile(t)}}); err == nil {
		t.Error("Adopt of a state without a client socket, and of one that is not connected, succeeded")
	}
}

// TestTCPHandOverEndpointGone hands over a connection frozen after both FINs crossed on the
// endpoint's side (the client half-closed, the proxy passed the EOF on, the endpoint answered
// and closed) but before the proxy copied the answer: the endpoint socket is then no longer
// connected (the kernel moved the connection to TIME_WAIT) yet still holds the answer and the
// EOF. The adopter must deliver both to the client, not drop the connection.
func TestTCPHandOverEndpointGone(t *testing.T) {
	forwardtest.CheckNoFDLeaks(t)
	checkNoLeaks(t)
	backend := forwardtest.StartTCPServer(t, forwardtest.Loopback("4"), func(c *net.TCPConn) {
		if got, err := io.ReadAll(c); err != nil || string(got) != "request" {
			t.Errorf("endpoint read %q, %v", got, err)
		}
		_, _ = c.Write([]byte("reply"))
		c.Close()
	})
	// The proxy's two sockets, as a frozen proxy would hand them over.
	front := forwardtest.ListenTCP(t, forwardtest.Loopback("4"))
	client := forwardtest.DialTCP(t, forwardtest.ListenerAddr(front))
	clientSide, err := front.AcceptTCP()
	front.Close()
	if err != nil {
		t.Fatal(err)
	}
	endpoint := forwardtest.DialTCP(t, backend)
	if _, err := client.Write([]byte("request")); err != nil {
		t.Fatal(err)
	}
	client.CloseWrite()
	if got, err := io.ReadAll(clientSide); err != nil || string(got) != "request" {
		t.Fatalf("proxy side read %q, %v", got, err)
	}
	if _, err := endpoint.Write([]byte("request")); err != nil {
		t.Fatal(err)
	}
	endpoint.CloseWrite()
	rc, err := endpoint.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	forwardtest.Eventually(t, "the endpoint socket to be disconnected", func() bool {
		var perr error
		_ = rc.Control(func(fd uintptr) { _, perr = unix.Getpeername(int(fd)) })
		return errors.Is(perr, unix.ENOTCONN)
	})
	cf, err := clientSide.File()
	if err != nil {
		t.Fatal(err)
	}
	ef, err := endpoint.File()
	if err != nil {
		t.Fatal(err)
	}
	clientSide.Close()
	endpoint.Close()
	mb := &forwardtest.Metrics{}
	serveAdopted(t, forwardtest.ListenTCP(t, forwardtest.Loopback("4")), &forwardtest.Chooser{}, func(p *Proxy) { p.Metrics = mb }, []forward.TCPConnState{{
		Client: cf, Backend: ef, ClientAddr: forwardtest.TCPAddrPort(client.LocalAddr()), Endpoint: backend, ToEndpointDone: true,
	}})
	client.SetReadDeadline(time.Now().Add(forwardtest.WaitTimeout))
	if got, err := io.ReadAll(client); err != nil || string(got) != "reply" {
		t.Errorf("client read %q, %v; want reply, then EOF", got, err)
	}
	forwardtest.Eventually(t, "the adopter to close the connection", func() bool { return mb.Snapshot().Closed == 1 })
}
