package app

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"testing"

	"github.com/rs/zerolog"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/internal/testenv"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/healthcheck"
)

// TestServersInheritTheirSockets: a successor's /healthz takes the socket the predecessor
// handed over, for every form of --healthz-bind-address. The predecessor still holds its own
// copy (it closes it only after the exchange), so a server that bound anew instead would fail
// with EADDRINUSE. For 0.0.0.0, Go listens on [::] (both families), and the socket handed over
// names [::].
func TestServersInheritTheirSockets(t *testing.T) {
	for _, host := range []string{"0.0.0.0", "::", "127.0.0.1"} {
		t.Run(host, func(t *testing.T) {
			old, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
			if err != nil {
				testenv.Need(t, fmt.Sprintf("a %s listener (IPv6 for ::): %v", host, err))
			}
			defer old.Close()
			addr := net.JoinHostPort(host, strconv.Itoa(old.Addr().(*net.TCPAddr).Port))
			f, err := old.(*net.TCPListener).File() // what the hand-over sends
			if err != nil {
				t.Fatal(err)
			}
			opts := NewOptions()
			opts.HealthzBindAddress, opts.MetricsBindAddress = addr, ""
			s, err := newServers(opts, &Validated{}, healthcheck.ProxyHealthOptions{}, zerolog.Nop())
			if err != nil {
				t.Fatal(err)
			}
			if err := s.listen(map[string]*os.File{"healthz": f}); err != nil {
				t.Fatalf("listen on %s with the predecessor's socket: %v", addr, err)
			}
			defer s.closeListeners()
			// The same socket: a connection the predecessor's copy queues is the successor's.
			dial := "127.0.0.1"
			if host == "::" {
				dial = "::1"
			}
			c, err := net.Dial("tcp", net.JoinHostPort(dial, strconv.Itoa(old.Addr().(*net.TCPAddr).Port)))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			a, err := s.healthzLn.Accept()
			if err != nil {
				t.Fatal(err)
			}
			a.Close()
		})
	}
}
