//go:build linux

package userspace

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"

	"golang.org/x/sys/unix"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
)

// startBlackHole returns an endpoint on loopback that drops every SYN: a listening socket with
// a backlog of one, filled by a connection nobody accepts (the kernel drops a SYN to a listener
// whose accept queue is full), as an endpoint behind a firewall or a pod being torn down does.
func startBlackHole(t *testing.T, name string) *backend {
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
	addr := netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, 1}), uint16(sa.(*unix.SockaddrInet4).Port))
	filler, err := net.DialTimeout("tcp", addr.String(), 2*time.Second) // the queue's one place
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { filler.Close() })
	return &backend{name: name, addr: addr}
}

// holdingGiver freezes with a deadline, as a freeze that gives up on dials still in progress.
type holdingGiver struct {
	proxierGiver
	freezeFor time.Duration
}

func (g *holdingGiver) Freeze(ctx context.Context) (*handover.Package, error) {
	ctx, cancel := context.WithTimeout(ctx, g.freezeFor)
	defer cancel()
	return g.proxierGiver.Freeze(ctx)
}

// A connection still dialling when a hand-over freezes the proxier (its only endpoint drops
// SYNs) is handed over with its client socket alone, and the successor dials it: it reaches the
// successor's endpoint, and the old proxier's established connections go on there as well. The
// old proxier does not fall over the connection without an endpoint socket.
func TestHandOverOfDiallingConnection(t *testing.T) {
	hole, b := startBlackHole(t, "hole"), startBackend(t, "b")
	other := proxy.Name{Namespace: "default", Name: "other", Port: "tcp"}
	feedHole := func(p *Proxier, ep *backend) {
		tr := p.Tracker()
		tr.OnServiceUpdate(nil, service("echo", []v1.ServicePort{tcpPort("tcp", 80)}))
		tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-tcp", "tcp", v1.ProtocolTCP, ep))
		tr.OnServiceUpdate(nil, service("other", []v1.ServicePort{tcpPort("tcp", 80)}))
		tr.OnEndpointSliceUpdate(nil, slice("other", "other-tcp", "tcp", v1.ProtocolTCP, b))
	}
	old := newTestProxier(t, Options{})
	feedHole(old, hole)
	old.Sync()
	port, otherPort := proxyPort(t, old, echoTCP), proxyPort(t, old, other)
	established := establishedEcho(t, otherPort)
	established("one")

	// A client whose connection the proxy accepted and is dialling to the black hole.
	served := old.listen.loops.Served()
	conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for deadline := time.Now().Add(5 * time.Second); old.listen.loops.Served() == served; {
		if time.Now().After(deadline) {
			t.Fatal("the proxy did not accept the client")
		}
		time.Sleep(time.Millisecond)
	}
	if _, err := fmt.Fprintf(conn, "waiting\n"); err != nil {
		t.Fatal(err)
	}

	path := filepath.Join(t.TempDir(), "h.sock")
	ln, err := handover.Listen(path, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	g := &holdingGiver{proxierGiver: proxierGiver{p: old}, freezeFor: 300 * time.Millisecond}
	handed := make(chan bool, 1)
	go func() { handed <- ln.Serve(context.Background(), g, 10*time.Second) }()

	successor := newTestProxier(t, Options{})
	feedHole(successor, b) // the successor's endpoint answers
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pkg, err := handover.Take(ctx, path, "test", func(*os.File) error { return nil }, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	successor.Adopt(pkg.Records)
	pkg.Close()
	if !<-handed || !g.released {
		t.Fatal("the old proxier did not hand over")
	}
	successor.Sync()

	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if got, err := bufio.NewReader(conn).ReadString('\n'); err != nil || got != "b waiting\n" {
		t.Errorf("the connection dialling during the hand-over: %q, %v; want the successor's endpoint's answer", got, err)
	}
	established("two")
}

// A hand-over that fails after freezing a connection still dialling leaves the old proxier
// serving it: it dials again, and reaches the endpoint a later sync gives it.
func TestResumeDiallingConnection(t *testing.T) {
	hole, b := startBlackHole(t, "hole"), startBackend(t, "b")
	p := newTestProxier(t, Options{})
	tr := p.Tracker()
	tr.OnServiceUpdate(nil, service("echo", []v1.ServicePort{tcpPort("tcp", 80)}))
	tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-tcp", "tcp", v1.ProtocolTCP, hole))
	p.Sync()
	port := proxyPort(t, p, echoTCP)
	served := p.listen.loops.Served()
	conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", port), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for deadline := time.Now().Add(5 * time.Second); p.listen.loops.Served() == served; {
		if time.Now().After(deadline) {
			t.Fatal("the proxy did not accept the client")
		}
		time.Sleep(time.Millisecond)
	}
	if _, err := fmt.Fprintf(conn, "waiting\n"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	recs, err := p.Freeze(ctx)
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	p.Resume(recs)
	tr.OnEndpointSliceUpdate(slice("echo", "echo-tcp", "tcp", v1.ProtocolTCP, hole), slice("echo", "echo-tcp", "tcp", v1.ProtocolTCP, b))
	p.Sync()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if got, err := bufio.NewReader(conn).ReadString('\n'); err != nil || got != "b waiting\n" {
		t.Errorf("the connection dialling during the failed hand-over: %q, %v; want the endpoint's answer", got, err)
	}
}
