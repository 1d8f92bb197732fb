package userspace

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/loadbalancer"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/tcp"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/portalloc"
)

// backend is a TCP+UDP echo server on loopback that answers "name payload".
type backend struct {
	name string
	addr netip.AddrPort
	ln   net.Listener
	pc   net.PacketConn
	wg   sync.WaitGroup
}

func startBackend(t *testing.T, name string) *backend {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	pc, err := net.ListenPacket("udp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		ln.Close()
		t.Fatal(err)
	}
	b := &backend{name: name, addr: netip.MustParseAddrPort(ln.Addr().String()), ln: ln, pc: pc}
	b.wg.Add(2)
	go func() {
		defer b.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			b.wg.Add(1)
			go func() {
				defer b.wg.Done()
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					fmt.Fprintf(c, "%s %s", name, line)
				}
			}()
		}
	}()
	go func() {
		defer b.wg.Done()
		buf := make([]byte, 65536)
		for {
			n, peer, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			pc.WriteTo(append([]byte(name+" "), buf[:n]...), peer)
		}
	}()
	t.Cleanup(b.stop)
	return b
}

func (b *backend) stop() {
	b.ln.Close()
	b.pc.Close()
	b.wg.Wait()
}

type svcOpt func(*v1.Service)

func service(name string, ports []v1.ServicePort, opts ...svcOpt) *v1.Service {
	s := &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name},
		Spec:       v1.ServiceSpec{Type: v1.ServiceTypeClusterIP, ClusterIP: "10.96.0.10", Ports: ports},
	}
	for _, o := range opts {
		o(s)
	}
	return s
}

func tcpPort(name string, port int32) v1.ServicePort {
	return v1.ServicePort{Name: name, Port: port, Protocol: v1.ProtocolTCP}
}

func udpPort(name string, port int32) v1.ServicePort {
	return v1.ServicePort{Name: name, Port: port, Protocol: v1.ProtocolUDP}
}

// slice returns an EndpointSlice for service with one port name and the given backends.
func slice(service, sliceName, portName string, proto v1.Protocol, bs ...*backend) *discovery.EndpointSlice {
	s := &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "default", Name: sliceName, Labels: map[string]string{discovery.LabelServiceName: service}},
		AddressType: discovery.AddressTypeIPv4,
	}
	// All backends of a slice share one port number: the tests give each slice one backend
	// unless the ports match.
	if len(bs) > 0 {
		s.Ports = []discovery.EndpointPort{{Name: ptr.To(portName), Port: ptr.To(int32(bs[0].addr.Port())), Protocol: ptr.To(proto)}}
	}
	for _, b := range bs {
		s.Endpoints = append(s.Endpoints, discovery.Endpoint{Addresses: []string{b.addr.Addr().String()}, Conditions: discovery.EndpointConditions{Ready: ptr.To(true)}})
	}
	return s
}

type recordingPortals struct {
	mu    sync.Mutex
	last  []proxy.PortState
	fulls []bool // the full flag of every Sync
}

func (r *recordingPortals) Sync(_ context.Context, ports []proxy.PortState, _ proxy.NodeAddrs, full bool) error {
	r.mu.Lock()
	r.last = ports
	r.fulls = append(r.fulls, full)
	r.mu.Unlock()
	return nil
}

// Portal syncs are full when periodic, the first time, and whenever SyncPeriod has passed since
// the last full one (with changes waiting, after a partial sync of them, unless two periods
// have passed); otherwise partial. The sync results say which.
func TestPortalSyncsFullOrPartial(t *testing.T) {
	portals := &recordingPortals{}
	var kinds []bool
	p := newTestProxier(t, Options{Portals: portals, SyncPeriod: time.Hour, OnSynced: func(r proxy.SyncResult) {
		kinds = append(kinds, r.Kind == proxy.SyncFull)
	}})
	p.sync(false) // the first: full
	p.sync(false) // right after: partial
	p.sync(true)  // periodic: full
	p.sync(false)
	p.lastFull = time.Now().Add(-time.Hour - time.Second) // as if the period had passed
	p.sync(false)                                         // overdue: full
	p.sync(false)
	// Overdue with a change waiting: the change first, as a partial sync, then the full one.
	p.lastFull = time.Now().Add(-time.Hour - time.Second)
	p.Tracker().OnServiceUpdate(nil, service("more", []v1.ServicePort{tcpPort("tcp", 80)}))
	p.sync(false)
	p.sync(false)
	// Overdue by two periods: full, changes or not.
	p.lastFull = time.Now().Add(-2*time.Hour - time.Second)
	p.Tracker().OnServiceUpdate(nil, service("more2", []v1.ServicePort{tcpPort("tcp", 80)}))
	p.sync(false)
	want := []bool{true, false, true, false, true, false, false, true, true}
	portals.mu.Lock()
	defer portals.mu.Unlock()
	if !slices.Equal(portals.fulls, want) {
		t.Errorf("full flags of the portal syncs: %v, want %v", portals.fulls, want)
	}
	if !slices.Equal(kinds, want) {
		t.Errorf("sync kinds in the results (full?): %v, want %v", kinds, want)
	}
}

func newTestProxier(t *testing.T, opts Options) *Proxier {
	t.Helper()
	if opts.UDPTimeout == 0 {
		opts.UDPTimeout = 5 * time.Second
	}
	p := New(opts)
	p.Tracker().OnSynced()
	t.Cleanup(func() {
		p.closeListeners()
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_ = p.Shutdown(ctx)
	})
	return p
}

func proxyPort(t *testing.T, p *Proxier, name proxy.Name) int {
	t.Helper()
	for _, st := range p.Ports() {
		if st.ServicePort.Name == name {
			return st.ProxyPort
		}
	}
	t.Fatalf("service port %s not found in %v", name, p.Ports())
	return 0
}

func portExists(p *Proxier, name proxy.Name) bool {
	for _, st := range p.Ports() {
		if st.ServicePort.Name == name {
			return true
		}
	}
	return false
}

// ask sends one line over a new connection (TCP) or socket (UDP) and returns the answer.
func ask(t *testing.T, network string, port int, payload string) (string, error) {
	t.Helper()
	c, err := net.DialTimeout(network, fmt.Sprintf("127.0.0.1:%d", port), 2*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, payload+"\n"); err != nil {
		return "", err
	}
	buf := make([]byte, 65536)
	if network == "udp" {
		n, err := c.Read(buf)
		return strings.TrimSpace(string(buf[:n])), err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	return strings.TrimSpace(line), err
}

func mustAsk(t *testing.T, network string, port int) string {
	t.Helper()
	got, err := ask(t, network, port, "ping")
	if err != nil {
		t.Fatalf("%s request to proxy port %d: %v", network, port, err)
	}
	name, _, _ := strings.Cut(got, " ")
	return name
}

var (
	echoTCP = proxy.Name{Namespace: "default", Name: "echo", Port: "tcp"}
	echoUDP = proxy.Name{Namespace: "default", Name: "echo", Port: "udp"}
)

func TestTCPAndUDPThroughProxy(t *testing.T) {
	a, b := startBackend(t, "a"), startBackend(t, "b")
	p := newTestProxier(t, Options{})
	tr := p.Tracker()
	tr.OnServiceUpdate(nil, service("echo", []v1.ServicePort{tcpPort("tcp", 80), udpPort("udp", 53)}))
	tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-a-tcp", "tcp", v1.ProtocolTCP, a))
	tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-b-tcp", "tcp", v1.ProtocolTCP, b))
	tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-a-udp", "udp", v1.ProtocolUDP, a))
	p.Sync()

	tcp := proxyPort(t, p, echoTCP)
	udp := proxyPort(t, p, echoUDP)
	seen := map[string]int{}
	for range 10 {
		seen[mustAsk(t, "tcp", tcp)]++
	}
	if seen["a"] != 5 || seen["b"] != 5 {
		t.Errorf("TCP round robin over two endpoints: got %v, want 5/5", seen)
	}
	if got := mustAsk(t, "udp", udp); got != "a" {
		t.Errorf("UDP answered by %q, want a", got)
	}
	if loops := p.listen.loops; loops == nil || loops.Served() != 10 {
		t.Errorf("event loops %v served %d TCP connections, want all 10", loops, servedBy(loops))
	}
}

func servedBy(loops *tcp.Loops) uint64 {
	if loops == nil {
		return 0
	}
	return loops.Served()
}

func TestNoEndpointsRefusedAtOnce(t *testing.T) {
	p := newTestProxier(t, Options{})
	p.Tracker().OnServiceUpdate(nil, service("echo", []v1.ServicePort{tcpPort("tcp", 80)}))
	p.Sync()
	port := proxyPort(t, p, echoTCP)
	start := time.Now()
	_, err := ask(t, "tcp", port, "ping")
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("want connection reset, got %v", err)
	}
	t.Logf("refused after %v", time.Since(start))
	if st := p.Ports()[0]; st.Internal != proxy.Reject || st.External != proxy.Reject {
		t.Errorf("portal actions = %v/%v, want reject/reject", st.Internal, st.External)
	}
}

// TestListenerSurvivesUnrelatedChanges: endpoint changes, affinity timeout changes, a changed
// service port number and an added externalIP keep the listener (upstream reopened on each).
func TestListenerSurvivesUnrelatedChanges(t *testing.T) {
	a, b := startBackend(t, "a"), startBackend(t, "b")
	p := newTestProxier(t, Options{})
	tr := p.Tracker()
	svc := service("echo", []v1.ServicePort{tcpPort("tcp", 80)})
	tr.OnServiceUpdate(nil, svc)
	sa := slice("echo", "echo-a", "tcp", v1.ProtocolTCP, a)
	tr.OnEndpointSliceUpdate(nil, sa)
	p.Sync()
	port := proxyPort(t, p, echoTCP)

	steps := []struct {
		name   string
		change func()
		want   string // backend expected to answer
	}{
		{"endpoint replaced", func() {
			tr.OnEndpointSliceUpdate(sa, nil)
			tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-b", "tcp", v1.ProtocolTCP, b))
		}, "b"},
		{"affinity timeout changed", func() {
			next := svc.DeepCopy()
			next.Spec.SessionAffinity = v1.ServiceAffinityClientIP
			next.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr.To(int32(60))}}
			tr.OnServiceUpdate(svc, next)
			svc = next
		}, "b"},
		{"service port number changed", func() {
			next := svc.DeepCopy()
			next.Spec.Ports[0].Port = 8080
			tr.OnServiceUpdate(svc, next)
			svc = next
		}, "b"},
		{"externalIP added", func() {
			next := svc.DeepCopy()
			next.Spec.ExternalIPs = []string{"192.0.2.10"}
			tr.OnServiceUpdate(svc, next)
			svc = next
		}, "b"},
	}
	for _, s := range steps {
		s.change()
		p.Sync()
		if got := proxyPort(t, p, echoTCP); got != port {
			t.Fatalf("%s: proxy port changed %d → %d", s.name, port, got)
		}
		if got := mustAsk(t, "tcp", port); got != s.want {
			t.Fatalf("%s: answered by %q, want %q", s.name, got, s.want)
		}
	}
	if got := p.Ports()[0].ServicePort.Port; got != 8080 {
		t.Errorf("service port not updated: %d", got)
	}
}

// TestDeleteClosesPort covers delete, update-delete-update and ClusterIP "" / "None".
func TestDeleteClosesPort(t *testing.T) {
	a := startBackend(t, "a")
	tests := []struct {
		name   string
		remove func(tr interface {
			OnServiceUpdate(prev, cur *v1.Service)
		}, svc *v1.Service)
	}{
		{"delete", func(tr interface{ OnServiceUpdate(prev, cur *v1.Service) }, svc *v1.Service) {
			tr.OnServiceUpdate(svc, nil)
		}},
		{"clusterIP None", func(tr interface{ OnServiceUpdate(prev, cur *v1.Service) }, svc *v1.Service) {
			next := svc.DeepCopy()
			next.Spec.ClusterIP = v1.ClusterIPNone
			tr.OnServiceUpdate(svc, next)
		}},
		{"clusterIP empty", func(tr interface{ OnServiceUpdate(prev, cur *v1.Service) }, svc *v1.Service) {
			next := svc.DeepCopy()
			next.Spec.ClusterIP = ""
			tr.OnServiceUpdate(svc, next)
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := newTestProxier(t, Options{})
			tr := p.Tracker()
			svc := service("echo", []v1.ServicePort{tcpPort("tcp", 80)})
			tr.OnServiceUpdate(nil, svc)
			tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-a", "tcp", v1.ProtocolTCP, a))
			p.Sync()
			port := proxyPort(t, p, echoTCP)
			mustAsk(t, "tcp", port)

			tc.remove(tr, svc)
			p.Sync()
			if portExists(p, echoTCP) {
				t.Fatal("service port still present after removal")
			}
			if _, err := ask(t, "tcp", port, "ping"); !errors.Is(err, syscall.ECONNREFUSED) {
				t.Fatalf("after removal: want connection refused on the old proxy port, got %v", err)
			}
			// update-delete-update: the service comes back with a working listener.
			tr.OnServiceUpdate(nil, svc)
			p.Sync()
			if got := mustAsk(t, "tcp", proxyPort(t, p, echoTCP)); got != "a" {
				t.Fatalf("after re-add: answered by %q", got)
			}
		})
	}
}

// TestProtocolChangeReopens: changing a port's protocol is the one change that needs a new listener.
func TestProtocolChangeReopens(t *testing.T) {
	a := startBackend(t, "a")
	p := newTestProxier(t, Options{})
	tr := p.Tracker()
	svc := service("echo", []v1.ServicePort{tcpPort("p", 80)})
	tr.OnServiceUpdate(nil, svc)
	tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-a", "p", v1.ProtocolTCP, a))
	p.Sync()
	name := proxy.Name{Namespace: "default", Name: "echo", Port: "p"}
	mustAsk(t, "tcp", proxyPort(t, p, name))
	next := svc.DeepCopy()
	next.Spec.Ports[0].Protocol = v1.ProtocolUDP
	tr.OnServiceUpdate(svc, next)
	p.Sync()
	if got := mustAsk(t, "udp", proxyPort(t, p, name)); got != "a" {
		t.Fatalf("UDP after protocol change answered by %q", got)
	}
}

// TestEndpointsBeforeServiceWithAffinity: endpoints arrive first, then a service with a custom
// ClientIP timeout (upstream bug 107398 ignored it): affinity holds, and expires by the timeout.
func TestEndpointsBeforeServiceWithAffinity(t *testing.T) {
	a, b := startBackend(t, "a"), startBackend(t, "b")
	p := newTestProxier(t, Options{})
	tr := p.Tracker()
	tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-a", "tcp", v1.ProtocolTCP, a))
	tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-b", "tcp", v1.ProtocolTCP, b))
	p.Sync()
	tr.OnServiceUpdate(nil, service("echo", []v1.ServicePort{tcpPort("tcp", 80)}, func(s *v1.Service) {
		s.Spec.SessionAffinity = v1.ServiceAffinityClientIP
		s.Spec.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr.To(int32(1))}}
	}))
	p.Sync()
	port := proxyPort(t, p, echoTCP)
	first := mustAsk(t, "tcp", port)
	for range 5 {
		if got := mustAsk(t, "tcp", port); got != first {
			t.Fatalf("affinity broken: %q then %q", first, got)
		}
	}
	time.Sleep(1500 * time.Millisecond) // past the 1s timeout
	seen := map[string]bool{}
	for range 4 {
		seen[mustAsk(t, "tcp", port)] = true
		time.Sleep(1100 * time.Millisecond)
	}
	if len(seen) != 2 {
		t.Errorf("after the affinity timeout, requests spaced past it should rotate; saw %v", seen)
	}
}

// TestPortRangeExhaustionRetried: a port that cannot be opened is reported, rejected in the
// portals, never leaked, and retried at the next sync once it is free.
func TestPortRangeExhaustionRetried(t *testing.T) {
	a := startBackend(t, "a")
	squatter, err := net.Listen("tcp", "[::]:0")
	if err != nil {
		t.Fatal(err)
	}
	port := squatter.Addr().(*net.TCPAddr).Port
	portals := &recordingPortals{}
	p := newTestProxier(t, Options{PortRange: portalloc.Range{Base: port, Size: 1}, Portals: portals})
	tr := p.Tracker()
	tr.OnServiceUpdate(nil, service("echo", []v1.ServicePort{tcpPort("tcp", 80)}))
	tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-a", "tcp", v1.ProtocolTCP, a))
	p.Sync()
	st := p.Ports()[0]
	if st.ProxyPort != 0 || st.Internal != proxy.Reject {
		t.Fatalf("with the only port taken: got proxy port %d, action %v; want 0, reject", st.ProxyPort, st.Internal)
	}
	if p.alloc.InUse() != 0 {
		t.Fatalf("failed port leaked: %d in use", p.alloc.InUse())
	}
	squatter.Close()
	p.Sync()
	if got := proxyPort(t, p, echoTCP); got != port {
		t.Fatalf("after the port was freed: proxy port %d, want %d", got, port)
	}
	if got := mustAsk(t, "tcp", port); got != "a" {
		t.Fatalf("answered by %q", got)
	}
	portals.mu.Lock()
	defer portals.mu.Unlock()
	if len(portals.last) != 1 || portals.last[0].ProxyPort != port || portals.last[0].Internal != proxy.Redirect {
		t.Fatalf("portals told %+v", portals.last)
	}
}

// TestUDPSessionsDroppedWhenEndpointLeaves: the next datagram after the endpoint left goes to
// the remaining endpoint at once, not after the idle timeout.
func TestUDPSessionsDroppedWhenEndpointLeaves(t *testing.T) {
	a, b := startBackend(t, "a"), startBackend(t, "b")
	p := newTestProxier(t, Options{UDPTimeout: time.Hour})
	tr := p.Tracker()
	tr.OnServiceUpdate(nil, service("echo", []v1.ServicePort{udpPort("udp", 53)}))
	sa := slice("echo", "echo-a", "udp", v1.ProtocolUDP, a)
	tr.OnEndpointSliceUpdate(nil, sa)
	p.Sync()
	port := proxyPort(t, p, echoUDP)

	c, err := net.Dial("udp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	askOn := func() string {
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write([]byte("x")); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 100)
		n, err := c.Read(buf)
		if err != nil {
			t.Fatal(err)
		}
		name, _, _ := strings.Cut(string(buf[:n]), " ")
		return name
	}
	if got := askOn(); got != "a" {
		t.Fatalf("first answer from %q", got)
	}
	tr.OnEndpointSliceUpdate(sa, nil)
	tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-b", "udp", v1.ProtocolUDP, b))
	p.Sync()
	if got := askOn(); got != "b" {
		t.Fatalf("after endpoint a left, the same client's datagram went to %q", got)
	}
}

// TestHeldNodePort: with HoldPorts the NodePort is held by a real socket, and released on delete.
func TestHeldNodePort(t *testing.T) {
	free, err := net.Listen("tcp", "[::]:0")
	if err != nil {
		t.Fatal(err)
	}
	nodePort := free.Addr().(*net.TCPAddr).Port
	free.Close()
	p := newTestProxier(t, Options{HoldPorts: true, NodeAddrs: noNodeAddrs})
	tr := p.Tracker()
	svc := service("np", []v1.ServicePort{{Name: "tcp", Port: 80, NodePort: int32(nodePort), Protocol: v1.ProtocolTCP}}, func(s *v1.Service) {
		s.Spec.Type = v1.ServiceTypeNodePort
	})
	tr.OnServiceUpdate(nil, svc)
	p.Sync()
	if _, err := net.Listen("tcp", fmt.Sprintf(":%d", nodePort)); err == nil || !errors.Is(err, syscall.EADDRINUSE) {
		t.Fatalf("NodePort %d not held: listen by another socket gave %v", nodePort, err)
	}
	// A connection the portal rules did not redirect meets no listener: refused at once, not
	// accepted and left hanging.
	if c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", nodePort), 5*time.Second); !errors.Is(err, syscall.ECONNREFUSED) {
		if c != nil {
			c.Close()
		}
		t.Errorf("connection to the held NodePort: %v, want connection refused", err)
	}
	tr.OnServiceUpdate(svc, nil)
	p.Sync()
	ln, err := net.Listen("tcp", fmt.Sprintf(":%d", nodePort))
	if err != nil {
		t.Fatalf("NodePort %d still held after delete: %v", nodePort, err)
	}
	ln.Close()
}

func TestActions(t *testing.T) {
	ep := func(node string, ready, serving, terminating bool) proxy.Endpoint {
		return proxy.Endpoint{Addr: netip.MustParseAddrPort("10.0.0.1:80"), NodeName: node, Ready: ready, Serving: serving, Terminating: terminating}
	}
	inZone := func(e proxy.Endpoint, zone string) proxy.Endpoint {
		e.ZoneHints = proxy.NewHints(zone)
		return e
	}
	tests := []struct {
		name             string
		extLocal, intLoc bool
		eps              []proxy.Endpoint
		wantInt, wantExt proxy.Action
	}{
		{"no endpoints", false, false, nil, proxy.Reject, proxy.Reject},
		{"remote endpoint, cluster", false, false, []proxy.Endpoint{ep("n2", true, true, false)}, proxy.Redirect, proxy.Redirect},
		{"remote endpoint, external local", true, false, []proxy.Endpoint{ep("n2", true, true, false)}, proxy.Redirect, proxy.Drop},
		{"remote endpoint, internal local", false, true, []proxy.Endpoint{ep("n2", true, true, false)}, proxy.Drop, proxy.Redirect},
		{"local endpoint, both local", true, true, []proxy.Endpoint{ep("n1", true, true, false)}, proxy.Redirect, proxy.Redirect},
		{"only terminating serving", false, false, []proxy.Endpoint{ep("n2", false, true, true)}, proxy.Redirect, proxy.Redirect},
		{"only terminating not serving", false, false, []proxy.Endpoint{ep("n2", false, false, true)}, proxy.Reject, proxy.Reject},
		// Topology hints narrow the endpoints but never empty them: the actions do not change.
		{"remote endpoint hinted for another zone", false, false, []proxy.Endpoint{inZone(ep("n2", true, true, false), "zone-b")}, proxy.Redirect, proxy.Redirect},
		{"hinted for this zone, external local", true, false, []proxy.Endpoint{inZone(ep("n2", true, true, false), "zone-a")}, proxy.Redirect, proxy.Drop},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			sp := &proxy.ServicePort{Name: proxy.Name{Namespace: "ns", Name: "svc"}, ExternalPolicyLocal: tc.extLocal, InternalPolicyLocal: tc.intLoc}
			lb := loadbalancer.New(loadbalancer.Options{NodeName: "n1", Zone: "zone-a"})
			lb.SetServicePort(sp, tc.eps)
			i, e := actions(lb.Availability(sp.Name), true)
			if i != tc.wantInt || e != tc.wantExt {
				t.Errorf("got %v/%v, want %v/%v", i, e, tc.wantInt, tc.wantExt)
			}
		})
	}
}

// TestHeldLocalPortal checks that an external IP that is one of the node's own addresses has its
// service port held by a socket (TCP and UDP), and released when the service goes.
func TestHeldLocalPortal(t *testing.T) {
	const local = "127.0.0.1"
	// A port free for TCP and UDP on the address.
	var port int
	for range 20 {
		tl, err := net.Listen("tcp", local+":0")
		if err != nil {
			t.Fatal(err)
		}
		port = tl.Addr().(*net.TCPAddr).Port
		ul, err := net.ListenPacket("udp", fmt.Sprintf("%s:%d", local, port))
		tl.Close()
		if err == nil {
			ul.Close()
			break
		}
		port = 0
	}
	if port == 0 {
		t.Fatal("no port free for both TCP and UDP on " + local)
	}
	p := newTestProxier(t, Options{HoldPorts: true, NodeAddrs: nodeAddrs(netip.MustParseAddr(local))})
	tr := p.Tracker()
	svc := service("eip", []v1.ServicePort{tcpPort("tcp", int32(port)), udpPort("udp", int32(port))}, func(s *v1.Service) {
		s.Spec.ExternalIPs = []string{local, "192.0.2.7"} // the second is not the node's: not held
	})
	addr := fmt.Sprintf("%s:%d", local, port)
	tr.OnServiceUpdate(nil, svc)
	p.Sync()
	if _, err := net.Listen("tcp", addr); !errors.Is(err, syscall.EADDRINUSE) {
		t.Errorf("TCP %s not held: listen by another socket gave %v", addr, err)
	}
	if _, err := net.ListenPacket("udp", addr); !errors.Is(err, syscall.EADDRINUSE) {
		t.Errorf("UDP %s not held: bind by another socket gave %v", addr, err)
	}
	if got, want := p.holder.heldKeys(), 2; len(got) != want {
		t.Errorf("held %v, want %d sockets (TCP and UDP on %s only)", got, want, addr)
	}
	tr.OnServiceUpdate(svc, nil)
	p.Sync()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("TCP %s still held after delete: %v", addr, err)
	}
	ln.Close()
	pc, err := net.ListenPacket("udp", addr)
	if err != nil {
		t.Fatalf("UDP %s still held after delete: %v", addr, err)
	}
	pc.Close()
}

// noNodeAddrs is Options.NodeAddrs for a node with no address of its own.
func noNodeAddrs() (proxy.NodeAddrs, error) { return proxy.NodeAddrs{}, nil }

// nodeAddrs returns an Options.NodeAddrs that lists addrs.
func nodeAddrs(addrs ...netip.Addr) func() (proxy.NodeAddrs, error) {
	return func() (proxy.NodeAddrs, error) { return proxy.NewNodeAddrs(addrs), nil }
}

// serviceSyncs records, for one service port, its internal action in every portal sync that
// had it.
type serviceSyncs struct {
	name proxy.Name
	mu   sync.Mutex
	seen []proxy.Action
	ch   chan struct{}
}

func (r *serviceSyncs) Sync(_ context.Context, ports []proxy.PortState, _ proxy.NodeAddrs, _ bool) error {
	for _, st := range ports {
		if st.ServicePort.Name == r.name {
			r.mu.Lock()
			r.seen = append(r.seen, st.Internal)
			r.mu.Unlock()
			r.ch <- struct{}{}
		}
	}
	return nil
}

// A new Service whose EndpointSlice follows within FirstSliceWait is programmed once, with its
// endpoint (no REJECT rule first); one whose slice does not come is programmed, with REJECT,
// when the wait is over; with no wait, at once.
func TestNewServiceWaitsForItsFirstSlice(t *testing.T) {
	be := &backend{name: "b", addr: netip.MustParseAddrPort("127.0.0.1:9")}
	name := proxy.Name{Namespace: "default", Name: "new", Port: "tcp"}
	run := func(t *testing.T, wait time.Duration) (*Proxier, *serviceSyncs) {
		rec := &serviceSyncs{name: name, ch: make(chan struct{}, 100)}
		p := newTestProxier(t, Options{Portals: rec, MinSyncPeriod: time.Millisecond, FirstSliceWait: wait})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { p.Run(ctx); close(done) }()
		t.Cleanup(func() { cancel(); <-done })
		time.Sleep(50 * time.Millisecond) // the initial sync (triggered by OnSynced) is over
		return p, rec
	}
	next := func(t *testing.T, rec *serviceSyncs) time.Time {
		t.Helper()
		select {
		case <-rec.ch:
			return time.Now()
		case <-time.After(10 * time.Second):
			t.Fatal("no sync programmed the new service")
		}
		return time.Time{}
	}
	quiet := func(t *testing.T, rec *serviceSyncs) {
		t.Helper()
		select {
		case <-rec.ch:
			rec.mu.Lock()
			defer rec.mu.Unlock()
			t.Errorf("another sync had the service: actions %v", rec.seen)
		case <-time.After(300 * time.Millisecond):
		}
	}

	t.Run("slice-follows", func(t *testing.T) {
		const wait = 2 * time.Second // wide: the slice comes after 20 ms
		p, rec := run(t, wait)
		p.Tracker().OnServiceUpdate(nil, service("new", []v1.ServicePort{tcpPort("tcp", 80)}))
		time.Sleep(20 * time.Millisecond)
		p.Tracker().OnEndpointSliceUpdate(nil, slice("new", "new-1", "tcp", v1.ProtocolTCP, be))
		next(t, rec)
		quiet(t, rec)
		rec.mu.Lock()
		defer rec.mu.Unlock()
		if !slices.Equal(rec.seen, []proxy.Action{proxy.Redirect}) {
			t.Errorf("the new service's actions in the syncs that had it: %v, want one sync with %v", rec.seen, proxy.Redirect)
		}
	})
	t.Run("no-slice", func(t *testing.T) {
		const wait = 300 * time.Millisecond
		p, rec := run(t, wait)
		added := time.Now()
		p.Tracker().OnServiceUpdate(nil, service("new", []v1.ServicePort{tcpPort("tcp", 80)}))
		if took := next(t, rec).Sub(added); took < wait {
			t.Errorf("programmed %v after it was added, before FirstSliceWait (%v) was over", took, wait)
		}
		rec.mu.Lock()
		defer rec.mu.Unlock()
		if !slices.Equal(rec.seen, []proxy.Action{proxy.Reject}) {
			t.Errorf("actions: %v, want %v (no endpoints)", rec.seen, proxy.Reject)
		}
	})
	t.Run("no-wait", func(t *testing.T) {
		p, rec := run(t, -1)
		added := time.Now()
		p.Tracker().OnServiceUpdate(nil, service("new", []v1.ServicePort{tcpPort("tcp", 80)}))
		if took := next(t, rec).Sub(added); took > DefaultFirstSliceWait {
			t.Errorf("programmed %v after it was added with FirstSliceWait < 0", took)
		}
	})
}

// retryPortals asks, after its first sync, for a retry after a delay (as *portal.Set does when
// a deletion of stale UDP flows failed), and counts its syncs.
type retryPortals struct {
	delay time.Duration
	mu    sync.Mutex
	syncs []time.Time
}

func (r *retryPortals) Sync(context.Context, []proxy.PortState, proxy.NodeAddrs, bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.syncs = append(r.syncs, time.Now())
	return nil
}

func (r *retryPortals) RetryDue() (time.Time, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.syncs) != 1 {
		return time.Time{}, false
	}
	return r.syncs[0].Add(r.delay), true
}

// Portals that ask for a retry get a sync when it is due, with no change to carry it (and no
// periodic sync for an hour), and no more once they stop asking.
func TestPortalsRetryDue(t *testing.T) {
	portals := &retryPortals{delay: 200 * time.Millisecond}
	p := newTestProxier(t, Options{Portals: portals, MinSyncPeriod: time.Millisecond, SyncPeriod: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { p.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		portals.mu.Lock()
		n := len(portals.syncs)
		var gap time.Duration
		if n >= 2 {
			gap = portals.syncs[1].Sub(portals.syncs[0])
		}
		portals.mu.Unlock()
		if n >= 2 {
			if gap < portals.delay {
				t.Errorf("the retry came %v after the first sync, before its due time (%v)", gap, portals.delay)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d syncs in 10 s: the retry the portals asked for never ran", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond)
	portals.mu.Lock()
	defer portals.mu.Unlock()
	if len(portals.syncs) != 2 {
		t.Errorf("%d syncs, want 2: the first and the one retry", len(portals.syncs))
	}
}

// heldKeys returns the held ports (for tests).
func (h *holder) heldKeys() []string {
	out := make([]string, 0, len(h.held))
	for k := range h.held {
		out = append(out, k.String())
	}
	slices.Sort(out)
	return out
}
