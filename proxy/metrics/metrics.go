// Package metrics exposes the proxy's Prometheus metrics: kube-proxy's sync metrics (same names,
// types and buckets, so dashboards and alerts written for kube-proxy keep working) and per
// service port traffic metrics that only a proxy in the data path can count.
//
// A Metrics owns its own prometheus.Registry (never the global one). Hand it to the proxier as
// both proxy.Options.Observer and proxy.Options.Metrics, and serve Handler on
// --metrics-bind-address:
//
//	m := metrics.New(metrics.Options{})
//	px := proxy.New(proxy.Options{Observer: m, Metrics: m, ...})
//	http.Handle("/metrics", m.Handler())
//
// Traffic series are labelled namespace, service, port (the port's name) and protocol; dial
// failures also carry the endpoint ("ip:port"). A deleted service port's series are removed
// (Forget), so the registry does not grow with churn.
package metrics

import (
	"net/http"
	"net/netip"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	v1 "k8s.io/api/core/v1"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/serviceport"
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
	ServicePortsLocalEndpoints = "kube_userspace_proxy_service_port_local_endpoints"
	ServicePortsTotal          = "kube_userspace_proxy_service_ports"
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

// Metrics is the proxy's metric set and the registry serving it. It implements
// proxy.SyncObserver, proxy.ChangeCounter and proxy.TrafficMetrics; all methods are safe for
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
	netProg         prometheus.Histogram
	syncFailures    prometheus.Counter
	ports           prometheus.Gauge

	accepted, failed    *prometheus.CounterVec
	active              *prometheus.GaugeVec
	bytesTo, bytesFrom  *prometheus.CounterVec
	dialFailures        *prometheus.CounterVec
	udpOpened           *prometheus.CounterVec
	udpActive           *prometheus.GaugeVec
	dropped             *prometheus.CounterVec
	localEndpointsGauge *prometheus.GaugeVec
}

var (
	_ proxy.SyncObserver   = (*Metrics)(nil)
	_ proxy.ChangeCounter  = (*Metrics)(nil)
	_ proxy.TrafficMetrics = (*Metrics)(nil)
)

// New creates the metrics and registers them on a new registry.
func New(opts Options) *Metrics {
	now := opts.Now
	if now == nil {
		now = time.Now
	}
	m := &Metrics{reg: prometheus.NewRegistry(), now: now}
	m.syncDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    SyncDuration,
		Help:    "SyncProxyRules latency in seconds",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 15),
	})
	m.syncFull = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    SyncFullDuration,
		Help:    "SyncProxyRules latency in seconds for full resyncs",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 15),
	})
	m.syncPartial = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    SyncPartialDuration,
		Help:    "SyncProxyRules latency in seconds for partial resyncs",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 15),
	})
	m.syncLast = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: SyncLastTimestamp,
		Help: "The last time proxy rules were successfully synced",
	})
	m.queuedLast = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: SyncLastQueuedTimestamp,
		Help: "The last time a sync of proxy rules was queued",
	})
	m.serviceChanges = prometheus.NewCounter(prometheus.CounterOpts{
		Name: ServiceChangesTotal,
		Help: "Cumulative proxy rules Service changes",
	})
	m.endpointChanges = prometheus.NewCounter(prometheus.CounterOpts{
		Name: EndpointChangesTotal,
		Help: "Cumulative proxy rules Endpoint changes",
	})
	// kube-proxy's buckets: 0.25s steps to 0.5s, 1s steps to 59s, 5s steps to 115s, 30s steps to 570s.
	var netBuckets []float64
	netBuckets = append(netBuckets, prometheus.LinearBuckets(0.25, 0.25, 2)...)
	netBuckets = append(netBuckets, prometheus.LinearBuckets(1, 1, 59)...)
	netBuckets = append(netBuckets, prometheus.LinearBuckets(60, 5, 12)...)
	netBuckets = append(netBuckets, prometheus.LinearBuckets(300, 30, 10)...)
	m.netProg = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    NetworkProgrammingDuration,
		Help:    "In Cluster Network Programming Latency in seconds",
		Buckets: netBuckets,
	})
	m.syncFailures = prometheus.NewCounter(prometheus.CounterOpts{
		Name: SyncFailuresTotal,
		Help: "Cumulative proxy rules restore failures",
	})
	m.ports = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: ServicePortsTotal,
		Help: "Number of service ports the proxy serves (one listener each)",
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
	m.localEndpointsGauge = gauge(ServicePortsLocalEndpoints, "Endpoints on this node that Local external traffic may use, per service port")

	m.reg.MustRegister(m.syncDuration, m.syncFull, m.syncPartial, m.syncLast, m.queuedLast, m.serviceChanges, m.endpointChanges,
		m.netProg, m.syncFailures, m.ports,
		m.accepted, m.active, m.failed, m.bytesTo, m.bytesFrom, m.dialFailures, m.udpOpened, m.udpActive,
		m.dropped, m.localEndpointsGauge)
	if !opts.NoRuntimeCollectors {
		m.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	return m
}

// Registry returns the registry the metrics are registered on (to add more collectors).
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Handler returns the /metrics handler for the registry.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

// SyncDone records a finished sync (proxy.SyncObserver): its duration always; on success the
// last-sync timestamp and, when it applied changes, the network programming latency measured
// from the oldest change it applied (kube-proxy measures from the EndpointSlice's
// last-change-trigger-time; we measure from when the proxy saw the change, which leaves out the
// control plane's share). A failed sync counts in the failures counter.
func (m *Metrics) SyncDone(start time.Time, took time.Duration, oldestChange time.Time, err error) {
	m.syncDuration.Observe(took.Seconds())
	if err != nil {
		m.syncFailures.Inc()
		return
	}
	end := start.Add(took)
	m.syncLast.Set(float64(end.UnixNano()) / 1e9)
	if !oldestChange.IsZero() {
		m.netProg.Observe(end.Sub(oldestChange).Seconds())
	}
}

// SyncModeDone records a sync's duration in the full or the partial histogram
// (proxy.SyncModeObserver).
func (m *Metrics) SyncModeDone(full bool, took time.Duration) {
	if full {
		m.syncFull.Observe(took.Seconds())
	} else {
		m.syncPartial.Observe(took.Seconds())
	}
}

// ChangeQueued records when a change was queued (proxy.SyncObserver).
func (m *Metrics) ChangeQueued(at time.Time) {
	m.queuedLast.Set(float64(at.UnixNano()) / 1e9)
}

// ChangesApplied counts the services and endpoint sets a sync applied (proxy.ChangeCounter).
// kube-proxy counts every update event; we count per service per sync, so several updates of one
// service between two syncs count once.
func (m *Metrics) ChangesApplied(services, endpoints int) {
	m.serviceChanges.Add(float64(services))
	m.endpointChanges.Add(float64(endpoints))
}

// PortsSynced records the number of service ports and each one's local endpoints
// (proxy.SyncObserver).
func (m *Metrics) PortsSynced(ports []proxy.PortState) {
	m.ports.Set(float64(len(ports)))
	for _, st := range ports {
		m.localEndpointsGauge.WithLabelValues(labelValues(st.ServicePort.Name, st.ServicePort.Protocol)...).Set(float64(st.LocalEndpoints))
	}
}

// ForPort returns the traffic sink of one service port (proxy.TrafficMetrics). Its series
// appear with their first event.
func (m *Metrics) ForPort(name serviceport.Name, protocol v1.Protocol) forward.Metrics {
	lv := labelValues(name, protocol)
	return &portMetrics{
		m:      m,
		labels: lv,
		// Bound once: the per-event cost is an atomic add.
		accepted:  m.accepted.WithLabelValues(lv...),
		active:    m.active.WithLabelValues(lv...),
		failed:    m.failed.WithLabelValues(lv...),
		bytesTo:   m.bytesTo.WithLabelValues(lv...),
		bytesFrom: m.bytesFrom.WithLabelValues(lv...),
		udpOpened: m.udpOpened.WithLabelValues(lv...),
		udpActive: m.udpActive.WithLabelValues(lv...),
		dropped:   m.dropped.WithLabelValues(lv...),
	}
}

// Forget removes every series of a deleted service port (proxy.TrafficMetrics).
func (m *Metrics) Forget(name serviceport.Name, protocol v1.Protocol) {
	match := prometheus.Labels{"namespace": name.Namespace, "service": name.Name, "port": name.Port, "protocol": string(protocol)}
	for _, v := range []interface{ DeletePartialMatch(prometheus.Labels) int }{
		m.accepted, m.active, m.failed, m.bytesTo, m.bytesFrom, m.dialFailures, m.udpOpened,
		m.udpActive, m.dropped, m.localEndpointsGauge,
	} {
		v.DeletePartialMatch(match)
	}
}

func labelValues(name serviceport.Name, protocol v1.Protocol) []string {
	return []string{name.Namespace, name.Name, name.Port, string(protocol)}
}

// portMetrics is one service port's forward.Metrics.
type portMetrics struct {
	m         *Metrics
	labels    []string
	accepted  prometheus.Counter
	active    prometheus.Gauge
	failed    prometheus.Counter
	bytesTo   prometheus.Counter
	bytesFrom prometheus.Counter
	udpOpened prometheus.Counter
	udpActive prometheus.Gauge
	dropped   prometheus.Counter
}

var _ forward.Metrics = (*portMetrics)(nil)

func (p *portMetrics) ConnAccepted() { p.accepted.Inc(); p.active.Inc() }
func (p *portMetrics) ConnClosed()   { p.active.Dec() }
func (p *portMetrics) ConnFailed()   { p.active.Dec(); p.failed.Inc() }

func (p *portMetrics) DialFailed(endpoint netip.AddrPort) {
	p.m.dialFailures.WithLabelValues(append(append([]string{}, p.labels...), endpoint.String())...).Inc()
}

func (p *portMetrics) BytesCopied(toEndpoint, fromEndpoint int64) {
	p.bytesTo.Add(float64(max(toEndpoint, 0)))
	p.bytesFrom.Add(float64(max(fromEndpoint, 0)))
}

func (p *portMetrics) UDPSessionOpened() { p.udpOpened.Inc(); p.udpActive.Inc() }
func (p *portMetrics) UDPSessionClosed() { p.udpActive.Dec() }
func (p *portMetrics) DatagramDropped()  { p.dropped.Inc() }
