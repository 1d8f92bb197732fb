//go:build linux

package netns_test

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/echo"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// TestDualStackNetwork checks the IPv6 half of the addressing plan and that pods, nodes and
// outside hosts reach pods on other nodes over IPv6, while IPv4 keeps working.
func TestDualStackNetwork(t *testing.T) {
	n := netns.NewDualStackNetwork(t, "ds")
	node1 := n.AddNode(t, "n1")
	node2 := n.AddNode(t, "n2")
	pod1 := n.AddPod(t, node1, "p1")
	pod2 := n.AddPod(t, node2, "p2")
	client := n.AddClient(t, "client")

	addrs := []struct {
		name      string
		got, want netip.Addr
	}{
		{"node1", node1.IPv6, netip.MustParseAddr("fd00:10::2")},
		{"node2", node2.IPv6, netip.MustParseAddr("fd00:10::3")},
		{"pod1", pod1.IPv6, netip.MustParseAddr("fd00:244:0:1::2")},
		{"pod2", pod2.IPv6, netip.MustParseAddr("fd00:244:0:2::2")},
		{"client", client.IPv6, netip.MustParseAddr("fd00:10::4")},
	}
	for _, a := range addrs {
		if a.got != a.want {
			t.Errorf("%s IPv6 = %s, want %s", a.name, a.got, a.want)
		}
	}
	if !n.DualStack() || !n.ClusterCIDR6().Contains(node2.PodCIDRv6.Addr()) || !node2.PodCIDRv6.Contains(pod2.IPv6) {
		t.Errorf("plan: dual-stack %v, cluster CIDR %s, node2 pod CIDR %s, pod2 %s", n.DualStack(), n.ClusterCIDR6(), node2.PodCIDRv6, pod2.IPv6)
	}

	const port = 8080
	ln, err := pod2.Listen("tcp", netip.AddrPortFrom(netip.IPv6Unspecified(), port).String())
	if err != nil {
		t.Fatal(err)
	}
	srv := echo.ServeTCP(ln, "p2")
	t.Cleanup(func() { _ = srv.Close() })
	for _, from := range []*netns.NS{pod1.NS, node1.NS, client.NS} {
		for _, dst := range []netip.Addr{pod2.IPv6, pod2.IP} {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			banner, err := echo.Check(ctx, from.DialContext, "tcp", netip.AddrPortFrom(dst, port).String(), "hello")
			cancel()
			if err != nil || banner != "p2" {
				t.Errorf("from %s to %s: banner %q, %v", from, dst, banner, err)
			}
		}
	}

	// A single-stack network is unchanged: no IPv6 addresses.
	single := netns.NewNetwork(t, "ss")
	if h := single.AddHost(t, "h"); h.IPv6.IsValid() || single.DualStack() || single.Subnet6().IsValid() {
		t.Errorf("single-stack network: host IPv6 %s, dual-stack %v, subnet6 %s", h.IPv6, single.DualStack(), single.Subnet6())
	}
}
