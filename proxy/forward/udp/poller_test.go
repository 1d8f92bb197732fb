//go:build linux

package udp

import (
	"context"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
	"golang.org/x/sys/unix"
)

// A Poller calls an armed function once per Arm when the descriptor is readable, never after
// Disarm, and Close ends its goroutine.
func TestPoller(t *testing.T) {
	checkNoLeaks(t)
	p, err := NewPoller()
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	called := make(chan int, 10)
	arm := func(n int) {
		t.Helper()
		if err := p.Arm(fds[0], func() { called <- n }); err != nil {
			t.Fatalf("Arm: %v", err)
		}
	}
	expect := func(want int) {
		t.Helper()
		select {
		case n := <-called:
			if n != want {
				t.Fatalf("function %d called, want %d", n, want)
			}
		case <-time.After(forwardtest.WaitTimeout):
			t.Fatalf("function %d not called", want)
		}
	}
	expectNone := func() {
		t.Helper()
		select {
		case n := <-called:
			t.Fatalf("function %d called, want none", n)
		case <-time.After(100 * time.Millisecond):
		}
	}

	arm(1)
	expectNone() // nothing to read yet
	unix.Write(fds[1], []byte("x"))
	expect(1)
	expectNone() // one-shot, though the byte is still there
	arm(2)
	expect(2) // readable already: called at once
	var one [1]byte
	unix.Read(fds[0], one[:]) // nothing to read: arm(3) cannot fire before Disarm
	arm(3)
	p.Disarm(fds[0])
	unix.Write(fds[1], []byte("x"))
	expectNone()
	arm(4) // armed again after Disarm: watched anew
	expect(4)

	if err := p.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := p.Arm(fds[0], func() {}); err == nil {
		t.Error("Arm after Close succeeded")
	}
}

// newTestPoller returns a Poller closed at the end of the test.
func newTestPoller(t *testing.T) *Poller {
	t.Helper()
	p, err := NewPoller()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// readLoops counts the goroutines in a UDP proxy's read loop.
func readLoops() int { return goroutinesIn("udp.(*Proxy).readLoop") }

// goroutinesIn counts the receivers (proxies) that have a goroutine in the method frame: a
// proxy whose loop is on its way out while its next one starts counts once. Lines naming the
// method as the creator of another goroutine ("created by") and frames of its closures
// (frame.func1) do not count.
func goroutinesIn(frame string) int {
	receivers := map[string]bool{}
	for _, line := range strings.Split(string(forwardtest.AllStacks()), "\n") {
		if strings.HasPrefix(line, "created by ") {
			continue
		}
		_, args, ok := strings.Cut(line, frame+"(")
		if !ok {
			continue
		}
		recv, _, _ := strings.Cut(args, ",")
		recv, _, _ = strings.Cut(recv, ")")
		receivers[recv] = true
	}
	return len(receivers)
}

// UDP ports started with a Poller hold no goroutine while no datagram arrives; sessions work as
// with Serve; a parked port closes, freezes and thaws. Fails if Start falls back to a goroutine
// per port.
func TestUDPStartParksIdleSockets(t *testing.T) {
	checkNoLeaks(t)
	forwardtest.CheckNoFDLeaks(t)
	poller := newTestPoller(t)
	backend := forwardtest.StartUDPEcho(t, forwardtest.Loopback("4"), "echo:")
	const n = 5
	proxies := make([]*Proxy, n)
	addrs := make([]netip.AddrPort, n)
	for i := range proxies {
		conn, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(forwardtest.Loopback("4"), 0)))
		if err != nil {
			t.Fatal(err)
		}
		p := &Proxy{Conn: conn, Chooser: &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, Log: new(forwardtest.Logger(t))}
		if err := p.Start(poller); err != nil {
			t.Fatalf("Start: %v", err)
		}
		proxies[i], addrs[i] = p, conn.LocalAddr().(*net.UDPAddr).AddrPort()
		t.Cleanup(func() {
			if err := p.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
		})
	}
	if got := readLoops(); got != 0 {
		t.Fatalf("%d read loops running for %d idle UDP ports, want none", got, n)
	}
	exchange := func(i int, msg string) {
		t.Helper()
		got, err := forwardtest.UDPExchange(forwardtest.DialUDP(t, addrs[i]), []byte(msg), 3, time.Second)
		if err != nil || string(got) != "echo:"+msg {
			t.Fatalf("exchange through port %d: %q, %v", i, got, err)
		}
	}
	exchange(0, "one")
	exchange(1, "two")
	if got := readLoops(); got > 2 {
		t.Errorf("%d read loops after datagrams to 2 ports, want at most 2", got)
	}
	forwardtest.Eventually(t, "the read loops to park after loopIdle", func() bool { return readLoops() == 0 })
	exchange(0, "again") // a new client of a parked port

	if err := proxies[2].Close(); err != nil {
		t.Fatalf("Close of a parked port: %v", err)
	}

	p := proxies[3]
	forwardtest.Eventually(t, "the other read loops to park", func() bool { return readLoops() == 0 })
	st, err := p.Freeze(context.Background())
	if err != nil {
		t.Fatalf("Freeze of a parked port: %v", err)
	}
	if st.Conn == nil {
		t.Fatal("Freeze returned no socket")
	}
	st.Conn.Close()
	c := forwardtest.DialUDP(t, addrs[3])
	if _, err := c.Write([]byte("pending")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(loopIdle / 5)
	if got := readLoops(); got != 0 {
		t.Errorf("%d read loops with a frozen port and a datagram pending, want none", got)
	}
	if err := p.Thaw(); err != nil {
		t.Fatalf("Thaw: %v", err)
	}
	if err := p.Start(poller); err != nil {
		t.Fatalf("Start after Thaw: %v", err)
	}
	buf := make([]byte, 100)
	c.SetReadDeadline(time.Now().Add(forwardtest.WaitTimeout))
	if m, err := c.Read(buf); err != nil || string(buf[:m]) != "echo:pending" {
		t.Fatalf("the datagram pending across freeze and thaw: %q, %v", buf[:m], err)
	}
}
