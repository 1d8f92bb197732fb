//go:build linux

package harness

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/test/netns"
)

// StartEcho runs `kup-echo serve --name name --listen 0.0.0.0:port` (TCP and UDP) inside ns and
// waits until it answers on 127.0.0.1:port there. Go listens on a wildcard address with one
// dual-stack socket, so it serves IPv6 ([::]:port) as well. Every answer carries name and the
// peer address the server saw (see [Answer]). The process is killed in the test's cleanup.
func StartEcho(t testing.TB, ns *netns.NS, name string, port int) *netns.Process {
	t.Helper()
	p := ns.Start(t, EchoBinary(t), "serve", "--name", name, "--listen", fmt.Sprintf("0.0.0.0:%d", port))
	addr := netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port)).String()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := poll(ctx, 50*time.Millisecond, func() error {
		select {
		case <-p.Done():
			return stopPolling{fmt.Errorf("exited (%v): %s", p.Err(), p.Tail(10))}
		default:
		}
		_, err := Ask(ctx, ns, "tcp", addr)
		return err
	})
	if err != nil {
		t.Fatalf("harness: echo %s in %s not serving on port %d: %v", name, ns, port, err)
	}
	return p
}
