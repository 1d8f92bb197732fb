package userspace

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
)

// proxierGiver is what the app hands over: one proxier.
type proxierGiver struct {
	p        *Proxier
	released bool
}

func (g *proxierGiver) Freeze(ctx context.Context) (*handover.Package, error) {
	recs, err := g.p.Freeze(ctx)
	if err != nil {
		return nil, err
	}
	return &handover.Package{Records: recs}, nil
}
func (g *proxierGiver) Release()                     { g.p.Release(); g.released = true }
func (g *proxierGiver) Resume(pkg *handover.Package) { g.p.Resume(pkg.Records); pkg.Close() }

// feed gives p the echo service (TCP with affinity, UDP) with endpoints a and b.
func feed(p *Proxier, a, b *backend) {
	tr := p.Tracker()
	tr.OnServiceUpdate(nil, service("echo", []v1.ServicePort{tcpPort("tcp", 80), udpPort("udp", 53)}, withAffinity()))
	for _, be := range []*backend{a, b} {
		tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-"+be.name+"-tcp", "tcp", v1.ProtocolTCP, be))
		tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-"+be.name+"-udp", "udp", v1.ProtocolUDP, be))
	}
}

// A proxier hands its listeners, an established connection, a UDP session and its affinity
// table to another, through the hand-over socket: the successor serves on the same proxy
// ports, the connection goes on, the UDP client keeps its endpoint.
func TestHandOverBetweenProxiers(t *testing.T) {
	a, b := startBackend(t, "a"), startBackend(t, "b")
	old := newTestProxier(t, Options{})
	feed(old, a, b)
	old.Sync()
	tcpPortNo, udpPortNo := proxyPort(t, old, echoTCP), proxyPort(t, old, echoUDP)

	// An established connection and a UDP session.
	conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", tcpPortNo), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	r := bufio.NewReader(conn)
	line := func(msg string) string {
		t.Helper()
		_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := fmt.Fprintf(conn, "%s\n", msg); err != nil {
			t.Fatalf("write %q: %v", msg, err)
		}
		got, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("read answer to %q: %v", msg, err)
		}
		return strings.TrimSpace(got)
	}
	before := line("one")
	udp, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(netipLoopback(udpPortNo)))
	if err != nil {
		t.Fatal(err)
	}
	defer udp.Close()
	udpAsk := func() string {
		t.Helper()
		buf := make([]byte, 256)
		_ = udp.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := udp.Write([]byte("u\n")); err != nil {
			t.Fatal(err)
		}
		n, err := udp.Read(buf)
		if err != nil {
			t.Fatal(err)
		}
		name, _, _ := strings.Cut(string(buf[:n]), " ")
		return name
	}
	udpBefore := udpAsk()
	// Affinity: this client's TCP endpoint.
	affine := mustAsk(t, "tcp", tcpPortNo)

	path := filepath.Join(t.TempDir(), "h.sock")
	ln, err := handover.Listen(path, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	g := &proxierGiver{p: old}
	served := make(chan bool, 1)
	go func() { served <- ln.Serve(context.Background(), g, 10*time.Second) }()

	successor := newTestProxier(t, Options{})
	feed(successor, a, b)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pkg, err := handover.Take(ctx, path, "test", func(*os.File) error { return nil }, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	successor.Adopt(pkg.Records)
	pkg.Close()
	if !<-served || !g.released {
		t.Fatal("the old proxier did not hand over")
	}
	successor.Sync()

	if got := proxyPort(t, successor, echoTCP); got != tcpPortNo {
		t.Errorf("TCP proxy port %d after the hand-over, %d before", got, tcpPortNo)
	}
	if got := proxyPort(t, successor, echoUDP); got != udpPortNo {
		t.Errorf("UDP proxy port %d after the hand-over, %d before", got, udpPortNo)
	}
	if got := line("two"); got != strings.Replace(before, "one", "two", 1) {
		t.Errorf("the established connection answered %q after the hand-over, %q before", got, before)
	}
	if got := udpAsk(); got != udpBefore {
		t.Errorf("UDP answered by %s after the hand-over, %s before", got, udpBefore)
	}
	for range 4 {
		if got := mustAsk(t, "tcp", tcpPortNo); got != affine {
			t.Errorf("new connection of the affine client went to %s, %s before the hand-over", got, affine)
		}
	}
}

// A hand-over that fails after Freeze (the successor goes away) leaves the old proxier serving
// everything: the same proxy ports, the established connection.
func TestResumeAfterFailedHandOver(t *testing.T) {
	a, b := startBackend(t, "a"), startBackend(t, "b")
	p := newTestProxier(t, Options{})
	feed(p, a, b)
	p.Sync()
	port := proxyPort(t, p, echoTCP)
	conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	r := bufio.NewReader(conn)
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	fmt.Fprintf(conn, "one\n")
	if _, err := r.ReadString('\n'); err != nil {
		t.Fatal(err)
	}

	recs, err := p.Freeze(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	p.Resume(recs)
	p.Sync()
	if got := proxyPort(t, p, echoTCP); got != port {
		t.Errorf("proxy port %d after resuming, %d before", got, port)
	}
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	fmt.Fprintf(conn, "two\n")
	if got, err := r.ReadString('\n'); err != nil || !strings.HasSuffix(got, "two\n") {
		t.Errorf("the connection after resuming: %q, %v", got, err)
	}
	if name := mustAsk(t, "tcp", port); name != "a" && name != "b" {
		t.Errorf("new connection answered by %q", name)
	}
}

// withAffinity turns ClientIP affinity on (60 s).
func withAffinity() svcOpt {
	return func(s *v1.Service) {
		s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
		s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr.To(int32(60))}}
	}
}

func netipLoopback(port int) netip.AddrPort {
	return netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port))
}

// A handed-over listener starts accepting only once the balancer has its endpoints: the rules
// lead to its socket all along, and a connection that waited in the backlog during the hand-over
// (or an adopted one still to be dialled) would otherwise meet a port without endpoints and be
// reset. Connections queued while the old proxier was frozen are all answered.
func TestAdoptedListenerStartsWithEndpoints(t *testing.T) {
	a, b := startBackend(t, "a"), startBackend(t, "b")
	old := newTestProxier(t, Options{})
	feed(old, a, b)
	old.Sync()
	port := proxyPort(t, old, echoTCP)
	recs, err := old.Freeze(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	// Connections made while nobody accepts wait in the listening socket's backlog.
	const queued = 8
	conns := make([]net.Conn, 0, queued)
	for i := range queued {
		c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := fmt.Fprintf(c, "q%d\n", i); err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}

	successor := newTestProxier(t, Options{})
	feed(successor, a, b)
	successor.Adopt(recs)
	old.Release()
	started := 0
	successor.listen.testHookServe = func(l *listener) {
		started++
		sp := l.choose.sp.Load()
		if av := successor.lb.Availability(sp.Name); !av.Any {
			t.Errorf("listener of %s starts serving before the balancer has its endpoints", sp.Name)
		}
	}
	successor.Sync()
	if started == 0 {
		t.Fatal("no listener started: the hook proves nothing")
	}
	if got := proxyPort(t, successor, echoTCP); got != port {
		t.Fatalf("proxy port %d after the hand-over, %d before", got, port)
	}
	for i, c := range conns {
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		got, err := bufio.NewReader(c).ReadString('\n')
		if err != nil || !strings.HasSuffix(got, fmt.Sprintf("q%d\n", i)) {
			t.Errorf("connection %d, queued during the hand-over: %q, %v", i, got, err)
		}
	}
}

// A hand-over that would run out of descriptors is refused before anything is frozen: the
// proxier serves on, its established connection and new ones alike, and a later hand-over with
// room goes ahead.
func TestFreezeRefusedWithoutDescriptors(t *testing.T) {
	a, b := startBackend(t, "a"), startBackend(t, "b")
	p := newTestProxier(t, Options{Limits: Limits{FileLimit: 5000}})
	feed(p, a, b)
	p.Sync()
	port := proxyPort(t, p, echoTCP)
	ask := establishedEcho(t, port)
	ask("one")

	p.openFDs = func() (int, error) { return 4990, nil } // nearly at the limit
	recs, err := p.Freeze(context.Background())
	if err == nil || !strings.Contains(err.Error(), "not enough room") {
		t.Fatalf("Freeze near the descriptor limit: records %d, error %v; want a refusal", len(recs), err)
	}
	ask("two")
	if name := mustAsk(t, "tcp", port); name != "a" && name != "b" {
		t.Errorf("a new connection after the refusal answered by %q", name)
	}

	p.openFDs = openFDCount
	recs, err = p.Freeze(context.Background())
	if err != nil {
		t.Fatalf("Freeze with room: %v", err)
	}
	p.Resume(recs)
	p.Sync()
	ask("three")
}

// A freeze that fails halfway thaws what it froze in place: every listener serves again on its
// proxy port, an established connection goes on (whichever listener froze), and nothing leaks.
func TestFreezeFailingHalfwayThaws(t *testing.T) {
	a, b := startBackend(t, "a"), startBackend(t, "b")
	p := newTestProxier(t, Options{})
	feed(p, a, b)
	tr := p.Tracker()
	tr.OnServiceUpdate(nil, service("other", []v1.ServicePort{tcpPort("tcp", 80)}))
	tr.OnEndpointSliceUpdate(nil, slice("other", "other-a", "tcp", v1.ProtocolTCP, a))
	p.Sync()
	ports := map[proxy.Name]int{}
	for _, st := range p.Ports() {
		ports[st.ServicePort.Name] = st.ProxyPort
	}
	ask := establishedEcho(t, ports[echoTCP])
	ask("one")
	// A UDP session too; and the UDP listener is surely serving (its conntrack socket open).
	if name := mustAsk(t, "udp", ports[echoUDP]); name != "a" && name != "b" {
		t.Fatalf("UDP answered by %q", name)
	}
	fdsBefore, err := openFDCount()
	if err != nil {
		t.Fatal(err)
	}

	// The second listener is frozen, then its record fails (its duplicate closed): the shape of
	// a freeze that ran out of descriptors.
	listeners := 0
	p.testHookRecord = func(kind string) error {
		if kind == handover.KindListener {
			if listeners++; listeners == 2 {
				return errors.New("injected failure")
			}
		}
		return nil
	}
	if _, err := p.Freeze(context.Background()); err == nil || !strings.Contains(err.Error(), "injected failure") {
		t.Fatalf("Freeze: %v, want the injected failure", err)
	}
	p.testHookRecord = nil
	p.Sync()
	ask("two")
	// The failed hand-over's duplicates are closed; the thaw needed no descriptor.
	deadline := time.Now().Add(10 * time.Second)
	for {
		n, err := openFDCount()
		if err == nil && n <= fdsBefore {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d descriptors open after the failed freeze, %d before (%v)", n, fdsBefore, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, st := range p.Ports() {
		if want := ports[st.ServicePort.Name]; st.ProxyPort != want {
			t.Errorf("%s: proxy port %d after the failed freeze, %d before", st.ServicePort.Name, st.ProxyPort, want)
		}
		if st.ServicePort.Protocol == v1.ProtocolTCP {
			if name := mustAsk(t, "tcp", st.ProxyPort); name != "a" && name != "b" {
				t.Errorf("%s: a new connection answered by %q", st.ServicePort.Name, name)
			}
		}
	}
}

// establishedEcho opens a connection to the proxy port and returns a function that sends a line
// on it and fails the test unless the echo comes back.
func establishedEcho(t *testing.T, port int) func(msg string) {
	t.Helper()
	conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	r := bufio.NewReader(conn)
	return func(msg string) {
		t.Helper()
		_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprintf(conn, "%s\n", msg)
		if got, err := r.ReadString('\n'); err != nil || !strings.HasSuffix(got, msg+"\n") {
			t.Fatalf("the established connection: %q, %v", got, err)
		}
	}
}
