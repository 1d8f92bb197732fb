package metrics

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/metrics/metricstest"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/serviceport"
)

// scrape fetches /metrics over real HTTP and parses the text exposition.
func scrape(t *testing.T, m *Metrics) metricstest.Families {
	t.Helper()
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	req, err := http.NewRequest(http.MethodGet, srv.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Accept", "text/plain")
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatalf("scrape: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape: status %d", resp.StatusCode)
	}
	fams, err := metricstest.Parse(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return fams
}

var (
	webName = serviceport.Name{Namespace: "ns", Name: "web", Port: "http"}
	dnsName = serviceport.Name{Namespace: "kube-system", Name: "dns", Port: "dns"}
	webLbl  = map[string]string{"namespace": "ns", "service": "web", "port": "http", "protocol": "TCP"}
	dnsLbl  = map[string]string{"namespace": "kube-system", "service": "dns", "port": "dns", "protocol": "UDP"}
)

func TestTrafficMetrics(t *testing.T) {
	m := New(Options{NoRuntimeCollectors: true})
	ep := netip.MustParseAddrPort("10.244.1.5:8080")
	tcp := m.ForPort(webName, v1.ProtocolTCP)
	udp := m.ForPort(dnsName, v1.ProtocolUDP)
	// Three connections: one still open, one closed after copying, one that failed to dial.
	for range 3 {
		tcp.ConnAccepted()
	}
	tcp.BytesCopied(100, 2000)
	tcp.ConnClosed()
	tcp.DialFailed(ep)
	tcp.DialFailed(ep)
	tcp.ConnFailed()
	udp.UDPSessionOpened()
	udp.UDPSessionOpened()
	udp.UDPSessionClosed()
	udp.BytesCopied(40, 80)
	udp.DatagramDropped()

	fams := scrape(t, m)
	epLbl := map[string]string{"namespace": "ns", "service": "web", "port": "http", "protocol": "TCP", "endpoint": "10.244.1.5:8080"}
	tests := []struct {
		name   string
		metric string
		labels map[string]string
		want   float64
	}{
		{"accepted", ConnectionsAcceptedTotal, webLbl, 3},
		{"active", ConnectionsActive, webLbl, 1},
		{"failed", ConnectionsFailedTotal, webLbl, 1},
		{"bytes to endpoints", BytesToEndpointsTotal, webLbl, 100},
		{"bytes from endpoints", BytesFromEndpointsTotal, webLbl, 2000},
		{"dial failures per endpoint", EndpointDialFailuresTotal, epLbl, 2},
		{"udp sessions opened", UDPSessionsOpenedTotal, dnsLbl, 2},
		{"udp sessions active", UDPSessionsActive, dnsLbl, 1},
		{"udp bytes to endpoints", BytesToEndpointsTotal, dnsLbl, 40},
		{"udp datagrams dropped", UDPDatagramsDroppedTotal, dnsLbl, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := fams.Value(tt.metric, tt.labels)
			if !ok {
				t.Fatalf("%s%v: no such series", tt.metric, tt.labels)
			}
			if got != tt.want {
				t.Errorf("%s%v = %v, want %v", tt.metric, tt.labels, got, tt.want)
			}
		})
	}

	t.Run("forget removes only that port's series", func(t *testing.T) {
		m.Forget(webName, v1.ProtocolTCP)
		fams := scrape(t, m)
		for _, name := range []string{ConnectionsAcceptedTotal, ConnectionsActive, EndpointDialFailuresTotal, BytesToEndpointsTotal} {
			if _, ok := fams.Value(name, webLbl); ok {
				t.Errorf("%s still has a series for the forgotten port", name)
			}
		}
		if _, ok := fams.Value(UDPSessionsOpenedTotal, dnsLbl); !ok {
			t.Errorf("forgetting web removed dns's series")
		}
	})
}

func TestSyncMetrics(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	m := New(Options{Now: func() time.Time { return now }})
	var obs proxy.SyncObserver = m
	obs.ChangeQueued(now.Add(-3 * time.Second))
	m.ChangesApplied(2, 5)
	sp := &serviceport.ServicePort{Name: webName, Protocol: v1.ProtocolTCP}
	obs.PortsSynced([]proxy.PortState{{ServicePort: sp, LocalEndpoints: 2}})
	m.SyncModeDone(true, 500*time.Millisecond)
	obs.SyncDone(now.Add(-time.Second), 500*time.Millisecond, now.Add(-3*time.Second), nil)
	m.SyncModeDone(false, 20*time.Millisecond)
	// A failed sync counts its duration but does not move the last-success timestamp.
	obs.SyncDone(now, 20*time.Millisecond, now, errors.New("restore failed"))

	fams := scrape(t, m)
	tests := []struct {
		name   string
		metric string
		want   float64
	}{
		{"sync durations observed", SyncDuration, 2},
		{"full syncs observed", SyncFullDuration, 1},
		{"partial syncs observed", SyncPartialDuration, 1},
		{"last successful sync", SyncLastTimestamp, float64(now.Add(-500*time.Millisecond).UnixNano()) / 1e9},
		{"last queued", SyncLastQueuedTimestamp, float64(now.Add(-3*time.Second).UnixNano()) / 1e9},
		{"service changes", ServiceChangesTotal, 2},
		{"endpoint changes", EndpointChangesTotal, 5},
		{"network programming observations", NetworkProgrammingDuration, 1},
		{"sync failures", SyncFailuresTotal, 1},
		{"service ports", ServicePortsTotal, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := fams.Value(tt.metric, nil)
			if !ok {
				t.Fatalf("%s: missing", tt.metric)
			}
			if got != tt.want {
				t.Errorf("%s = %v, want %v", tt.metric, got, tt.want)
			}
		})
	}
	t.Run("network programming latency is 2.5s", func(t *testing.T) {
		h := fams[NetworkProgrammingDuration].GetMetric()[0].GetHistogram()
		if h.GetSampleSum() != 2.5 {
			t.Errorf("sum = %v, want 2.5", h.GetSampleSum())
		}
	})
	t.Run("runtime collectors present", func(t *testing.T) {
		if fams["go_goroutines"] == nil {
			t.Errorf("go_goroutines missing")
		}
	})
	t.Run("local endpoints per port", func(t *testing.T) {
		if got, _ := fams.Value(ServicePortsLocalEndpoints, webLbl); got != 2 {
			t.Errorf("local endpoints = %v, want 2", got)
		}
	})
}

// TestRegistryIsPrivate checks that two Metrics do not share a registry (no global state).
func TestRegistryIsPrivate(t *testing.T) {
	a, b := New(Options{NoRuntimeCollectors: true}), New(Options{NoRuntimeCollectors: true})
	a.ForPort(webName, v1.ProtocolTCP).ConnAccepted()
	if _, ok := scrape(t, b).Value(ConnectionsAcceptedTotal, webLbl); ok {
		t.Fatal("a's series shows up in b's registry")
	}
	if _, ok := scrape(t, a).Value(ConnectionsAcceptedTotal, webLbl); !ok {
		t.Fatal("a's series missing from a's registry")
	}
}
