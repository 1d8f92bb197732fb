package healthcheck

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }
func (c *fakeClock) Step(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func get(t *testing.T, url string) (int, http.Header, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: reading body: %v", url, err)
	}
	return resp.StatusCode, resp.Header, string(b)
}

func TestProxyHealth(t *testing.T) {
	const timeout = time.Minute
	tests := []struct {
		name  string
		steps func(h *ProxyHealth, c *fakeClock)
		want  int
	}{
		{"starting, nothing queued", func(*ProxyHealth, *fakeClock) {}, 200},
		{"queued change younger than the timeout", func(h *ProxyHealth, c *fakeClock) {
			h.Queued(c.Now())
			c.Step(timeout - time.Second)
		}, 200},
		{"queued change older than the timeout", func(h *ProxyHealth, c *fakeClock) {
			h.Queued(c.Now())
			c.Step(timeout)
		}, 503},
		{"only the oldest queued change counts", func(h *ProxyHealth, c *fakeClock) {
			h.Queued(c.Now())
			c.Step(timeout / 2)
			h.Queued(c.Now())
			c.Step(timeout / 2)
		}, 503},
		{"sync applied the change", func(h *ProxyHealth, c *fakeClock) {
			h.Queued(c.Now())
			c.Step(time.Second)
			h.Synced(proxy.SyncResult{Start: c.Now(), Took: time.Millisecond})
			c.Step(2 * timeout)
		}, 200},
		{"failed sync leaves the change pending", func(h *ProxyHealth, c *fakeClock) {
			h.Queued(c.Now())
			h.Synced(proxy.SyncResult{Start: c.Now(), Took: time.Millisecond, Err: errors.New("restore failed")})
			c.Step(timeout)
		}, 503},
	}
	bodyRE := map[string]*regexp.Regexp{
		"/healthz": regexp.MustCompile(`^\{"lastUpdated": "[^"]+","currentTime": "[^"]+", "nodeEligible": true\}$`),
		"/livez":   regexp.MustCompile(`^\{"lastUpdated": "[^"]+","currentTime": "[^"]+"\}$`),
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := &fakeClock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
			h := NewProxyHealth(ProxyHealthOptions{Timeout: timeout, Now: c.Now})
			tt.steps(h, c)
			srv := httptest.NewServer(h.Handler())
			defer srv.Close()
			for _, path := range []string{"/healthz", "/livez"} {
				code, hdr, body := get(t, srv.URL+path)
				if code != tt.want {
					t.Errorf("%s: status %d, want %d (body %s)", path, code, tt.want, body)
				}
				if !bodyRE[path].MatchString(body) {
					t.Errorf("%s: body %q not in kube-proxy's format", path, body)
				}
				if hdr.Get("Content-Type") != "application/json" || hdr.Get("X-Content-Type-Options") != "nosniff" {
					t.Errorf("%s: headers %v", path, hdr)
				}
				if want := fmt.Sprintf("%q", c.Now()); !regexp.MustCompile(`"currentTime": ` + regexp.QuoteMeta(want)).MatchString(body) {
					t.Errorf("%s: body %s lacks currentTime %s", path, body, want)
				}
			}
		})
	}
}

// listenRecorder listens on loopback port 0 whatever port is asked for, and records where.
type listenRecorder struct {
	mu    sync.Mutex
	addrs []string
	fail  error
}

func (l *listenRecorder) listen(network, _ string) (net.Listener, error) {
	if l.fail != nil {
		return nil, l.fail
	}
	ln, err := net.Listen(network, "127.0.0.1:0")
	if err == nil {
		l.mu.Lock()
		l.addrs = append(l.addrs, ln.Addr().String())
		l.mu.Unlock()
	}
	return ln, err
}

func (l *listenRecorder) last() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.addrs[len(l.addrs)-1]
}

type healthFlag struct{ ok bool }

func (h *healthFlag) IsHealthy() bool { return h.ok }

func TestServices(t *testing.T) {
	name := types.NamespacedName{Namespace: "2048-game", Name: "service-2048-local"}
	tests := []struct {
		name      string
		endpoints int
		unhealthy bool
		wantCode  int
		wantBody  string
	}{
		{"two local endpoints", 2, false, 200, `{"service":{"namespace":"2048-game","name":"service-2048-local"},"localEndpoints":2}`},
		{"no local endpoint", 0, false, 503, `{"service":{"namespace":"2048-game","name":"service-2048-local"},"localEndpoints":0}`},
		{"proxy unhealthy", 1, true, 503, `{"service":{"namespace":"2048-game","name":"service-2048-local"},"localEndpoints":1}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := &listenRecorder{}
			s := NewServices(ServicesOptions{Listen: rec.listen, Addrs: []netip.Addr{netip.MustParseAddr("127.0.0.1")}, Health: &healthFlag{ok: !tt.unhealthy}})
			defer s.Close()
			s.Sync(map[types.NamespacedName]Service{name: {Port: 30965, LocalEndpoints: tt.endpoints}})
			code, hdr, body := get(t, "http://"+rec.last()+"/anything")
			if code != tt.wantCode || body != tt.wantBody {
				t.Errorf("got %d %s, want %d %s", code, body, tt.wantCode, tt.wantBody)
			}
			if hdr.Get("Content-Type") != "application/json" || hdr.Get("X-Content-Type-Options") != "nosniff" {
				t.Errorf("headers %v", hdr)
			}
		})
	}
}

func TestServicesLifecycle(t *testing.T) {
	a := types.NamespacedName{Namespace: "ns", Name: "a"}
	rec := &listenRecorder{}
	s := NewServices(ServicesOptions{Listen: rec.listen, Addrs: []netip.Addr{netip.MustParseAddr("127.0.0.1")}})
	defer s.Close()

	s.Sync(map[types.NamespacedName]Service{a: {Port: 31000, LocalEndpoints: 1}})
	first := rec.last()
	if code, _, _ := get(t, "http://"+first); code != 200 {
		t.Fatalf("status %d, want 200", code)
	}
	// Same port: the server stays, only the count changes.
	s.Sync(map[types.NamespacedName]Service{a: {Port: 31000, LocalEndpoints: 0}})
	if rec.last() != first {
		t.Fatalf("server reopened for an unchanged port")
	}
	if code, _, _ := get(t, "http://"+first); code != 503 {
		t.Fatalf("status %d after losing the endpoint, want 503", code)
	}
	// New port: old server closed, new one opened.
	s.Sync(map[types.NamespacedName]Service{a: {Port: 31001, LocalEndpoints: 1}})
	if rec.last() == first {
		t.Fatalf("no new server for the new port")
	}
	if _, err := net.DialTimeout("tcp", first, time.Second); err == nil {
		t.Errorf("old server still listening on %s", first)
	}
	if got := s.Ports(); got[a] != 31001 {
		t.Errorf("ports %v, want 31001", got)
	}
	// Service gone: closed.
	s.Sync(nil)
	if len(s.Ports()) != 0 {
		t.Errorf("servers left: %v", s.Ports())
	}

	t.Run("listen failure is retried at the next sync", func(t *testing.T) {
		rec.fail = errors.New("address in use")
		s.Sync(map[types.NamespacedName]Service{a: {Port: 31002, LocalEndpoints: 1}})
		if len(s.Ports()) != 0 {
			t.Fatalf("a failed server counts as running")
		}
		rec.fail = nil
		s.Sync(map[types.NamespacedName]Service{a: {Port: 31002, LocalEndpoints: 1}})
		if s.Ports()[a] != 31002 {
			t.Fatalf("not retried: %v", s.Ports())
		}
	})
}

func TestWanted(t *testing.T) {
	ip := netip.MustParseAddr
	port := func(svc, portName string, local bool, hc int, ready ...string) proxy.PortState {
		st := proxy.PortState{ServicePort: &proxy.ServicePort{
			Name: proxy.Name{Namespace: "ns", Name: svc, Port: portName}, Protocol: v1.ProtocolTCP,
			ExternalPolicyLocal: local, HealthCheckNodePort: hc,
		}}
		for _, r := range ready {
			st.LocalReady = append(st.LocalReady, ip(r))
		}
		return st
	}
	tests := []struct {
		name  string
		ports []proxy.PortState
		want  map[types.NamespacedName]Service
	}{
		{"cluster policy: no server", []proxy.PortState{port("a", "", false, 0, "10.0.0.1")}, map[types.NamespacedName]Service{}},
		{"local without health port: no server", []proxy.PortState{port("a", "", true, 0, "10.0.0.1")}, map[types.NamespacedName]Service{}},
		{"local with health port", []proxy.PortState{port("a", "", true, 30000, "10.0.0.1", "10.0.0.2")},
			map[types.NamespacedName]Service{{Namespace: "ns", Name: "a"}: {Port: 30000, LocalEndpoints: 2}}},
		{"no local endpoint", []proxy.PortState{port("a", "", true, 30000)},
			map[types.NamespacedName]Service{{Namespace: "ns", Name: "a"}: {Port: 30000, LocalEndpoints: 0}}},
		{"ports of one service: distinct IPs", []proxy.PortState{
			port("a", "http", true, 30000, "10.0.0.1"),
			port("a", "https", true, 30000, "10.0.0.1", "10.0.0.3"),
		}, map[types.NamespacedName]Service{{Namespace: "ns", Name: "a"}: {Port: 30000, LocalEndpoints: 2}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Wanted(tt.ports)
			if fmt.Sprint(got) != fmt.Sprint(tt.want) {
				t.Errorf("Wanted = %v, want %v", got, tt.want)
			}
		})
	}
}

// TestProxyHealthReportsSourceError: while the API server is unreachable the proxy keeps serving
// (200) and says why in the body; once it is back the field is gone.
func TestProxyHealthReportsSourceError(t *testing.T) {
	src := &fakeSource{eligible: true}
	h := NewProxyHealth(ProxyHealthOptions{Source: src})
	srv := httptest.NewServer(h.Handler())
	defer srv.Close()

	for _, path := range []string{"/healthz", "/livez"} {
		if _, _, body := get(t, srv.URL+path); regexp.MustCompile(`sourceError`).MatchString(body) {
			t.Errorf("%s while connected: %s", path, body)
		}
	}
	srcErr := errors.New(`services: API server unreachable since 2026-11-22T04:00:00Z: dial tcp 10.0.0.1:6443: connect: "refused"`)
	src.set(srcErr, true)
	for _, path := range []string{"/healthz", "/livez"} {
		code, _, body := get(t, srv.URL+path)
		if code != http.StatusOK {
			t.Errorf("%s during an API server outage: status %d, want 200 (serving the last state)", path, code)
		}
		var doc map[string]any
		if err := json.Unmarshal([]byte(body), &doc); err != nil {
			t.Fatalf("%s body is not JSON: %v: %s", path, err, body)
		}
		if doc["sourceError"] != srcErr.Error() {
			t.Errorf("%s sourceError = %v, want %q", path, doc["sourceError"], srcErr)
		}
	}
}

// A node that is not eligible (being deleted, or tainted by the autoscaler) fails /healthz with
// "nodeEligible": false, so load balancers drain it; /livez stays 200.
func TestProxyHealthNodeEligible(t *testing.T) {
	src := &fakeSource{}
	h := NewProxyHealth(ProxyHealthOptions{Source: src})
	srv := httptest.NewServer(h.Handler())
	defer srv.Close()
	for _, tc := range []struct {
		eligible bool
		healthz  int
		body     string
	}{{false, 503, `"nodeEligible": false}`}, {true, 200, `"nodeEligible": true}`}} {
		src.set(nil, tc.eligible)
		code, _, body := get(t, srv.URL+"/healthz")
		if code != tc.healthz || !strings.HasSuffix(body, tc.body) {
			t.Errorf("eligible=%v: /healthz %d %s, want %d and a body ending in %s", tc.eligible, code, body, tc.healthz, tc.body)
		}
		if code, _, body := get(t, srv.URL+"/livez"); code != 200 || strings.Contains(body, "nodeEligible") {
			t.Errorf("eligible=%v: /livez %d %s, want 200 without nodeEligible", tc.eligible, code, body)
		}
	}
}

// fakeSource is a SourceStatus whose answers the test sets.
type fakeSource struct {
	mu       sync.Mutex
	err      error
	eligible bool
}

func (f *fakeSource) set(err error, eligible bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.err, f.eligible = err, eligible
}

func (f *fakeSource) Err() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.err
}

func (f *fakeSource) NodeEligible() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.eligible
}
