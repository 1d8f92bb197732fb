package userspace

import (
	"net/netip"
	"slices"
	"testing"

	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// TestChooseLocalTraffic checks which endpoints new traffic of a Local service may use,
// depending on where it comes from and where it was sent: the node's own traffic to an
// external address ignores externalTrafficPolicy: Local, as kube-proxy's src-type LOCAL rule does,
// and so does a pod's (cluster CIDR), as kube-proxy's pod-traffic rule does.
func TestChooseLocalTraffic(t *testing.T) {
	nodeIP := netip.MustParseAddr("10.0.0.11")
	clusterIP := netip.MustParseAddr("10.96.0.10")
	local := proxy.Endpoint{Addr: netip.MustParseAddrPort("10.244.1.2:8080"), NodeName: "node1", Ready: true, Serving: true}
	remote := proxy.Endpoint{Addr: netip.MustParseAddrPort("10.244.2.2:8080"), NodeName: "node2", Ready: true, Serving: true}
	tests := []struct {
		name      string
		itpLocal  bool
		client    string
		dst       netip.Addr
		wantBoth  bool // both endpoints chosen over several calls; else only the local one
		wantLocal bool
	}{
		{"outside client to NodePort: local only", false, "10.0.0.100", nodeIP, false, true},
		{"node's own address to NodePort: cluster-wide", false, "10.0.0.11", nodeIP, true, false},
		{"loopback to NodePort: cluster-wide", false, "127.0.0.1", nodeIP, true, false},
		{"node's own traffic with internalTrafficPolicy Local: local only", true, "10.0.0.11", nodeIP, false, true},
		{"outside client to ClusterIP: cluster-wide", false, "10.0.0.100", clusterIP, true, false},
		{"pod (cluster CIDR) to NodePort: cluster-wide", false, "10.244.3.7", nodeIP, true, false},
		{"pod with internalTrafficPolicy Local: local only", true, "10.244.3.7", nodeIP, false, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := newTestProxier(t, Options{NodeName: "node1", NodeAddrs: nodeAddrs(nodeIP),
				ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}})
			p.Sync() // takes the node's addresses
			sp := &proxy.ServicePort{
				Name:     proxy.Name{Namespace: "default", Name: "web", Port: "http"},
				Protocol: v1.ProtocolTCP, Port: 80, NodePort: 30000,
				ClusterIPs:          []netip.Addr{clusterIP},
				ExternalPolicyLocal: true, InternalPolicyLocal: tt.itpLocal,
			}
			p.lb.SetServicePort(sp, []proxy.Endpoint{local, remote})
			c := &chooser{lb: p.lb, routing: p.routing}
			c.sp.Store(sp)
			seen := map[netip.AddrPort]bool{}
			for range 8 {
				tg, err := c.Choose(netip.AddrPortFrom(netip.MustParseAddr(tt.client), 40000), netip.AddrPortFrom(tt.dst, 30000), false)
				if err != nil {
					t.Fatal(err)
				}
				seen[tg.Endpoint] = true
			}
			if got := seen[local.Addr] && seen[remote.Addr]; got != tt.wantBoth {
				t.Errorf("both endpoints used = %v, want %v (seen %v)", got, tt.wantBoth, seen)
			}
			if got := seen[local.Addr] && !seen[remote.Addr]; got != tt.wantLocal {
				t.Errorf("only the local endpoint used = %v, want %v (seen %v)", got, tt.wantLocal, seen)
			}
		})
	}
}

func TestLocalReady(t *testing.T) {
	ep := func(addr, node string, ready, terminating bool) proxy.Endpoint {
		return proxy.Endpoint{Addr: netip.MustParseAddrPort(addr), NodeName: node, Ready: ready, Serving: ready || terminating, Terminating: terminating}
	}
	tests := []struct {
		name string
		eps  []proxy.Endpoint
		want []string
	}{
		{"none", nil, nil},
		{"remote only", []proxy.Endpoint{ep("10.0.0.1:80", "n2", true, false)}, nil},
		{"local ready", []proxy.Endpoint{ep("10.0.0.1:80", "n1", true, false), ep("10.0.0.2:80", "n2", true, false)}, []string{"10.0.0.1"}},
		{"terminating does not count", []proxy.Endpoint{ep("10.0.0.1:80", "n1", false, true)}, nil},
		{"same IP twice counts once", []proxy.Endpoint{ep("10.0.0.1:80", "n1", true, false), ep("10.0.0.1:81", "n1", true, false)}, []string{"10.0.0.1"}},
		{"two", []proxy.Endpoint{ep("10.0.0.2:80", "n1", true, false), ep("10.0.0.1:80", "n1", true, false)}, []string{"10.0.0.2", "10.0.0.1"}},
	}
	addrs := func(ss []string) []netip.Addr {
		var out []netip.Addr
		for _, s := range ss {
			out = append(out, netip.MustParseAddr(s))
		}
		return out
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// was, the last sync's list: none, this one (returned as it is), others.
			for _, was := range [][]netip.Addr{nil, addrs(tt.want), addrs([]string{"10.0.0.9"}),
				addrs(append(slices.Clone(tt.want), "10.0.0.9")), addrs([]string{"10.0.0.1", "10.0.0.2"})} {
				var got []string
				res := localReady(tt.eps, "n1", was)
				for _, a := range res {
					got = append(got, a.String())
				}
				if !slices.Equal(got, tt.want) {
					t.Errorf("localReady(was %v) = %v, want %v", was, got, tt.want)
				}
				if len(res) > 0 && slices.Equal(res, was) && &res[0] != &was[0] {
					t.Errorf("localReady(was %v) allocated a copy of was", was)
				}
			}
		})
	}
}

// TestChooseFollowsZone: the zone a source reports through the Tracker reaches the balancer at
// the next sync, and Choose then keeps ClusterIP traffic in this node's zone; an unknown zone
// (never reported, or the label removed) uses every endpoint.
func TestChooseFollowsZone(t *testing.T) {
	p := newTestProxier(t, Options{NodeName: "node1", NodeAddrs: noNodeAddrs})
	tr := p.Tracker()
	tr.OnServiceUpdate(nil, service("web", []v1.ServicePort{tcpPort("http", 80)}, func(s *v1.Service) {
		s.Spec.TrafficDistribution = ptr.To(v1.ServiceTrafficDistributionPreferClose)
	}))
	inA, inB := netip.MustParseAddrPort("10.244.1.2:8080"), netip.MustParseAddrPort("10.244.2.2:8080")
	hinted := func(ep netip.AddrPort, node, zone string) discovery.Endpoint {
		return discovery.Endpoint{Addresses: []string{ep.Addr().String()}, NodeName: ptr.To(node),
			Conditions: discovery.EndpointConditions{Ready: ptr.To(true)},
			Hints:      &discovery.EndpointHints{ForZones: []discovery.ForZone{{Name: zone}}}}
	}
	tr.OnEndpointSliceUpdate(nil, &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: "default", Name: "web-1", Labels: map[string]string{discovery.LabelServiceName: "web"}},
		AddressType: discovery.AddressTypeIPv4,
		Ports:       []discovery.EndpointPort{{Name: ptr.To("http"), Port: ptr.To(int32(8080))}},
		Endpoints:   []discovery.Endpoint{hinted(inA, "node2", "zone-a"), hinted(inB, "node3", "zone-b")},
	})
	chosen := func() map[netip.AddrPort]bool {
		t.Helper()
		p.Sync()
		p.mu.Lock()
		l := p.ports[proxy.Name{Namespace: "default", Name: "web", Port: "http"}]
		p.mu.Unlock()
		if l == nil {
			t.Fatal("service port not set up")
		}
		seen := map[netip.AddrPort]bool{}
		for range 8 {
			tg, err := l.choose.Choose(netip.MustParseAddrPort("10.0.0.100:40000"), netip.MustParseAddrPort("10.96.0.10:80"), false)
			if err != nil {
				t.Fatal(err)
			}
			seen[tg.Endpoint] = true
		}
		return seen
	}
	if seen := chosen(); !seen[inA] || !seen[inB] {
		t.Errorf("zone unknown: chose %v, want both endpoints", seen)
	}
	tr.OnNodeTopology("zone-b")
	if seen := chosen(); seen[inA] || !seen[inB] {
		t.Errorf("zone-b: chose %v, want only %v", seen, inB)
	}
	tr.OnNodeTopology("")
	if seen := chosen(); !seen[inA] || !seen[inB] {
		t.Errorf("zone label removed: chose %v, want both endpoints", seen)
	}
}
