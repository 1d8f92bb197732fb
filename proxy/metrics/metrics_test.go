package metrics

import (
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"slices"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/loadbalancer"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/metrics/metricstest"
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
	webName = proxy.Name{Namespace: "ns", Name: "web", Port: "http"}
	dnsName = proxy.Name{Namespace: "kube-system", Name: "dns", Port: "dns"}
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
	m.Queued(now.Add(-3 * time.Second))
	sp := &proxy.ServicePort{Name: webName, Protocol: v1.ProtocolTCP}
	m.Synced(proxy.SyncResult{
		Start: now.Add(-time.Second), Took: 500 * time.Millisecond, Kind: proxy.SyncFull,
		Triggers: []proxy.TriggerTime{{Family: v1.IPv4Protocol, At: now.Add(-3 * time.Second)}}, ServiceChanges: 2, EndpointChanges: 5,
		Ports: []proxy.PortState{{ServicePort: sp, LocalEndpoints: 2}},
	})
	// A failed sync counts its duration but does not move the last-success timestamp.
	m.Synced(proxy.SyncResult{Start: now, Took: 20 * time.Millisecond, Kind: proxy.SyncPartial, Triggers: []proxy.TriggerTime{{Family: v1.IPv4Protocol, At: now}},
		Ports: []proxy.PortState{{ServicePort: sp, LocalEndpoints: 2}}, Err: errors.New("restore failed")})

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
	t.Run("network programming latency is 2.5s, of the successful sync only", func(t *testing.T) {
		ms := fams[NetworkProgrammingDuration].GetMetric()
		if len(ms) != 1 {
			t.Fatalf("%d series, want 1", len(ms))
		}
		h := ms[0].GetHistogram()
		if h.GetSampleCount() != 1 || h.GetSampleSum() != 2.5 {
			t.Errorf("count %v sum %v, want 1 and 2.5", h.GetSampleCount(), h.GetSampleSum())
		}
		if l := ms[0].GetLabel(); len(l) != 1 || l[0].GetName() != "ip_family" || l[0].GetValue() != "IPv4" {
			t.Errorf("labels %v, want ip_family=IPv4", l)
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

// TestDialFailureSeriesFollowEndpoints: the dial-failure series of an endpoint that left its
// service port are removed; those of endpoints still there stay.
func TestDialFailureSeriesFollowEndpoints(t *testing.T) {
	m := New(Options{NoRuntimeCollectors: true})
	stay, gone := netip.MustParseAddrPort("10.244.1.2:8080"), netip.MustParseAddrPort("10.244.2.2:8080")
	pm := m.ForPort(webName, v1.ProtocolTCP)
	pm.DialFailed(stay)
	pm.DialFailed(gone)
	m.KeepEndpoints(webName, v1.ProtocolTCP, func(ep netip.AddrPort) bool { return ep == stay })
	fams := scrape(t, m)
	with := func(ep netip.AddrPort) map[string]string {
		l := map[string]string{"endpoint": ep.String()}
		for k, v := range webLbl {
			l[k] = v
		}
		return l
	}
	if _, ok := fams.Value(EndpointDialFailuresTotal, with(gone)); ok {
		t.Errorf("the departed endpoint %s still has a dial-failure series", gone)
	}
	if v, ok := fams.Value(EndpointDialFailuresTotal, with(stay)); !ok || v != 1 {
		t.Errorf("the remaining endpoint's series: %v, %v; want 1", v, ok)
	}
}

// TestAffinityEvicted wires AffinityEvicted into a load balancer that keeps two affinity entries
// per service port and sends five clients to one port: three evictions, counted on that port's
// series, which Forget removes.
func TestAffinityEvicted(t *testing.T) {
	m := New(Options{NoRuntimeCollectors: true})
	lb := loadbalancer.New(loadbalancer.Options{MaxAffinityEntries: 2, OnAffinityEvicted: m.AffinityEvicted})
	sp := &proxy.ServicePort{Name: webName, Protocol: v1.ProtocolTCP, SessionAffinity: true, AffinityTimeout: time.Hour}
	lb.SetServicePort(sp, []proxy.Endpoint{{Addr: netip.MustParseAddrPort("10.244.1.5:8080"), Ready: true, Serving: true}})
	for i := range 5 {
		if _, err := lb.Next(webName, netip.AddrFrom4([4]byte{192, 168, 0, byte(i)}), false, false); err != nil {
			t.Fatal(err)
		}
	}
	if got, ok := scrape(t, m).Value(AffinityEvictedTotal, webLbl); !ok || got != 3 {
		t.Errorf("%s%v = %v (present %v), want 3", AffinityEvictedTotal, webLbl, got, ok)
	}
	m.Forget(webName, v1.ProtocolTCP)
	if _, ok := scrape(t, m).Value(AffinityEvictedTotal, webLbl); ok {
		t.Errorf("%s still has a series for the forgotten port", AffinityEvictedTotal)
	}
}

// TestWatchBudget: the budget's limit and use are read at each scrape.
func TestWatchBudget(t *testing.T) {
	m := New(Options{NoRuntimeCollectors: true})
	b := &fakeBudget{limit: 768, inUse: 10}
	m.WatchBudget(b)
	b.inUse = 42
	fams := scrape(t, m)
	for state, want := range map[string]float64{"limit": 768, "in_use": 42} {
		if got, ok := fams.Value(DataPathDescriptors, map[string]string{"state": state}); !ok || got != want {
			t.Errorf("%s{state=%q} = %v (present %v), want %v", DataPathDescriptors, state, got, ok, want)
		}
	}
}

type fakeBudget struct{ limit, inUse int }

func (f *fakeBudget) Limit() int { return f.limit }
func (f *fakeBudget) InUse() int { return f.inUse }

// TestSeriesAppearWithFirstEvent: a service port without traffic, or without local endpoints,
// has no series at all.
func TestSeriesAppearWithFirstEvent(t *testing.T) {
	m := New(Options{NoRuntimeCollectors: true})
	pm := m.ForPort(webName, v1.ProtocolTCP)
	sp := &proxy.ServicePort{Name: webName, Protocol: v1.ProtocolTCP}
	m.Synced(proxy.SyncResult{Ports: []proxy.PortState{{ServicePort: sp}}, Unservable: 3})
	fams := scrape(t, m)
	for _, name := range []string{ConnectionsAcceptedTotal, ConnectionsActive, BytesToEndpointsTotal, ServicePortsLocalEndpoints} {
		if _, ok := fams.Value(name, webLbl); ok {
			t.Errorf("%s has a series before any event", name)
		}
	}
	if v, _ := fams.Value(ServicePortsUnservable, nil); v != 3 {
		t.Errorf("%s = %v, want 3", ServicePortsUnservable, v)
	}
	pm.ConnAccepted()
	m.Synced(proxy.SyncResult{Ports: []proxy.PortState{{ServicePort: sp, LocalEndpoints: 1}}})
	m.Synced(proxy.SyncResult{Ports: []proxy.PortState{{ServicePort: sp}}})
	fams = scrape(t, m)
	if v, ok := fams.Value(ConnectionsAcceptedTotal, webLbl); !ok || v != 1 {
		t.Errorf("accepted = %v, %v after one connection", v, ok)
	}
	if v, ok := fams.Value(ServicePortsLocalEndpoints, webLbl); !ok || v != 0 {
		t.Errorf("local endpoints = %v, %v: want a series at 0 once it had one", v, ok)
	}
}

// A connection or session handed over leaves the gauges: the per-port sink is a
// forward.HandoverMetrics.
func TestReleasedLeaveGauges(t *testing.T) {
	m := New(Options{NoRuntimeCollectors: true})
	tcp, udp := m.ForPort(webName, v1.ProtocolTCP), m.ForPort(dnsName, v1.ProtocolUDP)
	for _, sink := range []forward.Metrics{tcp, udp} {
		if _, ok := sink.(forward.HandoverMetrics); !ok {
			t.Fatalf("%T is not a forward.HandoverMetrics", sink)
		}
	}
	tcp.ConnAccepted()
	tcp.ConnAccepted()
	udp.UDPSessionOpened()
	tcp.(forward.HandoverMetrics).ConnReleased()
	udp.(forward.HandoverMetrics).UDPSessionReleased()
	fams := scrape(t, m)
	if v, ok := fams.Value(ConnectionsActive, webLbl); !ok || v != 1 {
		t.Errorf("%s = %v (%v), want 1", ConnectionsActive, v, ok)
	}
	if v, ok := fams.Value(UDPSessionsActive, dnsLbl); !ok || v != 0 {
		t.Errorf("%s = %v (%v), want 0", UDPSessionsActive, v, ok)
	}
}

// TestHandover: a completed hand-over counts with its duration and records; a failed one counts
// only as failed.
func TestHandover(t *testing.T) {
	m := New(Options{NoRuntimeCollectors: true})
	m.Handover(HandoverSuccessor, HandoverCompleted, 300*time.Millisecond, map[string]int{"tcp-conn": 20, "listener": 3})
	m.Handover(HandoverSuccessor, HandoverFailed, time.Second, map[string]int{"tcp-conn": 7})
	fams := scrape(t, m)
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{HandoversTotal, map[string]string{"role": "successor", "result": "completed"}, 1},
		{HandoversTotal, map[string]string{"role": "successor", "result": "failed"}, 1},
		{HandoverRecordsTotal, map[string]string{"role": "successor", "kind": "tcp-conn"}, 20},
		{HandoverRecordsTotal, map[string]string{"role": "successor", "kind": "listener"}, 3},
		{HandoverDuration, map[string]string{"role": "successor"}, 1}, // a histogram's sample count
	} {
		if got, ok := fams.Value(c.name, c.labels); !ok || got != c.want {
			t.Errorf("%s%v = %v (present %v), want %v", c.name, c.labels, got, ok, c.want)
		}
	}
	if _, ok := fams.Value(HandoversTotal, map[string]string{"role": "predecessor", "result": "completed"}); ok {
		t.Errorf("%s has a predecessor series though this process never handed over", HandoversTotal)
	}
}

// The handler answers uncompressed even when the scraper offers gzip (see Handler).
func TestHandlerDoesNotCompress(t *testing.T) {
	m := New(Options{NoRuntimeCollectors: true})
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	req, err := http.NewRequest(http.MethodGet, srv.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Accept-Encoding", "gzip")
	resp, err := srv.Client().Transport.RoundTrip(req) // no transparent decompression
	if err != nil {
		t.Fatalf("scrape: %v", err)
	}
	defer resp.Body.Close()
	if ce := resp.Header.Get("Content-Encoding"); ce != "" {
		t.Errorf("Content-Encoding %q, want none", ce)
	}
	if _, err := metricstest.Parse(resp.Body); err != nil {
		t.Errorf("the answer is not the text exposition: %v", err)
	}
}

// TestSyncedAllocationsDoNotGrowWithPorts: a full sync lists every service port; those without
// a local-endpoints series cost no allocation (at 10,000 ports a key and a label slice each was
// ~1 MB of garbage per periodic sync).
func TestSyncedAllocationsDoNotGrowWithPorts(t *testing.T) {
	m := New(Options{})
	allocs := func(n int) float64 {
		ports := make([]proxy.PortState, n)
		for i := range ports {
			ports[i].ServicePort = &proxy.ServicePort{Name: proxy.Name{Namespace: "ns", Name: fmt.Sprintf("svc-%d", i), Port: "http"}, Protocol: v1.ProtocolTCP}
		}
		r := proxy.SyncResult{Kind: proxy.SyncFull, Took: time.Millisecond, Ports: ports}
		return testing.AllocsPerRun(20, func() { m.Synced(r) })
	}
	if few, many := allocs(10), allocs(1000); many > few+2 {
		t.Errorf("Synced: %v allocations for 10 ports, %v for 1,000", few, many)
	}
}

// TestNetworkProgrammingAsKubeProxy pins the histogram to kube-proxy's: its buckets (0.25 s, 0.5 s,
// 1 s to 59 s, 60 s to 115 s by 5, 120 s to 300 s by 30), its ip_family label, and one
// observation per trigger time, from it to the time the change was programmed.
func TestNetworkProgrammingAsKubeProxy(t *testing.T) {
	var want []float64
	want = append(want, 0.25, 0.5)
	for s := 1; s <= 59; s++ {
		want = append(want, float64(s))
	}
	for s := 60; s <= 115; s += 5 {
		want = append(want, float64(s))
	}
	for s := 120; s <= 300; s += 30 {
		want = append(want, float64(s))
	}
	if got := NetworkProgrammingBuckets(); !slices.Equal(got, want) {
		t.Errorf("buckets %v,\nwant kube-proxy's %v", got, want)
	}

	m := New(Options{NoRuntimeCollectors: true})
	done := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	m.Programmed([]proxy.TriggerTime{
		{Family: v1.IPv4Protocol, At: done.Add(-40 * time.Millisecond)},
		{Family: v1.IPv4Protocol, At: done.Add(-2 * time.Second)},
		{Family: v1.IPv6Protocol, At: done.Add(-300 * time.Millisecond)},
	}, done)
	fams := scrape(t, m)
	byFamily := map[string]*dto.Histogram{}
	for _, s := range fams[NetworkProgrammingDuration].GetMetric() {
		for _, l := range s.GetLabel() {
			if l.GetName() == "ip_family" {
				byFamily[l.GetValue()] = s.GetHistogram()
			}
		}
	}
	check := func(family string, count uint64, sum float64, le05 uint64) {
		t.Helper()
		h := byFamily[family]
		if h == nil {
			t.Fatalf("no %s series", family)
		}
		if h.GetSampleCount() != count || math.Abs(h.GetSampleSum()-sum) > 1e-9 {
			t.Errorf("%s: count %d sum %v, want %d and %v", family, h.GetSampleCount(), h.GetSampleSum(), count, sum)
		}
		for _, b := range h.GetBucket() {
			if b.GetUpperBound() == 0.5 && b.GetCumulativeCount() != le05 {
				t.Errorf("%s: %d at or below 0.5 s, want %d", family, b.GetCumulativeCount(), le05)
			}
		}
	}
	check("IPv4", 2, 2.04, 1)
	check("IPv6", 1, 0.3, 1)
}

// TestNetworkProgrammingFineAgrees checks that every network programming observation goes to the
// fine histogram as to kube-proxy's, with the same value and label, and that the fine buckets
// rise from 1 ms by about √2 each up to kube-proxy's top bucket.
func TestNetworkProgrammingFineAgrees(t *testing.T) {
	b := NetworkProgrammingFineBuckets()
	if b[0] != 0.001 || b[len(b)-1] != NetworkProgrammingBuckets()[len(NetworkProgrammingBuckets())-1] {
		t.Errorf("fine buckets %v..%v, want 0.001..300", b[0], b[len(b)-1])
	}
	for i := 1; i < len(b); i++ {
		if r := b[i] / b[i-1]; r <= 1 || r > 1.43 {
			t.Errorf("bucket %v after %v: ratio %.3f, want (1, 1.43]", b[i], b[i-1], r)
		}
	}

	m := New(Options{NoRuntimeCollectors: true})
	done := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	ago := []time.Duration{700 * time.Microsecond, 3 * time.Millisecond, 17 * time.Millisecond, 95 * time.Millisecond, 240 * time.Millisecond, 2 * time.Second}
	var triggers []proxy.TriggerTime
	for _, d := range ago {
		triggers = append(triggers, proxy.TriggerTime{Family: v1.IPv4Protocol, At: done.Add(-d)})
	}
	m.Programmed(triggers, done)
	m.EndpointsProgrammed(proxy.EndpointsResult{Start: done, Took: 5 * time.Millisecond,
		Triggers: []proxy.TriggerTime{{Family: v1.IPv6Protocol, At: done.Add(-time.Millisecond)}}})
	fams := scrape(t, m)
	series := func(name string) map[string]*dto.Histogram {
		out := map[string]*dto.Histogram{}
		for _, s := range fams[name].GetMetric() {
			for _, l := range s.GetLabel() {
				if l.GetName() == "ip_family" {
					out[l.GetValue()] = s.GetHistogram()
				}
			}
		}
		return out
	}
	kp, fine := series(NetworkProgrammingDuration), series(NetworkProgrammingFine)
	if len(kp) != 2 || len(fine) != 2 {
		t.Fatalf("%d kube-proxy series, %d fine ones; want 2 each (IPv4, IPv6)", len(kp), len(fine))
	}
	for family, h := range kp {
		f := fine[family]
		if f == nil {
			t.Fatalf("no fine %s series", family)
		}
		if f.GetSampleCount() != h.GetSampleCount() || f.GetSampleSum() != h.GetSampleSum() {
			t.Errorf("%s: fine count %d sum %v, kube-proxy's %d and %v", family, f.GetSampleCount(), f.GetSampleSum(), h.GetSampleCount(), h.GetSampleSum())
		}
	}
	// Each observation in its fine bucket: the cumulative count at each bound is the number of
	// observations at or below it.
	for _, bk := range fine["IPv4"].GetBucket() {
		want := 0
		for _, d := range ago {
			if d.Seconds() <= bk.GetUpperBound() {
				want++
			}
		}
		if int(bk.GetCumulativeCount()) != want {
			t.Errorf("IPv4 fine le=%v: %d, want %d", bk.GetUpperBound(), bk.GetCumulativeCount(), want)
		}
	}
}
