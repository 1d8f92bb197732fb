// Package metrics exposes the proxy's Prometheus metrics: kube-proxy's sync metrics (same names,
// types and buckets, so dashboards and alerts written for kube-proxy keep working) and per
// service port traffic metrics that only a proxy in the data path can count.
//
// A Metrics owns its own prometheus.Registry (never the global one). Feed it each sync's
// proxy.SyncResult (Synced) and each queued change (Queued), hand it to the proxier as the
// per-port traffic sink (ForPort, Forget), and serve Handler on --metrics-bind-address:
//
//	m := metrics.New(metrics.Options{})
//	px := userspace.New(userspace.Options{OnSynced: m.Synced, OnQueued: m.Queued, Metrics: m, ...})
//	http.Handle("/metrics", m.Handler())
//
// The load balancer reports the ClientIP affinity entries it evicts at its bound to
// AffinityEvicted, which has the signature of loadbalancer.Options.OnAffinityEvicted:
//
//	lb := loadbalancer.New(loadbalancer.Options{OnAffinityEvicted: m.AffinityEvicted, ...})
//
// It reads only the model (package proxy) and package forward's Metrics interface.
//
// Traffic series are labelled namespace, service, port (the port's name) and protocol; dial
// failures also carry the endpoint ("ip:port"). A deleted service port's series are removed
// (Forget), so the registry does not grow with churn.
package metrics

import (
	"math"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
)

// Metric names. The kubeproxy_ ones are kube-proxy's.
const (
	SyncDuration               = "kubeproxy_sync_proxy_rules_duration_seconds"
	SyncFullDuration           = "kubeproxy_sync_full_proxy_rules_duration_seconds"
	SyncPartialDuration        = "kubeproxy_sync_partial_proxy_rules_duration_seconds"
	SyncLastTimestamp          = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
	SyncLastQueuedTimestamp    = "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds"
	ServiceChangesTotal        = "kubeproxy_sync_proxy_rules_service_changes_total"
	EndpointChangesTotal       = "kubeproxy_sync_proxy_rules_endpoint_changes_total"
	NetworkProgrammingDuration = "kubeproxy_network_programming_duration_seconds"
	// NetworkProgrammingFine is NetworkProgrammingDuration's observations in fine buckets
	// (NetworkProgrammingFineBuckets): kube-proxy's first bucket is 0.25 s, above most of this
	// proxy's latencies.
	NetworkProgrammingFine     = "kube_userspace_proxy_network_programming_duration_seconds"
	SyncFailuresTotal          = "kubeproxy_sync_proxy_rules_iptables_restore_failures_total"
	ConnectionsAcceptedTotal   = "kube_userspace_proxy_connections_accepted_total"
	ConnectionsActive          = "kube_userspace_proxy_connections_active"
	ConnectionsFailedTotal     = "kube_userspace_proxy_connections_failed_total"
	BytesToEndpointsTotal      = "kube_userspace_proxy_bytes_to_endpoints_total"
	BytesFromEndpointsTotal    = "kube_userspace_proxy_bytes_from_endpoints_total"
	EndpointDialFailuresTotal  = "kube_userspace_proxy_endpoint_dial_failures_total"
	UDPSessionsOpenedTotal     = "kube_userspace_proxy_udp_sessions_opened_total"
	UDPSessionsActive          = "kube_userspace_proxy_udp_sessions_active"
	UDPDatagramsDroppedTotal   = "kube_userspace_proxy_udp_datagrams_dropped_total"
	ConnectionsRefusedTotal    = "kube_userspace_proxy_connections_refused_total"
	UDPSessionsEvictedTotal    = "kube_userspace_proxy_udp_sessions_evicted_total"
	ServicePortsLocalEndpoints = "kube_userspace_proxy_service_port_local_endpoints"
	ServicePortsUnservable     = "kube_userspace_proxy_service_ports_unservable"
	ServicePortsTotal          = "kube_userspace_proxy_service_ports"
	AffinityEvictedTotal       = "kube_userspace_proxy_affinity_entries_evicted_total"
	HandoversTotal             = "kube_userspace_proxy_handovers_total"
	HandoverDuration           = "kube_userspace_proxy_handover_duration_seconds"
	HandoverRecordsTotal       = "kube_userspace_proxy_handover_records_total"
)

// The roles and results of hand-overs (Handover).
const (
	HandoverSuccessor   = "successor"   // this process took over from a running proxy
	HandoverPredecessor = "predecessor" // this process handed over to a successor
	HandoverCompleted   = "completed"
	HandoverFailed      = "failed"  // nothing moved: the predecessor serves on
	HandoverRefused     = "refused" // no common protocol version: the successor restarts instead
)

// portLabels are the labels of every traffic series.
var portLabels = []string{"namespace", "service", "port", "protocol"}

// Options configures Metrics.
type Options struct {
	// Now returns the current time; nil means time.Now.
	Now func() time.Time
	// NoRuntimeCollectors leaves out the Go runtime and process collectors (go_*, process_*),
	// which kube-proxy exposes too; the zero value includes them.
	NoRuntimeCollectors bool
}

// Metrics is the proxy's metric set and the registry serving it. All methods are safe for
// concurrent use.
type Metrics struct {
	reg *prometheus.Registry
	now func() time.Time

	syncDuration    prometheus.Histogram
	syncFull        prometheus.Histogram
	syncPartial     prometheus.Histogram
	syncLast        prometheus.Gauge
	queuedLast      prometheus.Gauge
	serviceChanges  prometheus.Counter
	endpointChanges prometheus.Counter
	netProg         *prometheus.HistogramVec
	netProgFine     *prometheus.HistogramVec
	syncFailures    prometheus.Counter
	ports           prometheus.Gauge

	accepted, failed    *prometheus.CounterVec
	active              *prometheus.GaugeVec
	bytesTo, bytesFrom  *prometheus.CounterVec
	dialFailures        *prometheus.CounterVec
	udpOpened           *prometheus.CounterVec
	udpActive           *prometheus.GaugeVec
	dropped             *prometheus.CounterVec
	refused, evicted    *prometheus.CounterVec
	localEndpointsGauge *prometheus.GaugeVec
	affinityEvicted     *prometheus.CounterVec

	handovers        *prometheus.CounterVec
	handoverDuration *prometheus.HistogramVec
	handoverRecords  *prometheus.CounterVec

	unservable prometheus.Gauge

	mu sync.Mutex // guards dialed and local
	// local holds the service ports that have a local-endpoints series.
	local map[localKey]bool
	// dialed holds, per service port (its label values joined), the endpoints that have a
	// dial-failure series, so that KeepEndpoints can drop those of departed endpoints.
	dialed map[string]map[netip.AddrPort]struct{}
}

// New creates the metrics and registers them on a new registry.
func New(opts Options) *Metrics {
	now := opts.Now
	if now == nil {
		now = time.Now
	}
	m := &Metrics{reg: prometheus.NewRegistry(), now: now, dialed: map[string]map[netip.AddrPort]struct{}{}, local: map[localKey]bool{}}
	syncHistogram := func(name, help string) prometheus.Histogram {
		return prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, Buckets: prometheus.ExponentialBuckets(0.001, 2, 15)})
	}
	m.syncDuration = syncHistogram(SyncDuration, "SyncProxyRules latency in seconds")
	m.syncFull = syncHistogram(SyncFullDuration, "SyncProxyRules latency in seconds for full resyncs")
	m.syncPartial = syncHistogram(SyncPartialDuration, "SyncProxyRules latency in seconds for partial resyncs")
	m.syncLast = prometheus.NewGauge(prometheus.GaugeOpts{Name: SyncLastTimestamp, Help: "The last time proxy rules were successfully synced"})
	m.queuedLast = prometheus.NewGauge(prometheus.GaugeOpts{Name: SyncLastQueuedTimestamp, Help: "The last time a sync of proxy rules was queued"})
	m.serviceChanges = prometheus.NewCounter(prometheus.CounterOpts{Name: ServiceChangesTotal, Help: "Cumulative proxy rules Service changes"})
	m.endpointChanges = prometheus.NewCounter(prometheus.CounterOpts{Name: EndpointChangesTotal, Help: "Cumulative proxy rules Endpoint changes"})
	m.netProg = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    NetworkProgrammingDuration,
		Help:    "In Cluster Network Programming Latency in seconds",
		Buckets: NetworkProgrammingBuckets(),
	}, []string{"ip_family"})
	m.netProgFine = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    NetworkProgrammingFine,
		Help:    "In Cluster Network Programming Latency in seconds, as " + NetworkProgrammingDuration + " in fine buckets (1 ms to 300 s, each about 1.41 times the last)",
		Buckets: NetworkProgrammingFineBuckets(),
	}, []string{"ip_family"})
	m.syncFailures = prometheus.NewCounter(prometheus.CounterOpts{
		Name: SyncFailuresTotal,
		Help: "Cumulative proxy rules restore failures",
	})
	m.ports = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: ServicePortsTotal,
		Help: "Number of service ports the proxy serves (one listener each)",
	})
	m.unservable = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: ServicePortsUnservable,
		Help: "Service ports without a listener because the open-files limit leaves no descriptor for it (their portals reject)",
	})
	counter := func(name, help string, extra ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, append(append([]string{}, portLabels...), extra...))
	}
	gauge := func(name, help string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, portLabels)
	}
	m.accepted = counter(ConnectionsAcceptedTotal, "TCP connections accepted by the proxy, per service port")
	m.active = gauge(ConnectionsActive, "TCP connections accepted and not yet ended, per service port")
	m.failed = counter(ConnectionsFailedTotal, "TCP connections that ended without reaching an endpoint (no endpoint, every dial failed), per service port")
	m.bytesTo = counter(BytesToEndpointsTotal, "Payload bytes forwarded from clients to endpoints, per service port (counted when a connection or UDP session ends)")
	m.bytesFrom = counter(BytesFromEndpointsTotal, "Payload bytes forwarded from endpoints to clients, per service port (counted when a connection or UDP session ends)")
	m.dialFailures = counter(EndpointDialFailuresTotal, "Failed attempts to reach an endpoint, per service port and endpoint", "endpoint")
	m.udpOpened = counter(UDPSessionsOpenedTotal, "UDP sessions opened, per service port")
	m.udpActive = gauge(UDPSessionsActive, "UDP sessions open now, per service port")
	m.dropped = counter(UDPDatagramsDroppedTotal, "UDP datagrams from clients that could not be forwarded, per service port")
	m.refused = counter(ConnectionsRefusedTotal, "TCP connections reset at once because the service port was at its connection limit or the data path's descriptor budget was spent, per service port")
	m.evicted = counter(UDPSessionsEvictedTotal, "UDP sessions ended early (longest idle first) to make room for new clients, per service port")
	m.localEndpointsGauge = gauge(ServicePortsLocalEndpoints, "Endpoints on this node that Local external traffic may use, per service port")
	m.affinityEvicted = counter(AffinityEvictedTotal, "ClientIP session affinity entries evicted because the service port had as many as it may keep (the least recently used client forgets its endpoint), per service port")

	m.handovers = prometheus.NewCounterVec(prometheus.CounterOpts{Name: HandoversTotal,
		Help: "Hand-overs this process took part in, by role (successor: it took over; predecessor: it handed over) and result (completed, failed, refused)"}, []string{"role", "result"})
	m.handoverDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: HandoverDuration,
		Help:    "Duration of completed hand-overs in seconds, by role: the successor's from its hello to the predecessor's release, the predecessor's from its freeze to its release",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 15)}, []string{"role"})
	m.handoverRecords = prometheus.NewCounterVec(prometheus.CounterOpts{Name: HandoverRecordsTotal,
		Help: "What completed hand-overs moved, by role and kind (listener, tcp-conn, udp-session, held-port, affinity, server)"}, []string{"role", "kind"})

	m.reg.MustRegister(m.syncDuration, m.syncFull, m.syncPartial, m.syncLast, m.queuedLast, m.serviceChanges, m.endpointChanges,
		m.netProg, m.netProgFine, m.syncFailures, m.ports, m.unservable,
		m.accepted, m.active, m.failed, m.bytesTo, m.bytesFrom, m.dialFailures, m.udpOpened, m.udpActive,
		m.dropped, m.refused, m.evicted, m.localEndpointsGauge, m.affinityEvicted,
		m.handovers, m.handoverDuration, m.handoverRecords)
	if !opts.NoRuntimeCollectors {
		m.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	return m
}

// NetworkProgrammingBuckets returns kube-proxy's buckets of NetworkProgrammingDuration: 0.25 s
// steps to 0.5 s, 1 s steps to 59 s, 5 s steps to 115 s, 30 s steps from 2 to 5 minutes.
func NetworkProgrammingBuckets() []float64 {
	return slices.Concat(prometheus.LinearBuckets(0.25, 0.25, 2), prometheus.LinearBuckets(1, 1, 59),
		prometheus.LinearBuckets(60, 5, 12), prometheus.LinearBuckets(120, 30, 7))
}

// NetworkProgrammingFineBuckets returns the buckets of NetworkProgrammingFine: from 1 ms, each
// √2 times the last (rounded to three significant digits: 1 ms, 1.41 ms, 2 ms, 2.83 ms, 4 ms, …)
// up to 262 s, then kube-proxy's top bucket, 300 s.
func NetworkProgrammingFineBuckets() []float64 {
	var b []float64
	for k := 0.0; ; k++ {
		v := 0.001 * math.Pow(2, k/2)
		if v >= 300 {
			break
		}
		v, _ = strconv.ParseFloat(strconv.FormatFloat(v, 'g', 3, 64), 64)
		b = append(b, v)
	}
	return append(b, 300)
}

// Handover records a hand-over this process took part in: its role (HandoverSuccessor or
// HandoverPredecessor), its result (HandoverCompleted, HandoverFailed, HandoverRefused), and for
// a completed one its duration and the records it moved, by kind.
func (m *Metrics) Handover(role, result string, took time.Duration, records map[string]int) {
	m.handovers.WithLabelValues(role, result).Inc()
	if result != HandoverCompleted {
		return
	}
	m.handoverDuration.WithLabelValues(role).Observe(took.Seconds())
	for kind, n := range records {
		m.handoverRecords.WithLabelValues(role, kind).Add(float64(n))
	}
}

// DataPathDescriptors is the gauge of the data path's descriptor budget.
const DataPathDescriptors = "kube_userspace_proxy_data_path_descriptors"

// WatchBudget exposes the data path's descriptor budget as DataPathDescriptors{state="limit"}
// and {state="in_use"}, read at each scrape from budget (the proxier's forward.Budget).
func (m *Metrics) WatchBudget(budget interface {
	Limit() int
	InUse() int
}) {
	for state, f := range map[string]func() int{"limit": budget.Limit, "in_use": budget.InUse} {
		m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name:        DataPathDescriptors,
			Help:        "File descriptors the data path (TCP connections, UDP sessions, splice pipes) may hold (state=limit) and holds (state=in_use)",
			ConstLabels: prometheus.Labels{"state": state},
		}, func() float64 { return float64(f()) }))
	}
}

// Registry returns the registry the metrics are registered on (to add more collectors).
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Handler returns the /metrics handler for the registry. It does not compress: a gzip writer
// (kept in a pool between scrapes, ~1.5 MiB with its compression tables) outweighs what it
// saves on a node-local scrape of a few hundred series (per-port series exist only for ports
// that saw traffic).
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg, DisableCompression: true})
}

// Synced records a finished sync: its duration always, in the full or partial histogram too
// when it programmed portals; the changes it applied (kube-proxy counts every update event; we
// count per service per sync, so several updates of one service between two syncs count once);
// the service ports and each one's local endpoints. On success also the last-sync timestamp
// and the network programming latency of each endpoint change it programmed (see Programmed). A
// failed sync counts in the failures counter.
func (m *Metrics) Synced(r proxy.SyncResult) {
	m.serviceChanges.Add(float64(r.ServiceChanges))
	m.endpointChanges.Add(float64(r.EndpointChanges))
	m.ports.Set(float64(len(r.Ports)))
	m.unservable.Set(float64(r.Unservable))
	// A port's local-endpoints series appears once it has a local endpoint, and stays (at 0
	// when they are gone) until the port is forgotten: no series for the ports that never had one.
	m.mu.Lock()
	for _, st := range r.Ports {
		key := localKey{st.ServicePort.Name, st.ServicePort.Protocol}
		if st.LocalEndpoints == 0 && !m.local[key] {
			continue // no allocation per port: a full sync lists every port
		}
		m.local[key] = true
		m.localEndpointsGauge.WithLabelValues(labelValues(key.name, key.protocol)...).Set(float64(st.LocalEndpoints))
	}
	m.mu.Unlock()
	switch r.Kind {
	case proxy.SyncFull:
		m.syncFull.Observe(r.Took.Seconds())
	case proxy.SyncPartial:
		m.syncPartial.Observe(r.Took.Seconds())
	}
	m.syncDuration.Observe(r.Took.Seconds())
	if r.Err != nil {
		m.syncFailures.Inc()
		return
	}
	end := r.Start.Add(r.Took)
	m.syncLast.Set(float64(end.UnixNano()) / 1e9)
	m.Programmed(r.Triggers, end)
}

// EndpointsProgrammed records an endpoint-only update (proxy.EndpointsResult): its endpoint
// changes, and the network programming latency of each change it programmed.
func (m *Metrics) EndpointsProgrammed(r proxy.EndpointsResult) {
	m.endpointChanges.Add(float64(r.EndpointChanges))
	m.Programmed(r.Triggers, r.Start.Add(r.Took))
}

// Programmed observes the network programming latency of endpoint changes programmed at at: one
// observation per trigger time, from it to at, labelled with its IP family, as kube-proxy does
// (from the EndpointSlice's last-change-trigger-time annotation to the end of the sync that
// programmed the change; a change whose slice has no such annotation, a deleted slice, and
// Service changes give none). Each observation goes to both NetworkProgrammingDuration and
// NetworkProgrammingFine.
func (m *Metrics) Programmed(triggers []proxy.TriggerTime, at time.Time) {
	for _, tr := range triggers {
		d := at.Sub(tr.At).Seconds()
		m.netProg.WithLabelValues(string(tr.Family)).Observe(d)
		m.netProgFine.WithLabelValues(string(tr.Family)).Observe(d)
	}
}

// Queued records when a change was queued.
func (m *Metrics) Queued(at time.Time) {
	m.queuedLast.Set(float64(at.UnixNano()) / 1e9)
}

// ForPort returns the traffic sink of one service port (the proxier's TrafficMetrics). Its series
// appear with their first event.
func (m *Metrics) ForPort(name proxy.Name, protocol v1.Protocol) forward.Metrics {
	// Bound at the first event of each series (then the per-event cost is an atomic add): a
	// port that never sees traffic has no series, so 10,000 idle service ports cost no scrape
	// time, and hold only this small struct (the label values and series come with the first
	// event).
	return &portMetrics{m: m, name: name, protocol: protocol}
}

// lazy is one series of a port, created with its first use (get). It holds no more than that
// (the vector and labels are the caller's): 10 per service port, at 10,000 ports.
type lazy[T any] struct {
	once sync.Once
	v    T
}

func (l *lazy[T]) get(vec interface{ WithLabelValues(...string) T }, lv []string) T {
	l.once.Do(func() { l.v = vec.WithLabelValues(lv...) })
	return l.v
}

// Forget removes every series of a deleted service port (the proxier's TrafficMetrics).
func (m *Metrics) Forget(name proxy.Name, protocol v1.Protocol) {
	match := prometheus.Labels{"namespace": name.Namespace, "service": name.Name, "port": name.Port, "protocol": string(protocol)}
	m.mu.Lock()
	delete(m.dialed, strings.Join(labelValues(name, protocol), "\x00"))
	delete(m.local, localKey{name, protocol})
	m.mu.Unlock()
	for _, v := range []interface{ DeletePartialMatch(prometheus.Labels) int }{
		m.accepted, m.active, m.failed, m.bytesTo, m.bytesFrom, m.dialFailures, m.udpOpened,
		m.udpActive, m.dropped, m.refused, m.evicted, m.localEndpointsGauge, m.affinityEvicted,
	} {
		v.DeletePartialMatch(match)
	}
}

// KeepEndpoints removes the dial-failure series of the service port's endpoints that keep
// rejects (endpoints that left it), so that the series do not outlive their endpoints.
func (m *Metrics) KeepEndpoints(name proxy.Name, protocol v1.Protocol, keep func(netip.AddrPort) bool) {
	lv := labelValues(name, protocol)
	key := strings.Join(lv, "\x00")
	m.mu.Lock()
	defer m.mu.Unlock()
	for ep := range m.dialed[key] {
		if !keep(ep) {
			m.dialFailures.DeleteLabelValues(append(append([]string{}, lv...), ep.String())...)
			delete(m.dialed[key], ep)
		}
	}
	if len(m.dialed[key]) == 0 {
		delete(m.dialed, key)
	}
}

// AffinityEvicted counts one ClientIP affinity entry of a service port evicted at the load
// balancer's bound: pass it as loadbalancer.Options.OnAffinityEvicted. The series appears with
// the first eviction and goes with Forget.
func (m *Metrics) AffinityEvicted(name proxy.Name, protocol v1.Protocol) {
	m.affinityEvicted.WithLabelValues(name.Namespace, name.Name, name.Port, string(protocol)).Inc()
}

// localKey is a service port in Metrics.local.
type localKey struct {
	name     proxy.Name
	protocol v1.Protocol
}

func labelValues(name proxy.Name, protocol v1.Protocol) []string {
	return []string{name.Namespace, name.Name, name.Port, string(protocol)}
}

// portMetrics is one service port's forward.Metrics: its name until the first event, which
// creates its series holder.
type portMetrics struct {
	m        *Metrics
	name     proxy.Name
	protocol v1.Protocol
	s        atomic.Pointer[portSeries]
}

// portSeries is the label values and series of a port that saw traffic.
type portSeries struct {
	labels    []string
	accepted  lazy[prometheus.Counter]
	active    lazy[prometheus.Gauge]
	failed    lazy[prometheus.Counter]
	bytesTo   lazy[prometheus.Counter]
	bytesFrom lazy[prometheus.Counter]
	udpOpened lazy[prometheus.Counter]
	udpActive lazy[prometheus.Gauge]
	dropped   lazy[prometheus.Counter]
	refused   lazy[prometheus.Counter]
	evicted   lazy[prometheus.Counter]
}

// series returns the port's series holder, created by the first event.
func (p *portMetrics) series() *portSeries {
	if s := p.s.Load(); s != nil {
		return s
	}
	s := &portSeries{labels: labelValues(p.name, p.protocol)}
	if p.s.CompareAndSwap(nil, s) {
		return s
	}
	return p.s.Load()
}

var _ forward.Metrics = (*portMetrics)(nil)

func (p *portMetrics) ConnAccepted() {
	s := p.series()
	s.accepted.get(p.m.accepted, s.labels).Inc()
	s.active.get(p.m.active, s.labels).Inc()
}
func (p *portMetrics) ConnClosed() { s := p.series(); s.active.get(p.m.active, s.labels).Dec() }
func (p *portMetrics) ConnFailed() {
	s := p.series()
	s.active.get(p.m.active, s.labels).Dec()
	s.failed.get(p.m.failed, s.labels).Inc()
}

func (p *portMetrics) DialFailed(endpoint netip.AddrPort) {
	labels := p.series().labels
	p.m.dialFailures.WithLabelValues(append(append([]string{}, labels...), endpoint.String())...).Inc()
	key := strings.Join(labels, "\x00")
	p.m.mu.Lock()
	if p.m.dialed[key] == nil {
		p.m.dialed[key] = map[netip.AddrPort]struct{}{}
	}
	p.m.dialed[key][endpoint] = struct{}{}
	p.m.mu.Unlock()
}

func (p *portMetrics) BytesCopied(toEndpoint, fromEndpoint int64) {
	if toEndpoint <= 0 && fromEndpoint <= 0 {
		return
	}
	s := p.series()
	if toEndpoint > 0 {
		s.bytesTo.get(p.m.bytesTo, s.labels).Add(float64(toEndpoint))
	}
	if fromEndpoint > 0 {
		s.bytesFrom.get(p.m.bytesFrom, s.labels).Add(float64(fromEndpoint))
	}
}

func (p *portMetrics) UDPSessionOpened() {
	s := p.series()
	s.udpOpened.get(p.m.udpOpened, s.labels).Inc()
	s.udpActive.get(p.m.udpActive, s.labels).Inc()
}
func (p *portMetrics) UDPSessionClosed() {
	s := p.series()
	s.udpActive.get(p.m.udpActive, s.labels).Dec()
}
func (p *portMetrics) DatagramDropped() { s := p.series(); s.dropped.get(p.m.dropped, s.labels).Inc() }
func (p *portMetrics) ConnRefused()     { s := p.series(); s.refused.get(p.m.refused, s.labels).Inc() }
func (p *portMetrics) UDPSessionEvicted() {
	s := p.series()
	s.evicted.get(p.m.evicted, s.labels).Inc()
}

// ConnReleased and UDPSessionReleased (forward.HandoverMetrics): a connection or session handed
// over to a successor leaves this process's gauges.
func (p *portMetrics) ConnReleased() { s := p.series(); s.active.get(p.m.active, s.labels).Dec() }
func (p *portMetrics) UDPSessionReleased() {
	s := p.series()
	s.udpActive.get(p.m.udpActive, s.labels).Dec()
}
