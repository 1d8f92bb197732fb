//go:build linux

package ctnetlink

import (
	"errors"
	"net/netip"
	"syscall"
	"testing"
)

// BenchmarkConntrackLookup measures the ctnetlink round trip made once per new UDP session (here
// for a flow conntrack does not know, which costs the same lookup).
func BenchmarkConntrackLookup(b *testing.B) {
	ct, err := Open()
	if err != nil {
		b.Fatalf("conntrack: %v", err)
	}
	defer ct.Close()
	client, local := netip.MustParseAddrPort("127.0.0.1:1"), netip.MustParseAddrPort("127.0.0.1:2")
	b.ResetTimer()
	for range b.N {
		if _, err := ct.OriginalDst(17, client, local); err != nil && !errors.Is(err, syscall.ENOENT) {
			b.Fatal(err)
		}
	}
}
