package forward

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/sys"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/proxyproto"
	"github.com/rs/zerolog"
)

// waitTimeout bounds every wait of the tests for something that must happen. It is a guard
// against hangs, not a measurement: reaching it fails the test.
const waitTimeout = 20 * time.Second

// eventually polls cond until it holds, failing the test after waitTimeout.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// checkNoLeaks fails the test if, once its cleanups have run, goroutines of this package's
// proxies remain. Call it first in a test, so its cleanup runs last.
func checkNoLeaks(t *testing.T) {
	t.Cleanup(func() {
		var leaked string
		deadline := time.Now().Add(waitTimeout)
		for {
			leaked = proxyGoroutines()
			if leaked == "" {
				return
			}
			if time.Now().After(deadline) {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		t.Errorf("goroutines left behind:\n%s", leaked)
	})
}

// proxyGoroutines returns the stacks of goroutines running the package's non-test code.
func proxyGoroutines() string {
	buf := allStacks()
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		for _, marker := range []string{"forward.(*Poller)", "forward.(*TCPProxy)", "forward.(*loop)", "forward.(*UDPProxy)", "forward.(*udpSession)", "forward.(*tcpRelay)", "forward.(*udpRelay)"} {
			if strings.Contains(g, marker) {
				out = append(out, g)
				break
			}
		}
	}
	return strings.Join(out, "\n\n")
}

// testLogger logs to the test's output.
func testLogger(t testing.TB) zerolog.Logger {
	return zerolog.New(zerolog.ConsoleWriter{Out: testWriter{t}, NoColor: true}).Level(zerolog.DebugLevel).With().Timestamp().Logger()
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// chooseCall is one recorded Chooser.Choose call.
type chooseCall struct {
	client, dst netip.AddrPort
	reset       bool
}

// fakeChooser returns its endpoints in turn (round robin), or err, and records every call.
type fakeChooser struct {
	mu        sync.Mutex
	endpoints []netip.AddrPort
	err       error
	next      int
	calls     []chooseCall
	// Returned in every Target.
	transparent   bool
	proxyProtocol proxyproto.Version
}

var _ Chooser = (*fakeChooser)(nil)

func (c *fakeChooser) Choose(client, dst netip.AddrPort, reset bool) (Target, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.calls = append(c.calls, chooseCall{client: client, dst: dst, reset: reset})
	if c.err != nil {
		return Target{}, c.err
	}
	if len(c.endpoints) == 0 {
		return Target{}, errors.New("no endpoints")
	}
	ep := c.endpoints[c.next%len(c.endpoints)]
	c.next++
	return Target{Endpoint: ep, Transparent: c.transparent, ProxyProtocol: c.proxyProtocol}, nil
}

func (c *fakeChooser) set(endpoints ...netip.AddrPort) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.endpoints, c.next = endpoints, 0
}

func (c *fakeChooser) recorded() []chooseCall {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]chooseCall(nil), c.calls...)
}

func (c *fakeChooser) resets() []bool {
	var out []bool
	for _, call := range c.recorded() {
		out = append(out, call.reset)
	}
	return out
}

// metricsSnapshot holds the counts of a fakeMetrics.
type metricsSnapshot struct {
	accepted, closed, failed                int
	dialFailed                              []netip.AddrPort
	toEndpoint, fromEndpoint                int64
	sessionsOpened, sessionsClosed, dropped int
	refused, evicted                        int
}

// fakeMetrics counts the events it receives.
type fakeMetrics struct {
	mu sync.Mutex
	s  metricsSnapshot
}

var _ Metrics = (*fakeMetrics)(nil)

func (m *fakeMetrics) update(f func(*metricsSnapshot)) {
	m.mu.Lock()
	defer m.mu.Unlock()
	f(&m.s)
}

func (m *fakeMetrics) ConnAccepted()     { m.update(func(s *metricsSnapshot) { s.accepted++ }) }
func (m *fakeMetrics) ConnClosed()       { m.update(func(s *metricsSnapshot) { s.closed++ }) }
func (m *fakeMetrics) ConnFailed()       { m.update(func(s *metricsSnapshot) { s.failed++ }) }
func (m *fakeMetrics) UDPSessionOpened() { m.update(func(s *metricsSnapshot) { s.sessionsOpened++ }) }
func (m *fakeMetrics) UDPSessionClosed() { m.update(func(s *metricsSnapshot) { s.sessionsClosed++ }) }
func (m *fakeMetrics) DatagramDropped()  { m.update(func(s *metricsSnapshot) { s.dropped++ }) }
func (m *fakeMetrics) ConnRefused()      { m.update(func(s *metricsSnapshot) { s.refused++ }) }
func (m *fakeMetrics) UDPSessionEvicted() {
	m.update(func(s *metricsSnapshot) { s.evicted++ })
}
func (m *fakeMetrics) DialFailed(ep netip.AddrPort) {
	m.update(func(s *metricsSnapshot) { s.dialFailed = append(s.dialFailed, ep) })
}
func (m *fakeMetrics) BytesCopied(to, from int64) {
	m.update(func(s *metricsSnapshot) { s.toEndpoint += to; s.fromEndpoint += from })
}

// snapshot returns a copy of the counts.
func (m *fakeMetrics) snapshot() metricsSnapshot {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.s
	s.dialFailed = append([]netip.AddrPort(nil), m.s.dialFailed...)
	return s
}

// loopback returns the loopback address of the family ("4" or "6").
func loopback(family string) netip.Addr {
	if family == "6" {
		return netip.IPv6Loopback()
	}
	return netip.MustParseAddr("127.0.0.1")
}

// listenTCP listens on an ephemeral port of addr.
func listenTCP(t testing.TB, addr netip.Addr) *net.TCPListener {
	t.Helper()
	ln, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(netip.AddrPortFrom(addr, 0)))
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	return ln
}

func listenerAddr(ln *net.TCPListener) netip.AddrPort {
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

// tcpServer runs handle on every connection accepted on a loopback listener until the test
// ends.
type tcpServer struct {
	ln    *net.TCPListener
	wg    sync.WaitGroup
	mu    sync.Mutex
	conns map[*net.TCPConn]struct{}
}

func startTCPServer(t testing.TB, addr netip.Addr, handle func(*net.TCPConn)) netip.AddrPort {
	t.Helper()
	s := &tcpServer{ln: listenTCP(t, addr), conns: map[*net.TCPConn]struct{}{}}
	s.wg.Add(1)
	go s.acceptTestConns(handle)
	t.Cleanup(func() {
		s.ln.Close()
		s.mu.Lock()
		for c := range s.conns {
			c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
	return listenerAddr(s.ln)
}

func (s *tcpServer) acceptTestConns(handle func(*net.TCPConn)) {
	defer s.wg.Done()
	for {
		c, err := s.ln.AcceptTCP()
		if err != nil {
			return
		}
		s.mu.Lock()
		s.conns[c] = struct{}{}
		s.mu.Unlock()
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			handle(c)
			c.Close()
			s.mu.Lock()
			delete(s.conns, c)
			s.mu.Unlock()
		}()
	}
}

// echoTCP echoes until EOF, then half-closes.
func echoTCP(c *net.TCPConn) {
	if _, err := io.Copy(c, c); err == nil {
		c.CloseWrite()
	}
}

func startTCPEcho(t testing.TB, addr netip.Addr) netip.AddrPort {
	return startTCPServer(t, addr, echoTCP)
}

// loopForTest puts p on two event loops of its own (TCPProxy.Loops) unless the test gave it
// some: a listener is on two loops, each accepting for itself, as the proxier places it. Call
// it before the proxy serves, and before registering the cleanup that shuts it down (the loops
// are closed after).
func loopForTest(t testing.TB, p *TCPProxy) {
	t.Helper()
	if p.Loops == nil {
		p.Loops = newTestLoops(t, 2)
	}
}

// newTestLoops starts n event loops, closed when the test ends (after the cleanups registered
// later, such as a proxy's shutdown).
func newTestLoops(t testing.TB, n int) *Loops {
	t.Helper()
	ls, err := NewLoops(n)
	if err != nil {
		t.Fatalf("event loops: %v", err)
	}
	t.Cleanup(func() { ls.Close() })
	return ls
}

// proxyRun is a TCPProxy serving in the background of a test.
type proxyRun struct {
	*TCPProxy
	addr   netip.AddrPort
	served chan error
}

// startTCPProxy serves a TCPProxy on a loopback listener; configure adjusts its fields. The
// test's cleanup shuts it down, cutting what is left, and checks that Serve returned nil.
func startTCPProxy(t testing.TB, family string, chooser Chooser, configure func(*TCPProxy)) *proxyRun {
	t.Helper()
	ln, err := ListenTCP("tcp", net.TCPAddrFromAddrPort(netip.AddrPortFrom(loopback(family), 0)))
	if err != nil {
		t.Fatalf("listen: %v", err)
	}
	p := &TCPProxy{Listener: ln, Chooser: chooser, Log: new(testLogger(t))}
	if configure != nil {
		configure(p)
	}
	loopForTest(t, p)
	r := &proxyRun{TCPProxy: p, addr: listenerAddr(p.Listener), served: make(chan error, 1)}
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

func dialTCPTest(t testing.TB, ap netip.AddrPort) *net.TCPConn {
	t.Helper()
	c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(ap))
	if err != nil {
		t.Fatalf("dial %s: %v", ap, err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(waitTimeout))
	return c
}

// roundTrip writes msg and reads as many bytes back.
func roundTrip(c net.Conn, msg []byte) ([]byte, error) {
	if _, err := c.Write(msg); err != nil {
		return nil, err
	}
	got := make([]byte, len(msg))
	_, err := io.ReadFull(c, got)
	return got, err
}

// udpEcho answers every datagram with prefix followed by the datagram, until the test ends.
func startUDPEcho(t testing.TB, addr netip.Addr, prefix string) netip.AddrPort {
	t.Helper()
	conn, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(addr, 0)))
	if err != nil {
		t.Fatalf("listen UDP: %v", err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 1<<16)
		for {
			n, from, err := conn.ReadFromUDPAddrPort(buf[len(prefix):])
			if err != nil {
				if errors.Is(err, net.ErrClosed) {
					return
				}
				continue
			}
			copy(buf, prefix)
			conn.WriteToUDPAddrPort(buf[:len(prefix)+n], from)
		}
	}()
	t.Cleanup(func() {
		conn.Close()
		<-done
	})
	return conn.LocalAddr().(*net.UDPAddr).AddrPort()
}

// udpRun is a UDPProxy serving in the background of a test.
type udpRun struct {
	*UDPProxy
	addr   netip.AddrPort
	served chan error
}

func startUDPProxy(t testing.TB, family string, chooser Chooser, configure func(*UDPProxy)) *udpRun {
	t.Helper()
	conn, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(loopback(family), 0)))
	if err != nil {
		t.Fatalf("listen UDP: %v", err)
	}
	p := &UDPProxy{Conn: conn, Chooser: chooser, Log: new(testLogger(t))}
	if configure != nil {
		configure(p)
	}
	r := &udpRun{UDPProxy: p, addr: conn.LocalAddr().(*net.UDPAddr).AddrPort(), served: make(chan error, 1)}
	go func() { r.served <- p.Serve() }()
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if err := <-r.served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return r
}

// dialUDPTest returns a UDP socket connected to ap.
func dialUDPTest(t testing.TB, ap netip.AddrPort) *net.UDPConn {
	t.Helper()
	c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(ap))
	if err != nil {
		t.Fatalf("dial UDP %s: %v", ap, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// udpExchange sends msg and returns the first reply, retrying a few times as a UDP client
// does (the first datagrams of a flow may be lost to a refused endpoint).
func udpExchange(c *net.UDPConn, msg []byte, tries int, perTry time.Duration) ([]byte, error) {
	buf := make([]byte, 1<<16)
	var err error
	for range tries {
		if _, err = c.Write(msg); err != nil {
			return nil, err
		}
		c.SetReadDeadline(time.Now().Add(perTry))
		var n int
		n, err = c.Read(buf)
		if err == nil {
			return buf[:n], nil
		}
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, err
		}
	}
	return nil, err
}

// TestLeakCheckSeesProxies makes sure checkNoLeaks can fail: a serving proxy's goroutines are
// found, and none once it is closed.
func TestLeakCheckSeesProxies(t *testing.T) {
	loops, err := NewLoops(1)
	if err != nil {
		t.Fatal(err)
	}
	p := &TCPProxy{Listener: listenTCP(t, loopback("4")), Chooser: &fakeChooser{}, Loops: loops}
	served := make(chan error, 1)
	go func() { served <- p.Serve() }()
	eventually(t, "Serve and the loop to show in goroutine stacks", func() bool {
		g := proxyGoroutines()
		return strings.Contains(g, "forward.(*TCPProxy)") && strings.Contains(g, "forward.(*loop)")
	})
	p.Close()
	<-served
	loops.Close()
	if g := proxyGoroutines(); g != "" {
		t.Errorf("goroutines after Close:\n%s", g)
	}
}

// testChild is a copy of the test binary (or a command wrapping it, such as strace) running one
// of the child modes, with pipes to its standard input and output and its standard error kept.
type testChild struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stdout io.ReadCloser
	stderr bytes.Buffer // read it only after wait, or for a message after a failure
	waited bool
}

// startChild starts cmd; the test's cleanup kills it unless wait was called.
func startChild(t testing.TB, cmd *exec.Cmd) *testChild {
	t.Helper()
	c := &testChild{cmd: cmd}
	var err error
	if c.stdin, err = cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if c.stdout, err = cmd.StdoutPipe(); err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = &c.stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if !c.waited {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	})
	return c
}

// wait closes the child's standard input (its signal to finish) and waits for it to exit.
func (c *testChild) wait() error {
	c.stdin.Close()
	c.waited = true
	return c.cmd.Wait()
}

// allStacks returns the stacks of every goroutine (runtime.Stack, all of them, whole).
func allStacks() []byte {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return buf[:n]
		}
		buf = make([]byte, 2*len(buf))
	}
}

// resetConn closes conn with an RST instead of a FIN (SO_LINGER with a zero timeout), dropping
// unsent data.
func resetConn(conn *net.TCPConn) {
	_ = conn.SetLinger(0)
	_ = conn.Close()
}

// tcpAddrPort returns the address of a TCP socket end, or the zero AddrPort.
func tcpAddrPort(a net.Addr) netip.AddrPort {
	if ta, ok := a.(*net.TCPAddr); ok {
		return sys.UnmapAddrPort(ta.AddrPort())
	}
	return netip.AddrPort{}
}
