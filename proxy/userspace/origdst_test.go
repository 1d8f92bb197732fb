package userspace

import (
	"net/netip"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/proxyproto"
)

// TestNeedsOriginalDst checks when the chooser asks for the original destination, which costs
// the TCP proxy a getsockopt(2) per connection: only for a Local traffic policy or the PROXY
// protocol; and that without them its choices do not depend on the destination (ClusterIP,
// NodePort or unknown), with and without session affinity.
func TestNeedsOriginalDst(t *testing.T) {
	nodeIP := netip.MustParseAddr("10.0.0.11")
	clusterIP := netip.MustParseAddr("10.96.0.10")
	local := proxy.Endpoint{Addr: netip.MustParseAddrPort("10.244.1.2:8080"), NodeName: "node1", Ready: true, Serving: true}
	remote := proxy.Endpoint{Addr: netip.MustParseAddrPort("10.244.2.2:8080"), NodeName: "node2", Ready: true, Serving: true}
	newSP := func() *proxy.ServicePort {
		return &proxy.ServicePort{
			Name:     proxy.Name{Namespace: "default", Name: "web", Port: "http"},
			Protocol: v1.ProtocolTCP, Port: 80, NodePort: 30000,
			ClusterIPs: []netip.Addr{clusterIP},
		}
	}
	for _, tt := range []struct {
		name string
		set  func(*proxy.ServicePort)
		want bool
	}{
		{"cluster policies", func(*proxy.ServicePort) {}, false},
		{"externalTrafficPolicy Local", func(sp *proxy.ServicePort) { sp.ExternalPolicyLocal = true }, true},
		{"internalTrafficPolicy Local", func(sp *proxy.ServicePort) { sp.InternalPolicyLocal = true }, true},
		{"PROXY protocol", func(sp *proxy.ServicePort) { sp.ProxyProtocol = proxy.ProxyProtocolV1 }, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			sp := newSP()
			tt.set(sp)
			c := &chooser{}
			c.sp.Store(sp)
			if got := c.NeedsOriginalDst(); got != tt.want {
				t.Errorf("NeedsOriginalDst = %v, want %v", got, tt.want)
			}
		})
	}
	// Without a Local policy, traffic told its destination (a NodePort, a ClusterIP) and
	// traffic told none share one rotation, and a client's affinity: the destination changes
	// nothing.
	dsts := []netip.AddrPort{netip.AddrPortFrom(nodeIP, 30000), netip.AddrPortFrom(clusterIP, 80), {}}
	for _, affinity := range []bool{false, true} {
		p := newTestProxier(t, Options{NodeName: "node1", NodeAddrs: nodeAddrs(nodeIP),
			ClusterCIDRs: []netip.Prefix{netip.MustParsePrefix("10.244.0.0/16")}})
		p.Sync()
		sp := newSP()
		if affinity {
			sp.SessionAffinity, sp.AffinityTimeout = true, 10*time.Second
		}
		p.lb.SetServicePort(sp, []proxy.Endpoint{local, remote})
		c := &chooser{lb: p.lb, routing: p.routing}
		c.sp.Store(sp)
		if c.NeedsOriginalDst() {
			t.Fatal("NeedsOriginalDst = true")
		}
		sticky := map[netip.Addr]netip.AddrPort{}
		var prev netip.AddrPort
		for i := range 12 {
			client := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 0, 0, byte(100 + i%2)}), 40000)
			tg, err := c.Choose(client, dsts[i%len(dsts)], false)
			if err != nil {
				t.Fatal(err)
			}
			if tg.Transparent || tg.ProxyProtocol != proxyproto.None {
				t.Fatalf("target %+v: want plain", tg)
			}
			switch {
			case affinity:
				if s, ok := sticky[client.Addr()]; ok && s != tg.Endpoint {
					t.Errorf("call %d (dst %v): client %v moved from %v to %v", i, dsts[i%len(dsts)], client.Addr(), s, tg.Endpoint)
				}
				sticky[client.Addr()] = tg.Endpoint
			case i > 0 && tg.Endpoint == prev:
				t.Errorf("call %d (dst %v): %v again; want one rotation over both endpoints", i, dsts[i%len(dsts)], tg.Endpoint)
			}
			prev = tg.Endpoint
		}
	}
}
