package proxy

import (
	"net/netip"
	"testing"
)

func TestNodeAddrsOnSameLink(t *testing.T) {
	n := NodeAddrsFromPrefixes([]netip.Prefix{
		netip.MustParsePrefix("10.244.1.1/24"), // a bridge of pods
		netip.MustParsePrefix("10.0.0.11/24"),  // the node's LAN
		netip.MustParsePrefix("127.0.0.1/8"),   // loopback: never a link
		netip.MustParsePrefix("192.0.2.9/32"),  // a host route: never a link
		netip.MustParsePrefix("fd00:244:1::1/64"),
	})
	for _, tc := range []struct {
		x, y string
		want bool
	}{
		{"10.244.1.5", "10.244.1.7", true},
		{"10.244.1.5", "10.244.2.7", false},
		{"203.0.113.9", "10.244.1.7", false},
		{"10.0.0.8", "10.0.0.20", true},
		{"127.0.0.2", "127.0.0.3", false},
		{"192.0.2.9", "192.0.2.9", false},
		{"fd00:244:1::5", "fd00:244:1::7", true},
		{"::ffff:10.244.1.5", "10.244.1.7", true},
	} {
		if got := n.OnSameLink(netip.MustParseAddr(tc.x), netip.MustParseAddr(tc.y)); got != tc.want {
			t.Errorf("OnSameLink(%s, %s) = %v, want %v", tc.x, tc.y, got, tc.want)
		}
	}
	if !n.Contains(netip.MustParseAddr("10.244.1.1")) || n.Contains(netip.MustParseAddr("10.244.1.5")) {
		t.Errorf("Contains: the node's own addresses only")
	}
}

// TestListNodeAddrs: the machine's interfaces give at least loopback, and no link for it.
func TestListNodeAddrs(t *testing.T) {
	n, err := ListNodeAddrs()
	if err != nil {
		t.Fatal(err)
	}
	if !n.Contains(netip.MustParseAddr("127.0.0.1")) {
		t.Errorf("127.0.0.1 missing from %v", n.List())
	}
	if n.OnSameLink(netip.MustParseAddr("127.0.0.2"), netip.MustParseAddr("127.0.0.3")) {
		t.Errorf("loopback counted as a link")
	}
}
