//go:build linux

package forward

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"reflect"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestUDPEcho(t *testing.T) {
	for _, tc := range []struct {
		name   string
		family string
		size   int
	}{
		{"IPv4 empty datagram", "4", 0},
		{"IPv4 100 bytes", "4", 100},
		{"IPv4 65,000 bytes", "4", 65000},
		{"IPv4 largest datagram", "4", 65507},
		{"IPv6 1,400 bytes", "6", 1400},
		{"IPv6 65,000 bytes", "6", 65000},
		{"IPv6 largest datagram", "6", 65527},
	} {
		t.Run(tc.name, func(t *testing.T) {
			checkNoLeaks(t)
			backend := startUDPEcho(t, loopback(tc.family), "")
			chooser := &fakeChooser{endpoints: []netip.AddrPort{backend}}
			metrics := &fakeMetrics{}
			p := startUDPProxy(t, tc.family, chooser, func(p *UDPProxy) { p.Metrics = metrics })
			c := dialUDPTest(t, p.addr)
			msg := make([]byte, tc.size)
			rand.NewChaCha8([32]byte{9}).Read(msg)
			for i := range 3 {
				got, err := udpExchange(c, msg, 1, waitTimeout)
				if err != nil {
					t.Fatalf("exchange %d: %v", i, err)
				}
				if !bytes.Equal(got, msg) {
					t.Fatalf("exchange %d: reply of %d bytes differs from the %d sent", i, len(got), len(msg))
				}
			}
			calls := chooser.recorded()
			if len(calls) != 1 || calls[0].client != c.LocalAddr().(*net.UDPAddr).AddrPort() || calls[0].dst.IsValid() || calls[0].reset {
				t.Errorf("Choose calls %+v, want one from %s with unknown dst and no reset", calls, c.LocalAddr())
			}
			if err := p.Close(); err != nil {
				t.Fatal(err)
			}
			m := metrics.snapshot()
			if m.sessionsOpened != 1 || m.sessionsClosed != 1 || m.toEndpoint != 3*int64(tc.size) || m.fromEndpoint != 3*int64(tc.size) || m.dropped != 0 {
				t.Errorf("metrics %+v, want 1 session, %d bytes each way", m, 3*tc.size)
			}
		})
	}
}

func TestUDPIdleTimeoutEndsSession(t *testing.T) {
	checkNoLeaks(t)
	backend := startUDPEcho(t, loopback("4"), "")
	chooser := &fakeChooser{endpoints: []netip.AddrPort{backend}}
	metrics := &fakeMetrics{}
	p := startUDPProxy(t, "4", chooser, func(p *UDPProxy) {
		p.Timeout = 50 * time.Millisecond
		p.Metrics = metrics
	})
	c := dialUDPTest(t, p.addr)
	if _, err := udpExchange(c, []byte("one"), 1, waitTimeout); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the idle session to end", func() bool { return p.sessionCount() == 0 && metrics.snapshot().sessionsClosed == 1 })
	if _, err := udpExchange(c, []byte("two"), 1, waitTimeout); err != nil {
		t.Fatal(err)
	}
	if got := chooser.resets(); !reflect.DeepEqual(got, []bool{false, false}) {
		t.Errorf("Choose calls with reset=%v, want a new session without reset", got)
	}
	if m := metrics.snapshot(); m.sessionsOpened != 2 {
		t.Errorf("%d sessions opened, want 2", m.sessionsOpened)
	}
}

// TestUDPExpire checks the idle decision itself: activity in either direction (the stamp)
// keeps a session, and only the session in the map is removed from it.
func TestUDPExpire(t *testing.T) {
	for _, tc := range []struct {
		name      string
		idleFor   time.Duration
		wantEnded bool
	}{
		{"fresh activity keeps the session", 0, false},
		{"activity within the timeout keeps it", 30 * time.Second, false},
		{"idle for the timeout ends it", time.Minute, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := &UDPProxy{timeout: time.Minute, epoch: time.Now().Add(-time.Hour), sessions: map[netip.AddrPort]*udpSession{}}
			client := netip.MustParseAddrPort("192.0.2.1:5353")
			s := &udpSession{p: p, client: client}
			p.sessions[client] = s
			s.lastActive.Store(p.now() - int64(tc.idleFor))
			if got := s.expire(); got != tc.wantEnded {
				t.Errorf("expire() = %v, want %v", got, tc.wantEnded)
			}
			if _, present := p.sessions[client]; present == tc.wantEnded {
				t.Errorf("session in map: %v, want %v", present, !tc.wantEnded)
			}
		})
	}
}

func TestUDPDropSessions(t *testing.T) {
	checkNoLeaks(t)
	a, b := startUDPEcho(t, loopback("4"), "A:"), startUDPEcho(t, loopback("4"), "B:")
	chooser := &fakeChooser{endpoints: []netip.AddrPort{a}}
	metrics := &fakeMetrics{}
	p := startUDPProxy(t, "4", chooser, func(p *UDPProxy) { p.Metrics = metrics })
	c := dialUDPTest(t, p.addr)
	if got, err := udpExchange(c, []byte("x"), 1, waitTimeout); err != nil || string(got) != "A:x" {
		t.Fatalf("before: %q, %v; want A:x", got, err)
	}
	if n := p.DropSessions(func(ep netip.AddrPort) bool { return ep == a }); n != 0 {
		t.Errorf("DropSessions keeping A dropped %d sessions, want 0", n)
	}
	chooser.set(b) // A leaves the service
	if n := p.DropSessions(func(ep netip.AddrPort) bool { return ep == b }); n != 1 {
		t.Errorf("DropSessions dropped %d sessions, want 1", n)
	}
	if got, err := udpExchange(c, []byte("y"), 1, waitTimeout); err != nil || string(got) != "B:y" {
		t.Fatalf("after: %q, %v; want B:y", got, err)
	}
	eventually(t, "the dropped session to close", func() bool { return metrics.snapshot().sessionsClosed == 1 })
}

func TestUDPClientsAreIsolated(t *testing.T) {
	checkNoLeaks(t)
	a, b := startUDPEcho(t, loopback("4"), ""), startUDPEcho(t, loopback("4"), "")
	p := startUDPProxy(t, "4", &fakeChooser{endpoints: []netip.AddrPort{a, b}}, nil)
	const clients, perClient = 20, 50
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for i := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(p.addr))
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			for j := range perClient {
				msg := fmt.Appendf(nil, "client %d message %d", i, j)
				got, err := udpExchange(c, msg, 1, waitTimeout)
				if err != nil {
					errs <- fmt.Errorf("client %d: %w", i, err)
					return
				}
				if !bytes.Equal(got, msg) {
					errs <- fmt.Errorf("client %d got %q, want %q", i, got, msg)
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
	if n := p.sessionCount(); n != clients {
		t.Errorf("%d sessions, want one per client (%d)", n, clients)
	}
}

func TestUDPNoEndpointDropsDatagram(t *testing.T) {
	checkNoLeaks(t)
	metrics := &fakeMetrics{}
	chooser := &fakeChooser{err: errors.New("service has no endpoints")}
	p := startUDPProxy(t, "4", chooser, func(p *UDPProxy) { p.Metrics = metrics })
	c := dialUDPTest(t, p.addr)
	if _, err := c.Write([]byte("anyone?")); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the datagram to be dropped", func() bool { return metrics.snapshot().dropped == 1 })
	if n := p.sessionCount(); n != 0 {
		t.Errorf("%d sessions, want none", n)
	}
}

// TestUDPRefusedEndpoint: an endpoint whose port is closed answers with ICMP port unreachable;
// the client's next datagram asks Choose again with reset=true and reaches a live endpoint.
func TestUDPRefusedEndpoint(t *testing.T) {
	checkNoLeaks(t)
	conn, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	closed := conn.LocalAddr().(*net.UDPAddr).AddrPort()
	conn.Close()
	live := startUDPEcho(t, loopback("4"), "")
	chooser := &fakeChooser{endpoints: []netip.AddrPort{closed, live}}
	metrics := &fakeMetrics{}
	p := startUDPProxy(t, "4", chooser, func(p *UDPProxy) { p.Metrics = metrics })
	c := dialUDPTest(t, p.addr)
	got, err := udpExchange(c, []byte("hello"), 50, 200*time.Millisecond)
	if err != nil || string(got) != "hello" {
		t.Fatalf("exchange: %q, %v", got, err)
	}
	if got := chooser.resets(); !reflect.DeepEqual(got, []bool{false, true}) {
		t.Errorf("Choose calls with reset=%v, want [false true]", got)
	}
	if got := metrics.snapshot().dialFailed; !reflect.DeepEqual(got, []netip.AddrPort{closed}) {
		t.Errorf("DialFailed for %v, want [%s]", got, closed)
	}
}

func TestUDPCloseEndsSessions(t *testing.T) {
	checkNoLeaks(t)
	backend := startUDPEcho(t, loopback("4"), "")
	metrics := &fakeMetrics{}
	p := startUDPProxy(t, "4", &fakeChooser{endpoints: []netip.AddrPort{backend}}, func(p *UDPProxy) { p.Metrics = metrics })
	for range 3 {
		if _, err := udpExchange(dialUDPTest(t, p.addr), []byte("x"), 1, waitTimeout); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if m := metrics.snapshot(); m.sessionsOpened != 3 || m.sessionsClosed != 3 || p.sessionCount() != 0 {
		t.Errorf("after Close: %+v and %d sessions, want 3 opened and closed, none left", m, p.sessionCount())
	}
	if err := p.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// TestUDPConnReceiveBuffer checks that serving gives the service port's socket the large
// receive buffer (udpConnRcvBuf) that absorbs bursts while the read loop waits for a core.
func TestUDPConnReceiveBuffer(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs CAP_NET_ADMIN for SO_RCVBUFFORCE")
	}
	backend := startUDPEcho(t, loopback("4"), "")
	r := startUDPProxy(t, "4", &fakeChooser{endpoints: []netip.AddrPort{backend}}, nil)
	c := dialUDPTest(t, r.addr)
	if _, err := udpExchange(c, []byte("ping"), 1, waitTimeout); err != nil { // Serve has prepared
		t.Fatal(err)
	}
	rc, err := r.Conn.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var size int
	rc.Control(func(fd uintptr) { size, err = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_RCVBUF) })
	if err != nil || size < udpConnRcvBuf {
		t.Fatalf("SO_RCVBUF of the proxy's socket: %d (%v), want at least %d", size, err, udpConnRcvBuf)
	}
}

// sessionCount returns the number of live sessions (for tests).
func (p *UDPProxy) sessionCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.sessions)
}
