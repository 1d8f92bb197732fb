package healthcheck

import (
	"fmt"
	"net/netip"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/httpserve"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/httpserve/httpservetest"
)

// startServices runs the health check servers of services (all with one local endpoint) on
// loopback, and returns their addresses by service.
func startServices(t *testing.T, limits httpserve.Limits, services ...string) (*Services, map[string]string) {
	t.Helper()
	rec := &listenRecorder{}
	s := NewServices(ServicesOptions{Listen: rec.listen, Addrs: []netip.Addr{netip.MustParseAddr("127.0.0.1")}, Limits: limits})
	t.Cleanup(s.Close)
	addrs := map[string]string{}
	want := map[types.NamespacedName]Service{}
	for i, name := range services {
		want[types.NamespacedName{Namespace: "ns", Name: name}] = Service{Port: 30000 + i, LocalEndpoints: 1}
		s.Sync(want)
		addrs[name] = rec.last()
	}
	return s, addrs
}

// A flood of idle connections to one healthCheckNodePort (some never sent a request, some kept
// open after one) does not stop it, nor another service's, from answering, and the servers hold
// no more connections than their shared cap.
func TestServicesFlood(t *testing.T) {
	const max = 32
	_, addrs := startServices(t, httpserve.Limits{MaxConns: max}, "a", "b")
	httpservetest.Flood(t, addrs["a"], 2000)
	for _, name := range []string{"a", "b"} {
		if code := httpservetest.Get(t, "http://"+addrs[name]+"/"); code != 200 {
			t.Errorf("service %s: status %d during the flood, want 200", name, code)
		}
	}
	held := func() int {
		return httpservetest.ServerConns(t, httpservetest.Port(t, addrs["a"])) + httpservetest.ServerConns(t, httpservetest.Port(t, addrs["b"]))
	}
	httpservetest.Eventually(t, func() bool { return held() <= max },
		func() string { return fmt.Sprintf("the servers hold %d connections, cap %d", held(), max) })
}

// A connection that sends half a request header and stalls, or keeps the connection open after
// its request, is closed by the server.
func TestServicesTimeouts(t *testing.T) {
	_, addrs := startServices(t, httpserve.Limits{ReadHeaderTimeout: 100 * time.Millisecond, IdleTimeout: 100 * time.Millisecond}, "a")
	httpservetest.ClosedByServer(t, addrs["a"], "GET / HTTP/1.1\r\nHost: te")
	httpservetest.ClosedByServer(t, addrs["a"], "")
	httpservetest.ClosedByServer(t, addrs["a"], "GET / HTTP/1.1\r\nHost: test\r\n\r\n")
}

// Close closes every connection and leaves no goroutine behind; so does closing the server of
// a service that is gone.
func TestServicesCloseLeavesNoGoroutine(t *testing.T) {
	check := httpservetest.CheckGoroutines(t)
	s, addrs := startServices(t, httpserve.Limits{}, "a", "b")
	for _, addr := range addrs {
		httpservetest.Flood(t, addr, 100)
		if code := httpservetest.Get(t, "http://"+addr+"/"); code != 200 {
			t.Fatalf("status %d", code)
		}
	}
	s.Sync(map[types.NamespacedName]Service{{Namespace: "ns", Name: "b"}: {Port: 30001, LocalEndpoints: 1}})
	if n := httpservetest.ServerConns(t, httpservetest.Port(t, addrs["a"])); n != 0 {
		t.Errorf("the server of a deleted service holds %d connections", n)
	}
	s.Close()
	for name, addr := range addrs {
		if n := httpservetest.ServerConns(t, httpservetest.Port(t, addr)); n != 0 {
			t.Errorf("service %s: %d connections open after Close", name, n)
		}
	}
	check()
}
