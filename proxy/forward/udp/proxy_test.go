//go:build linux

package udp

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/internal/testenv"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
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
			backend := forwardtest.StartUDPEcho(t, forwardtest.Loopback(tc.family), "")
			chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}
			metrics := &forwardtest.Metrics{}
			p := startUDPProxy(t, tc.family, chooser, func(p *Proxy) { p.Metrics = metrics })
			c := forwardtest.DialUDP(t, p.addr)
			msg := make([]byte, tc.size)
			rand.NewChaCha8([32]byte{9}).Read(msg)
			for i := range 3 {
				got, err := forwardtest.UDPExchange(c, msg, 1, forwardtest.WaitTimeout)
				if err != nil {
					t.Fatalf("exchange %d: %v", i, err)
				}
				if !bytes.Equal(got, msg) {
					t.Fatalf("exchange %d: reply of %d bytes differs from the %d sent", i, len(got), len(msg))
				}
			}
			calls := chooser.Recorded()
			if len(calls) != 1 || calls[0].Client != c.LocalAddr().(*net.UDPAddr).AddrPort() || calls[0].Dst.IsValid() || calls[0].Reset {
				t.Errorf("Choose calls %+v, want one from %s with unknown dst and no reset", calls, c.LocalAddr())
			}
			if err := p.Close(); err != nil {
				t.Fatal(err)
			}
			m := metrics.Snapshot()
			if m.SessionsOpened != 1 || m.SessionsClosed != 1 || m.ToEndpoint != 3*int64(tc.size) || m.FromEndpoint != 3*int64(tc.size) || m.Dropped != 0 {
				t.Errorf("metrics %+v, want 1 session, %d bytes each way", m, 3*tc.size)
			}
		})
	}
}

func TestUDPIdleTimeoutEndsSession(t *testing.T) {
	checkNoLeaks(t)
	backend := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "")
	chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}
	metrics := &forwardtest.Metrics{}
	p := startUDPProxy(t, "4", chooser, func(p *Proxy) {
		p.Timeout = 50 * time.Millisecond
		p.Metrics = metrics
	})
	c := forwardtest.DialUDP(t, p.addr)
	if _, err := forwardtest.UDPExchange(c, []byte("one"), 1, forwardtest.WaitTimeout); err != nil {
		t.Fatal(err)
	}
	forwardtest.Eventually(t, "the idle session to end", func() bool { return p.sessionCount() == 0 && metrics.Snapshot().SessionsClosed == 1 })
	if _, err := forwardtest.UDPExchange(c, []byte("two"), 1, forwardtest.WaitTimeout); err != nil {
		t.Fatal(err)
	}
	if got := chooser.Resets(); !reflect.DeepEqual(got, []bool{false, false}) {
		t.Errorf("Choose calls with reset=%v, want a new session without reset", got)
	}
	if m := metrics.Snapshot(); m.SessionsOpened != 2 {
		t.Errorf("%d sessions opened, want 2", m.SessionsOpened)
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
			p := &Proxy{timeout: time.Minute, epoch: time.Now().Add(-time.Hour), sessions: map[netip.AddrPort]*udpSession{}}
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
	a, b := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "A:"), forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "B:")
	chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{a}}
	metrics := &forwardtest.Metrics{}
	p := startUDPProxy(t, "4", chooser, func(p *Proxy) { p.Metrics = metrics })
	c := forwardtest.DialUDP(t, p.addr)
	if got, err := forwardtest.UDPExchange(c, []byte("x"), 1, forwardtest.WaitTimeout); err != nil || string(got) != "A:x" {
		t.Fatalf("before: %q, %v; want A:x", got, err)
	}
	if n := p.DropSessions(func(ep netip.AddrPort) bool { return ep == a }); n != 0 {
		t.Errorf("DropSessions keeping A dropped %d sessions, want 0", n)
	}
	chooser.Set(b) // A leaves the service
	if n := p.DropSessions(func(ep netip.AddrPort) bool { return ep == b }); n != 1 {
		t.Errorf("DropSessions dropped %d sessions, want 1", n)
	}
	if got, err := forwardtest.UDPExchange(c, []byte("y"), 1, forwardtest.WaitTimeout); err != nil || string(got) != "B:y" {
		t.Fatalf("after: %q, %v; want B:y", got, err)
	}
	forwardtest.Eventually(t, "the dropped session to close", func() bool { return metrics.Snapshot().SessionsClosed == 1 })
}

func TestUDPClientsAreIsolated(t *testing.T) {
	checkNoLeaks(t)
	a, b := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), ""), forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "")
	p := startUDPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{a, b}}, nil)
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
				got, err := forwardtest.UDPExchange(c, msg, 1, forwardtest.WaitTimeout)
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
	metrics := &forwardtest.Metrics{}
	chooser := &forwardtest.Chooser{Err: errors.New("service has no endpoints")}
	p := startUDPProxy(t, "4", chooser, func(p *Proxy) { p.Metrics = metrics })
	c := forwardtest.DialUDP(t, p.addr)
	if _, err := c.Write([]byte("anyone?")); err != nil {
		t.Fatal(err)
	}
	forwardtest.Eventually(t, "the datagram to be dropped", func() bool { return metrics.Snapshot().Dropped == 1 })
	if n := p.sessionCount(); n != 0 {
		t.Errorf("%d sessions, want none", n)
	}
}

// TestUDPRefusedEndpoint: an endpoint whose port is closed answers with ICMP port unreachable;
// the client's next datagram asks Choose again with reset=true and reaches a live endpoint, and
// the endpoint is reported to the Chooser as unreachable, as a refused TCP dial is.
func TestUDPRefusedEndpoint(t *testing.T) {
	checkNoLeaks(t)
	conn, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	closed := conn.LocalAddr().(*net.UDPAddr).AddrPort()
	conn.Close()
	live := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "")
	chooser := &forwardtest.Chooser{Endpoints: []netip.AddrPort{closed, live}}
	metrics := &forwardtest.Metrics{}
	p := startUDPProxy(t, "4", chooser, func(p *Proxy) { p.Metrics = metrics })
	c := forwardtest.DialUDP(t, p.addr)
	got, err := forwardtest.UDPExchange(c, []byte("hello"), 50, 200*time.Millisecond)
	if err != nil || string(got) != "hello" {
		t.Fatalf("exchange: %q, %v", got, err)
	}
	if got := chooser.Resets(); !reflect.DeepEqual(got, []bool{false, true}) {
		t.Errorf("Choose calls with reset=%v, want [false true]", got)
	}
	if got := metrics.Snapshot().DialFailed; !reflect.DeepEqual(got, []netip.AddrPort{closed}) {
		t.Errorf("DialFailed for %v, want [%s]", got, closed)
	}
	if got := chooser.Unreachables(); !reflect.DeepEqual(got, []netip.AddrPort{closed}) {
		t.Errorf("Unreachable reported %v, want [%s]", got, closed)
	}
}

func TestUDPCloseEndsSessions(t *testing.T) {
	checkNoLeaks(t)
	backend := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "")
	metrics := &forwardtest.Metrics{}
	p := startUDPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, func(p *Proxy) { p.Metrics = metrics })
	for range 3 {
		if _, err := forwardtest.UDPExchange(forwardtest.DialUDP(t, p.addr), []byte("x"), 1, forwardtest.WaitTimeout); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if m := metrics.Snapshot(); m.SessionsOpened != 3 || m.SessionsClosed != 3 || p.sessionCount() != 0 {
		t.Errorf("after Close: %+v and %d sessions, want 3 opened and closed, none left", m, p.sessionCount())
	}
	if err := p.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// TestUDPConnReceiveBuffer checks that serving gives the service port's socket the large
// receive buffer (udpConnRcvBuf) that absorbs bursts while the read loop waits for a core.
func TestUDPConnReceiveBuffer(t *testing.T) {
	testenv.Privileged(t) // CAP_NET_ADMIN for SO_RCVBUFFORCE
	backend := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "")
	r := startUDPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, nil)
	c := forwardtest.DialUDP(t, r.addr)
	if _, err := forwardtest.UDPExchange(c, []byte("ping"), 1, forwardtest.WaitTimeout); err != nil { // Serve has prepared
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
func (p *Proxy) sessionCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.sessions)
}
