package userspace

import (
	"net"
	"strconv"
	"testing"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/portalloc"
)

// prefs is a PreferredPorts of a fixed map.
type prefs map[proxy.Name]int

func (p prefs) Port(name proxy.Name, _ v1.Protocol) int { return p[name] }

func (p prefs) Ports() []int {
	var out []int
	for _, port := range p {
		out = append(out, port)
	}
	return out
}

// freePort returns a port no socket holds right now (for TCP and UDP).
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "[::]:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// A listener opens on its preferred port when it can, and on an allocated one when another
// socket holds the preferred port or it is outside the range; either way it serves.
func TestPreferredPorts(t *testing.T) {
	a := startBackend(t, "a")
	want := freePort(t)
	squatter, err := net.ListenPacket("udp", "[::]:0")
	if err != nil {
		t.Fatal(err)
	}
	defer squatter.Close()
	taken := squatter.LocalAddr().(*net.UDPAddr).Port

	p := newTestProxier(t, Options{PreferredPorts: prefs{echoTCP: want, echoUDP: taken}})
	tr := p.Tracker()
	tr.OnServiceUpdate(nil, service("echo", []v1.ServicePort{tcpPort("tcp", 80), udpPort("udp", 53)}))
	tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-a-tcp", "tcp", v1.ProtocolTCP, a))
	tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-a-udp", "udp", v1.ProtocolUDP, a))
	p.Sync()
	if got := proxyPort(t, p, echoTCP); got != want {
		t.Errorf("TCP proxy port %d, want the preferred %d", got, want)
	}
	udp := proxyPort(t, p, echoUDP)
	if udp == taken || udp == 0 {
		t.Errorf("UDP proxy port %d; want an allocated one (the preferred %d is taken)", udp, taken)
	}
	if got := mustAsk(t, "tcp", want); got != "a" {
		t.Errorf("TCP answered by %q, want a", got)
	}
	if got := mustAsk(t, "udp", udp); got != "a" {
		t.Errorf("UDP answered by %q, want a", got)
	}
	if n := p.alloc.InUse(); n != 2 {
		t.Errorf("%d ports in use, want 2 (the failed preferred one released)", n)
	}
}

// A preferred port outside --proxy-port-range is not used.
func TestPreferredPortOutOfRange(t *testing.T) {
	a := startBackend(t, "a")
	inRange := freePort(t)
	outside := inRange%65535 + 1 // free or not: outside the range it is never tried
	p := newTestProxier(t, Options{PortRange: portalloc.Range{Base: inRange, Size: 1}, PreferredPorts: prefs{echoTCP: outside}})
	tr := p.Tracker()
	tr.OnServiceUpdate(nil, service("echo", []v1.ServicePort{tcpPort("tcp", 80)}))
	tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-a", "tcp", v1.ProtocolTCP, a))
	p.Sync()
	if got := proxyPort(t, p, echoTCP); got != inRange {
		t.Fatalf("proxy port %d, want %d from the range (the preferred %d is outside)", got, inRange, outside)
	}
	if got := mustAsk(t, "tcp", inRange); got != "a" {
		t.Errorf("answered by %q, want a", got)
	}
}

// The preferred ports are held from New until the first sync opens their listeners: no other
// socket can take one meanwhile (an outgoing connection of the proxy's own, made before the
// first sync, could otherwise get one as its ephemeral port; the kernel gives none that a
// socket is bound to). The first sync releases the ports of service ports that are gone.
func TestPreferredPortsHeldUntilOpen(t *testing.T) {
	a := startBackend(t, "a")
	want, gone := freePort(t), freePort(t)
	p := newTestProxier(t, Options{PreferredPorts: prefs{echoTCP: want, {Namespace: "default", Name: "gone"}: gone}})
	for _, port := range []int{want, gone} {
		if ln, err := net.Listen("tcp", net.JoinHostPort("::", strconv.Itoa(port))); err == nil {
			ln.Close()
			t.Fatalf("port %d bound by another socket before the first sync: not held", port)
		}
	}
	tr := p.Tracker()
	tr.OnServiceUpdate(nil, service("echo", []v1.ServicePort{tcpPort("tcp", 80)}))
	tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-a-tcp", "tcp", v1.ProtocolTCP, a))
	p.Sync()
	if got := proxyPort(t, p, echoTCP); got != want {
		t.Errorf("TCP proxy port %d, want the preferred %d", got, want)
	}
	if got := mustAsk(t, "tcp", want); got != "a" {
		t.Errorf("TCP answered by %q, want a", got)
	}
	ln, err := net.Listen("tcp", net.JoinHostPort("::", strconv.Itoa(gone)))
	if err != nil {
		t.Fatalf("the preferred port of a service port that is gone still held after the first sync: %v", err)
	}
	ln.Close()
}
