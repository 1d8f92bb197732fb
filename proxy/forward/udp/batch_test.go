//go:build linux

package udp

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/internal/testenv"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/sys"
	"golang.org/x/sys/unix"
)

// The batched path's tests hold a socket's reader (testHookRecv) while datagrams queue up, so
// that one receive finds several, then check the counts of udpBatchStats: a proxy that falls
// back to a datagram per call fails them.

// recvGate holds the first batched receive on one kind of socket (Conn's or a session's) until
// released, and records that socket's descriptor.
type recvGate struct {
	conn     bool // which kind of socket to hold
	once     sync.Once
	entered  chan int // the held socket's descriptor
	released chan struct{}
}

func newRecvGate(conn bool) *recvGate {
	return &recvGate{conn: conn, entered: make(chan int, 1), released: make(chan struct{})}
}

// hook is the proxy's testHookRecv.
func (g *recvGate) hook(fd int, conn bool) {
	if conn != g.conn {
		return
	}
	g.once.Do(func() {
		g.entered <- fd
		<-g.released
	})
}

// waitEntered returns the descriptor of the held socket.
func (g *recvGate) waitEntered(t *testing.T) int {
	t.Helper()
	select {
	case fd := <-g.entered:
		return fd
	case <-time.After(forwardtest.WaitTimeout):
		t.Fatal("the proxy never read")
		return -1
	}
}

// rmemAlloc returns the memory the datagrams queued on socket fd take (SK_MEMINFO_RMEM_ALLOC).
func rmemAlloc(t *testing.T, fd int) uint32 {
	var info [unix.SK_MEMINFO_VARS]uint32
	size := uint32(unsafe.Sizeof(info))
	_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, unix.SO_MEMINFO,
		uintptr(unsafe.Pointer(&info[0])), uintptr(unsafe.Pointer(&size)), 0)
	if errno != 0 {
		t.Fatalf("getsockopt SO_MEMINFO: %v", errno)
	}
	return info[unix.SK_MEMINFO_RMEM_ALLOC]
}

// waitQueued waits until socket fd holds at least payload bytes of datagrams. Loopback nearly
// always delivers a datagram within its send; this covers a delivery left to ksoftirqd, though
// not exactly (a datagram takes more memory than its payload).
func waitQueued(t *testing.T, fd int, payload int) {
	t.Helper()
	forwardtest.Eventually(t, "the datagrams to queue", func() bool { return int(rmemAlloc(t, fd)) >= payload })
}

// checkBatched waits until st counts n datagrams received and sent (the counts follow the
// calls), then fails unless some receive and some send moved more than one.
func checkBatched(t *testing.T, what string, st *udpBatchStats, n int64) {
	t.Helper()
	forwardtest.Eventually(t, what+" counted", func() bool { return st.recvMsgs.Load() >= n && st.sendMsgs.Load() >= n })
	rc, rm, sc, sm := st.recvCalls.Load(), st.recvMsgs.Load(), st.sendCalls.Load(), st.sendMsgs.Load()
	if rm <= rc || sm <= sc {
		t.Errorf("%s: %d datagrams received in %d calls, %d sent in %d: want batches of several", what, rm, rc, sm, sc)
	}
}

// listenUDPTest returns an unconnected UDP socket on addr, which sees the source of whatever
// reaches it.
func listenUDPTest(t *testing.T, addr netip.Addr) *net.UDPConn {
	t.Helper()
	c, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(addr, 0)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// readFrom reads one datagram from c and its source.
func readFrom(t *testing.T, c *net.UDPConn) ([]byte, netip.AddrPort) {
	t.Helper()
	buf := make([]byte, 1<<16)
	c.SetReadDeadline(time.Now().Add(forwardtest.WaitTimeout))
	n, from, err := c.ReadFromUDPAddrPort(buf)
	if err != nil {
		t.Fatalf("read from %s: %v", c.LocalAddr(), err)
	}
	return buf[:n], from
}

// TestUDPBatchMixedSources: datagrams of two clients, sent to two addresses of a wildcard
// service port, interleaved in one batch; each client gets its own echoes, in order, from the
// address it sent to.
func TestUDPBatchMixedSources(t *testing.T) {
	checkNoLeaks(t)
	backend := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "echo:")
	gate := newRecvGate(true)
	conn, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4zero})
	if err != nil {
		t.Fatal(err)
	}
	metrics := &forwardtest.Metrics{}
	p := &Proxy{Conn: conn, Chooser: &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, Log: new(forwardtest.Logger(t)),
		Metrics: metrics, testHookRecv: gate.hook}
	served := make(chan error, 1)
	go func() { served <- p.Serve() }()
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	port := conn.LocalAddr().(*net.UDPAddr).AddrPort().Port()
	fd := gate.waitEntered(t)

	type client struct {
		c    *net.UDPConn
		to   netip.AddrPort
		sent [][]byte
	}
	clients := []*client{
		{c: listenUDPTest(t, forwardtest.Loopback("4")), to: netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), port)},
		{c: listenUDPTest(t, forwardtest.Loopback("4")), to: netip.AddrPortFrom(netip.MustParseAddr("127.0.0.2"), port)},
	}
	payload := 0
	for i := range 7 { // A B A B A B A: one batch of 7
		cl := clients[i%2]
		msg := fmt.Appendf(nil, "%s message %d", cl.c.LocalAddr(), i)
		if _, err := cl.c.WriteToUDPAddrPort(msg, cl.to); err != nil {
			t.Fatal(err)
		}
		cl.sent = append(cl.sent, msg)
		payload += len(msg)
	}
	waitQueued(t, fd, payload)
	close(gate.released)

	for _, cl := range clients {
		for _, msg := range cl.sent {
			got, from := readFrom(t, cl.c)
			if want := append([]byte("echo:"), msg...); !bytes.Equal(got, want) || from != cl.to {
				t.Errorf("client %s got %q from %s, want %q from %s", cl.c.LocalAddr(), got, from, want, cl.to)
			}
		}
	}
	// Interleaved clients: one receive, a send per datagram.
	if rm, rc := p.connStats.recvMsgs.Load(), p.connStats.recvCalls.Load(); rm != 7 || rc >= 7 {
		t.Errorf("%d datagrams received in %d calls, want 7 in fewer calls", rm, rc)
	}
	if n := p.sessionCount(); n != 2 {
		t.Errorf("%d sessions, want 2", n)
	}
}

// TestUDPBatchLargeDatagrams: full-size datagrams and small ones from one client in one batch
// reach the endpoint whole, in order, in one send, and come back whole.
func TestUDPBatchLargeDatagrams(t *testing.T) {
	checkNoLeaks(t)
	backend := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "")
	gate := newRecvGate(true)
	metrics := &forwardtest.Metrics{}
	p := startUDPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.Metrics = metrics
		p.testHookRecv = gate.hook
	})
	fd := gate.waitEntered(t)
	c := listenUDPTest(t, forwardtest.Loopback("4"))
	rng := rand.NewChaCha8([32]byte{15})
	var sent [][]byte
	total := 0
	for _, size := range []int{65507, 1, 40000, 0, 1400} {
		msg := make([]byte, size)
		rng.Read(msg)
		if _, err := c.WriteToUDPAddrPort(msg, p.addr); err != nil {
			t.Fatal(err)
		}
		sent = append(sent, msg)
		total += size
	}
	waitQueued(t, fd, total)
	close(gate.released)
	for i, msg := range sent {
		got, from := readFrom(t, c)
		if !bytes.Equal(got, msg) || from != p.addr {
			t.Fatalf("reply %d: %d bytes from %s, want the %d sent, from %s", i, len(got), from, len(msg), p.addr)
		}
	}
	checkBatched(t, "to the endpoint", &p.connStats, int64(len(sent)))
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if m := metrics.Snapshot(); m.ToEndpoint != int64(total) || m.FromEndpoint != int64(total) || m.Dropped != 0 {
		t.Errorf("metrics %+v, want %d bytes each way, nothing dropped", m, total)
	}
}

// startUDPBurst starts a UDP server on addr that answers each datagram with count copies of
// it, then reports on the returned channel that it sent them.
func startUDPBurst(t *testing.T, addr netip.Addr, count int) (netip.AddrPort, <-chan struct{}) {
	t.Helper()
	conn := listenUDPTest(t, addr)
	answered := make(chan struct{}, 16)
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 1<<16)
		for {
			n, from, err := conn.ReadFromUDPAddrPort(buf)
			if err != nil {
				if errors.Is(err, net.ErrClosed) {
					return
				}
				continue
			}
			for range count {
				conn.WriteToUDPAddrPort(buf[:n], from)
			}
			answered <- struct{}{}
		}
	}()
	t.Cleanup(func() {
		conn.Close()
		<-done
	})
	return conn.LocalAddr().(*net.UDPAddr).AddrPort(), answered
}

// TestUDPBatchReplies: an endpoint's burst of replies is read in one batch from the session's
// socket and sent to the client in one send.
func TestUDPBatchReplies(t *testing.T) {
	checkNoLeaks(t)
	const burst = 6
	backend, answered := startUDPBurst(t, forwardtest.Loopback("4"), burst)
	gate := newRecvGate(false)
	metrics := &forwardtest.Metrics{}
	p := startUDPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.Metrics = metrics
		p.testHookRecv = gate.hook
	})
	c := listenUDPTest(t, forwardtest.Loopback("4"))
	msg := []byte("a burst, please")
	if _, err := c.WriteToUDPAddrPort(msg, p.addr); err != nil {
		t.Fatal(err)
	}
	fd := gate.waitEntered(t)
	select {
	case <-answered:
	case <-time.After(forwardtest.WaitTimeout):
		t.Fatal("the endpoint never answered")
	}
	waitQueued(t, fd, burst*len(msg))
	close(gate.released)
	for i := range burst {
		if got, from := readFrom(t, c); !bytes.Equal(got, msg) || from != p.addr {
			t.Fatalf("reply %d: %q from %s, want %q from %s", i, got, from, msg, p.addr)
		}
	}
	checkBatched(t, "replies", &p.replyStats, burst)
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if m := metrics.Snapshot(); m.FromEndpoint != burst*int64(len(msg)) {
		t.Errorf("%d bytes from the endpoint, want %d", m.FromEndpoint, burst*len(msg))
	}
}

// TestUDPBatchFloodEvicts: more new clients in one batch than MaxSessions allows; each new
// session evicts the idlest, the port never holds more than MaxSessions and the budget is whole
// again after Close.
func TestUDPBatchFloodEvicts(t *testing.T) {
	checkNoLeaks(t)
	const clients, maxSessions = 8, 2
	backend := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "")
	gate := newRecvGate(true)
	metrics := &forwardtest.Metrics{}
	budget := forward.NewBudget(100)
	p := startUDPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.Metrics = metrics
		p.MaxSessions = maxSessions
		p.Budget = budget
		p.testHookRecv = gate.hook
	})
	fd := gate.waitEntered(t)
	var cs []*net.UDPConn
	for i := range clients {
		c := listenUDPTest(t, forwardtest.Loopback("4"))
		if _, err := c.WriteToUDPAddrPort(fmt.Appendf(nil, "client %d", i), p.addr); err != nil {
			t.Fatal(err)
		}
		cs = append(cs, c)
	}
	waitQueued(t, fd, clients*len("client 0"))
	close(gate.released)
	forwardtest.Eventually(t, "every client's session", func() bool { return metrics.Snapshot().SessionsOpened == clients })
	if n := p.sessionCount(); n > maxSessions {
		t.Errorf("%d sessions, want at most %d", n, maxSessions)
	}
	if got := p.connStats.recvMsgs.Load(); got != clients || p.connStats.recvCalls.Load() >= clients {
		t.Errorf("%d datagrams received in %d calls, want %d in fewer calls", got, p.connStats.recvCalls.Load(), clients)
	}
	// The last client's session survives the flood.
	if got, _ := readFrom(t, cs[clients-1]); string(got) != fmt.Sprint("client ", clients-1) {
		t.Errorf("last client got %q", got)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	m := metrics.Snapshot()
	if m.Evicted != clients-maxSessions || m.SessionsClosed != clients || m.Dropped != 0 {
		t.Errorf("metrics %+v, want %d evicted, %d closed, none dropped", m, clients-maxSessions, clients)
	}
	if n := budget.InUse(); n != 0 {
		t.Errorf("budget: %d descriptors in use after Close, want 0", n)
	}
}

// TestRawSockaddr: the addresses replies are sent to round-trip through the kernel's encoding.
func TestRawSockaddr(t *testing.T) {
	for _, ap := range []netip.AddrPort{
		netip.MustParseAddrPort("192.0.2.1:53"),
		netip.MustParseAddrPort("[::ffff:192.0.2.1]:5353"),
		netip.MustParseAddrPort("[2001:db8::1]:65535"),
		netip.MustParseAddrPort("[fe80::1%7]:1"),
	} {
		b := &udpBatch{}
		raw := sys.EncodeSockaddr(ap)
		copy(unsafe.Slice((*byte)(unsafe.Pointer(&b.names[0])), unix.SizeofSockaddrInet6), raw)
		b.in[0].hdr.Namelen = uint32(len(raw))
		if got := b.source(0); got != ap {
			t.Errorf("%s: decoded as %s", ap, got)
		}
	}
	if raw := sys.EncodeSockaddr(netip.AddrPort{}); raw != nil {
		t.Errorf("invalid address encoded as %v, want nil", raw)
	}
}

// TestUDPBatchSegmented: a run of equal-size datagrams (the last one shorter) from one client
// leaves in one segmented send where the kernel has UDP_SEGMENT, and reaches the endpoint as
// the same datagrams, boundaries kept.
func TestUDPBatchSegmented(t *testing.T) {
	if !gsoSupported() {
		testenv.Need(t, "a kernel with UDP_SEGMENT (Linux 4.18 or later)")
	}
	checkNoLeaks(t)
	backend := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "")
	gate := newRecvGate(true)
	p := startUDPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) {
		p.testHookRecv = gate.hook
	})
	fd := gate.waitEntered(t)
	c := listenUDPTest(t, forwardtest.Loopback("4"))
	var sent [][]byte
	total := 0
	for i, size := range []int{1400, 1400, 1400, 1400, 1400, 1400, 700} {
		msg := bytes.Repeat([]byte{byte('a' + i)}, size)
		if _, err := c.WriteToUDPAddrPort(msg, p.addr); err != nil {
			t.Fatal(err)
		}
		sent = append(sent, msg)
		total += size
	}
	waitQueued(t, fd, total)
	close(gate.released)
	for i, msg := range sent {
		if got, _ := readFrom(t, c); !bytes.Equal(got, msg) {
			t.Fatalf("reply %d: %d bytes of %q, want %d of %q", i, len(got), got[:min(len(got), 1)], len(msg), msg[:1])
		}
	}
	if gsoDisabled.Load() {
		t.Fatal("segmented sends were disabled: the kernel or loopback refused one")
	}
	// The counters move just after the send returns, which the echoes can outrun.
	forwardtest.Eventually(t, "the sends counted", func() bool { return p.connStats.sendMsgs.Load() >= int64(len(sent)) })
	if n := p.connStats.segmented.Load(); n == 0 {
		t.Errorf("no segmented send (%d datagrams in %d sends)", p.connStats.sendMsgs.Load(), p.connStats.sendCalls.Load())
	}
}
