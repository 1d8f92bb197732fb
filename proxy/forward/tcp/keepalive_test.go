//go:build linux

package tcp

import (
	"maps"
	"net/netip"
	"syscall"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/forwardtest"
)

// Both sockets of a proxied connection probe their peer: the client side with the settings it
// inherited from the listener, the endpoint side with those set at the dial.
func TestTCPKeepAlive(t *testing.T) {
	checkNoLeaks(t)
	backend := forwardtest.StartTCPEcho(t, forwardtest.Loopback("4"))
	p := startTCPProxy(t, "4", &forwardtest.Chooser{Endpoints: []netip.AddrPort{backend}}, nil)
	c := forwardtest.DialTCP(t, p.addr)
	if _, err := forwardtest.RoundTrip(c, []byte("ping")); err != nil {
		t.Fatalf("round trip: %v", err)
	}
	client, endpoint := connSockets(p.Proxy)
	if client == nil || endpoint == nil {
		t.Fatal("the proxy holds no connected connection")
	}
	want := map[string]int{"SO_KEEPALIVE": 1, "TCP_KEEPIDLE": 15, "TCP_KEEPINTVL": 15, "TCP_KEEPCNT": 9}
	if got := keepAliveOptions(t, client); !maps.Equal(got, want) {
		t.Errorf("client side: keepalive options %v, want %v", got, want)
	}
	if got := keepAliveOptions(t, endpoint); got["SO_KEEPALIVE"] != 1 || got["TCP_KEEPIDLE"] != 15 {
		t.Errorf("endpoint side: keepalive options %v, want SO_KEEPALIVE 1 and TCP_KEEPIDLE 15", got)
	}
}

func keepAliveOptions(t *testing.T, c syscall.Conn) map[string]int {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	var gerr error
	err = rc.Control(func(fd uintptr) {
		for name, o := range map[string][2]int{
			"SO_KEEPALIVE":  {syscall.SOL_SOCKET, syscall.SO_KEEPALIVE},
			"TCP_KEEPIDLE":  {syscall.IPPROTO_TCP, syscall.TCP_KEEPIDLE},
			"TCP_KEEPINTVL": {syscall.IPPROTO_TCP, syscall.TCP_KEEPINTVL},
			"TCP_KEEPCNT":   {syscall.IPPROTO_TCP, syscall.TCP_KEEPCNT},
		} {
			v, err := syscall.GetsockoptInt(int(fd), o[0], o[1])
			if err != nil {
				gerr = err
				return
			}
			got[name] = v
		}
	})
	if err != nil || gerr != nil {
		t.Fatalf("getsockopt: %v %v", err, gerr)
	}
	return got
}
