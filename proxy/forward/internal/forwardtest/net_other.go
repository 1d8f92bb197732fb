//go:build !linux

package forwardtest

import (
	"net/netip"
	"testing"
)

// ClosedTCPPort returns a loopback address where nothing listens: a port listened on and closed
// again (net_linux.go keeps it bound instead, which needs raw sockets).
func ClosedTCPPort(t testing.TB, addr netip.Addr) netip.AddrPort {
	t.Helper()
	ln := ListenTCP(t, addr)
	ap := ListenerAddr(ln)
	ln.Close()
	return ap
}
