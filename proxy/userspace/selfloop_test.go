package userspace

import (
	"bytes"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

func TestSelfAddrsCheck(t *testing.T) {
	node := netip.MustParseAddr("10.0.0.11")
	web := &listener{proxyPort: 40001}
	web.choose.sp.Store(&proxy.ServicePort{
		Name: proxy.Name{Namespace: "ns", Name: "web", Port: "http"}, Protocol: v1.ProtocolTCP, Port: 80, NodePort: 30080,
		ClusterIPs:  []netip.Addr{netip.MustParseAddr("10.96.0.10")},
		ExternalIPs: []netip.Addr{netip.MustParseAddr("192.0.2.7")},
	})
	s := newSelfAddrs(map[proxy.Name]*listener{{Namespace: "ns", Name: "web", Port: "http"}: web}, proxy.NewNodeAddrs([]netip.Addr{node}))
	for _, tc := range []struct {
		proto v1.Protocol
		ep    string
		self  bool
	}{
		{v1.ProtocolTCP, "10.96.0.10:80", true},    // a ClusterIP:port
		{v1.ProtocolTCP, "192.0.2.7:80", true},     // an external IP:port
		{v1.ProtocolTCP, "10.0.0.11:30080", true},  // the node's address with a NodePort
		{v1.ProtocolTCP, "127.0.0.1:40001", true},  // loopback with a proxy port
		{v1.ProtocolTCP, "[::1]:30080", true},      // IPv6 loopback with a NodePort
		{v1.ProtocolTCP, "10.96.0.10:81", false},   // the ClusterIP, another port
		{v1.ProtocolUDP, "10.96.0.10:80", false},   // another protocol
		{v1.ProtocolTCP, "127.0.0.1:18080", false}, // a local backend (the example's)
		{v1.ProtocolTCP, "10.244.1.5:40001", false},
	} {
		err := s.check(tc.proto, netip.MustParseAddrPort(tc.ep))
		if (err != nil) != tc.self {
			t.Errorf("%s %s: check = %v, want self %v", tc.proto, tc.ep, err, tc.self)
		}
	}
}

// TestEndpointPointingBackIsRefused: an endpoint that is the proxy's own listener is left out
// (logged, naming the service port and the address); the port's other endpoint serves every
// connection, and nothing loops.
func TestEndpointPointingBackIsRefused(t *testing.T) {
	a := startBackend(t, "a")
	logs := &syncBuffer{}
	p := newTestProxier(t, Options{Log: zerolog.New(logs)})
	tr := p.Tracker()
	tr.OnServiceUpdate(nil, service("echo", []v1.ServicePort{tcpPort("tcp", 80)}))
	p.Sync()
	port := proxyPort(t, p, echoTCP)
	tr.OnEndpointSliceUpdate(nil, slice("echo", "echo-a", "tcp", v1.ProtocolTCP, a))
	tr.OnEndpointSliceUpdate(nil, &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "default", Name: "echo-self", Labels: map[string]string{discovery.LabelServiceName: "echo"}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr.To("tcp"), Port: ptr.To(int32(port)), Protocol: ptr.To(v1.ProtocolTCP)}},
		Endpoints:   []discovery.Endpoint{{Addresses: []string{"127.0.0.1"}, Conditions: discovery.EndpointConditions{Ready: ptr.To(true)}}},
	})
	p.Sync()
	for range 6 {
		if got := mustAsk(t, "tcp", port); got != "a" {
			t.Fatalf("answered by %q, want a", got)
		}
	}
	if !strings.Contains(logs.String(), "127.0.0.1:"+itoa(port)) || !strings.Contains(logs.String(), "default/echo:tcp") {
		t.Errorf("the refusal does not name the endpoint and the service port:\n%s", logs.String())
	}
}

func itoa(n int) string { return strconv.Itoa(n) }

// TestTransparentNeverToNodeAddress: external traffic of a Local service to an endpoint that is
// this node's own address (a hostNetwork pod) is dialled from the node, not transparently; so is
// traffic from a client on the same link as the endpoint (a pod on the same bridge, whose reply
// would go straight back at layer 2).
func TestTransparentNeverToNodeAddress(t *testing.T) {
	nodeIP := netip.MustParseAddr("10.0.0.11")
	links := func() (proxy.NodeAddrs, error) {
		return proxy.NodeAddrsFromPrefixes([]netip.Prefix{netip.MustParsePrefix("10.0.0.11/24"), netip.MustParsePrefix("10.244.1.1/24")}), nil
	}
	for _, tc := range []struct {
		client, ep      string
		wantTransparent bool
	}{
		{"203.0.113.9:40000", "10.244.1.2:8080", true},
		{"203.0.113.9:40000", "10.0.0.11:8080", false},
		{"10.244.1.9:40000", "10.244.1.2:8080", false}, // a pod on the same bridge
		{"10.0.0.8:40000", "10.244.1.2:8080", true},    // a LAN client: its reply is routed by the node
	} {
		p := newTestProxier(t, Options{NodeName: "node1", NodeAddrs: links, TransparentLocal: true})
		p.Sync()
		sp := &proxy.ServicePort{
			Name: proxy.Name{Namespace: "default", Name: "ingress", Port: "http"}, Protocol: v1.ProtocolTCP, Port: 80, NodePort: 30000,
			ClusterIPs: []netip.Addr{netip.MustParseAddr("10.96.0.10")}, ExternalPolicyLocal: true,
		}
		p.lb.SetServicePort(sp, []proxy.Endpoint{{Addr: netip.MustParseAddrPort(tc.ep), NodeName: "node1", Ready: true, Serving: true}})
		c := &chooser{lb: p.lb, routing: p.routing}
		c.sp.Store(sp)
		tg, err := c.Choose(netip.MustParseAddrPort(tc.client), netip.AddrPortFrom(nodeIP, 30000), false)
		if err != nil {
			t.Fatal(err)
		}
		if tg.Transparent != tc.wantTransparent {
			t.Errorf("client %s, endpoint %s: transparent %v, want %v", tc.client, tc.ep, tg.Transparent, tc.wantTransparent)
		}
	}
}

// syncBuffer is a bytes.Buffer for logs written from many goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
