//go:build linux

package netns_test

import (
	"context"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/internal/testenv"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/echo"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// serveEcho starts an echo server on port in ns, answering with banner.
func serveEcho(t *testing.T, ns *netns.NS, port int, banner string) {
	t.Helper()
	ln, err := ns.Listen("tcp4", netip.AddrPortFrom(netip.IPv4Unspecified(), uint16(port)).String())
	if err != nil {
		t.Fatal(err)
	}
	srv := echo.ServeTCP(ln, banner)
	t.Cleanup(func() { _ = srv.Close() })
}

func TestTwoNodeTopology(t *testing.T) {
	testenv.Privileged(t) // its checks after the subtests need the namespaces they made
	var names []string
	t.Run("traffic", func(t *testing.T) {
		n := netns.NewNetwork(t, "topo")
		node1 := n.AddNode(t, "n1")
		node2 := n.AddNode(t, "n2")
		pod1 := n.AddPod(t, node1, "p1")
		pod2 := n.AddPod(t, node2, "p2")
		pod3 := n.AddPod(t, node2, "p3")
		client := n.AddClient(t, "client")
		pod4 := n.AddBridgedPod(t, node1, "p4") // beside pod1, through the node's bridge
		for _, ns := range []*netns.NS{n.NS, node1.NS, node2.NS, pod1.NS, pod2.NS, pod3.NS, client.NS, pod4.NS} {
			names = append(names, ns.Name())
		}

		// The addressing plan the package documents.
		addrs := []struct {
			name      string
			got, want netip.Addr
		}{
			{"node1", node1.IP, netip.MustParseAddr("10.0.0.2")},
			{"node2", node2.IP, netip.MustParseAddr("10.0.0.3")},
			{"pod1", pod1.IP, netip.MustParseAddr("10.244.1.2")},
			{"pod2", pod2.IP, netip.MustParseAddr("10.244.2.2")},
			{"pod3", pod3.IP, netip.MustParseAddr("10.244.2.3")},
			{"client", client.IP, netip.MustParseAddr("10.0.0.4")},
			{"bridged pod4", pod4.IP, netip.MustParseAddr("10.244.1.3")},
		}
		for _, a := range addrs {
			if a.got != a.want {
				t.Errorf("%s IP = %s, want %s", a.name, a.got, a.want)
			}
		}
		if !node1.PodCIDR.Contains(pod1.IP) || !node2.PodCIDR.Contains(pod2.IP) {
			t.Errorf("pod IPs %s, %s not in their node's pod CIDR %s, %s", pod1.IP, pod2.IP, node1.PodCIDR, node2.PodCIDR)
		}

		const port = 8080
		for _, s := range []struct {
			ns     *netns.NS
			banner string
		}{{node1.NS, "node1"}, {pod1.NS, "pod1"}, {pod2.NS, "pod2"}, {pod3.NS, "pod3"}, {pod4.NS, "pod4"}} {
			serveEcho(t, s.ns, port, s.banner)
		}

		tests := []struct {
			name   string
			from   *netns.NS
			to     netip.Addr
			banner string
		}{
			{name: "pod to pod on another node", from: pod1.NS, to: pod2.IP, banner: "pod2"},
			{name: "pod to pod back", from: pod2.NS, to: pod1.IP, banner: "pod1"},
			{name: "pod to pod on the same node", from: pod2.NS, to: pod3.IP, banner: "pod3"},
			{name: "node to its pod", from: node1.NS, to: pod1.IP, banner: "pod1"},
			{name: "node to another node's pod", from: node1.NS, to: pod3.IP, banner: "pod3"},
			{name: "pod to another node", from: pod2.NS, to: node1.IP, banner: "node1"},
			{name: "client to node", from: client.NS, to: node1.IP, banner: "node1"},
			{name: "client to pod", from: client.NS, to: pod2.IP, banner: "pod2"},
			{name: "bridged pod to pod on another node", from: pod4.NS, to: pod2.IP, banner: "pod2"},
			{name: "bridged pod to pod on the same node", from: pod4.NS, to: pod1.IP, banner: "pod1"},
			{name: "node to its bridged pod", from: node1.NS, to: pod4.IP, banner: "pod4"},
			{name: "client to bridged pod", from: client.NS, to: pod4.IP, banner: "pod4"},
		}
		for _, tc := range tests {
			t.Run(tc.name, func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				banner, err := echo.Check(ctx, tc.from.DialContext, "tcp", netip.AddrPortFrom(tc.to, port).String(), "ping "+tc.name)
				if err != nil {
					t.Fatal(err)
				}
				if banner != tc.banner {
					t.Errorf("answered by %q, want %q", banner, tc.banner)
				}
			})
		}

		t.Run("no NAT between pods", func(t *testing.T) {
			ln, err := pod2.Listen("tcp4", ":9000")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			accepted := make(chan net.Addr, 1)
			go func() {
				c, err := ln.Accept()
				if err != nil {
					accepted <- nil
					return
				}
				accepted <- c.RemoteAddr()
				_ = c.Close()
			}()
			c, err := pod1.DialContext(ctx, "tcp", netip.AddrPortFrom(pod2.IP, 9000).String())
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			remote := <-accepted
			tcp, ok := remote.(*net.TCPAddr)
			if !ok {
				t.Fatalf("accept failed (remote %v)", remote)
			}
			if got := tcp.AddrPort().Addr().Unmap(); got != pod1.IP {
				t.Errorf("pod2 saw the connection from %s, want pod1's %s", got, pod1.IP)
			}
		})

		t.Run("unknown pod address fails fast", func(t *testing.T) {
			out, err := node2.Exec(context.Background(), "ip", "route", "get", "10.244.2.99")
			if err == nil {
				t.Errorf("route to an unused pod address exists: %s", out)
			}
		})
	})
	if len(names) == 0 {
		t.Fatal("subtest created no namespaces")
	}
	for _, name := range names {
		if netnsExists(t, name) {
			t.Errorf("namespace %s left after cleanup", name)
		}
	}
}
