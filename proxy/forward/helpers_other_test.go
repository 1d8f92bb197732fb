//go:build !linux

package forward

import (
	"net/netip"
	"testing"
)

// closedTCPPort returns a loopback address where nothing listens: a port listened on and closed
// again (helpers_linux_test.go keeps it bound instead, which needs raw sockets).
func closedTCPPort(t testing.TB, addr netip.Addr) netip.AddrPort {
	t.Helper()
	ln := listenTCP(t, addr)
	ap := listenerAddr(ln)
	ln.Close()
	return ap
}
