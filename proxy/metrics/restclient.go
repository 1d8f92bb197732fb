package metrics

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientmetrics "k8s.io/client-go/tools/metrics"
)

// client-go's request metrics, as kube-proxy exposes them (k8s.io/component-base's
// metrics/prometheus/restclient): same names, labels and buckets, so the dashboards written for
// kube-proxy's API requests work unchanged.
const (
	RESTRequestsTotal       = "rest_client_requests_total"
	RESTRequestDuration     = "rest_client_request_duration_seconds"
	RESTRequestRetriesTotal = "rest_client_request_retries_total"
	RESTRateLimiterDuration = "rest_client_rate_limiter_duration_seconds"
	RESTRequestSize         = "rest_client_request_size_bytes"
	RESTResponseSize        = "rest_client_response_size_bytes"
)

// RESTLatencyBuckets are the buckets of RESTRequestDuration and RESTRateLimiterDuration, in
// seconds; RESTSizeBuckets those of RESTRequestSize and RESTResponseSize, in bytes (64 B to 16 MiB).
var (
	RESTLatencyBuckets = []float64{0.005, 0.025, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60}
	RESTSizeBuckets    = []float64{64, 256, 512, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216}
)

// restClient is the set of client-go request metrics of one Metrics, and the adapters
// (k8s.io/client-go/tools/metrics' interfaces) that feed it.
type restClient struct {
	requests    *prometheus.CounterVec   // code, method, host
	duration    *prometheus.HistogramVec // verb, host
	retries     *prometheus.CounterVec   // code, verb, host
	rateLimiter *prometheus.HistogramVec // verb, host
	reqSize     *prometheus.HistogramVec // verb, host
	respSize    *prometheus.HistogramVec // verb, host
}

func newRESTClient() *restClient {
	hist := func(name, help string, buckets []float64) *prometheus.HistogramVec {
		return prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets}, []string{"verb", "host"})
	}
	return &restClient{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: RESTRequestsTotal,
			Help: "Number of HTTP requests, partitioned by status code, method, and host."}, []string{"code", "method", "host"}),
		duration: hist(RESTRequestDuration, "Request latency in seconds. Broken down by verb, and host.", RESTLatencyBuckets),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: RESTRequestRetriesTotal,
			Help: "Number of request retries, partitioned by status code, verb, and host."}, []string{"code", "verb", "host"}),
		rateLimiter: hist(RESTRateLimiterDuration, "Client side rate limiter latency in seconds. Broken down by verb, and host.", RESTLatencyBuckets),
		reqSize:     hist(RESTRequestSize, "Request size in bytes. Broken down by verb and host.", RESTSizeBuckets),
		respSize:    hist(RESTResponseSize, "Response size in bytes. Broken down by verb and host.", RESTSizeBuckets),
	}
}

func (r *restClient) collectors() []prometheus.Collector {
	return []prometheus.Collector{r.requests, r.duration, r.retries, r.rateLimiter, r.reqSize, r.respSize}
}

// opts returns the adapters to hand to client-go.
func (r *restClient) opts() clientmetrics.RegisterOpts {
	return clientmetrics.RegisterOpts{
		RequestResult:      resultAdapter{r.requests},
		RequestLatency:     latencyAdapter{r.duration},
		RequestRetry:       retryAdapter{r.retries},
		RateLimiterLatency: latencyAdapter{r.rateLimiter},
		RequestSize:        sizeAdapter{r.reqSize},
		ResponseSize:       sizeAdapter{r.respSize},
	}
}

type resultAdapter struct{ v *prometheus.CounterVec }

func (a resultAdapter) Increment(_ context.Context, code, method, host string) {
	a.v.WithLabelValues(code, method, host).Inc()
}

type latencyAdapter struct{ v *prometheus.HistogramVec }

func (a latencyAdapter) Observe(_ context.Context, verb string, u url.URL, latency time.Duration) {
	a.v.WithLabelValues(verb, u.Host).Observe(latency.Seconds())
}

type retryAdapter struct{ v *prometheus.CounterVec }

func (a retryAdapter) IncrementRetry(_ context.Context, code, verb, host string) {
	a.v.WithLabelValues(code, verb, host).Inc()
}

type sizeAdapter struct{ v *prometheus.HistogramVec }

func (a sizeAdapter) Observe(_ context.Context, verb, host string, size float64) {
	a.v.WithLabelValues(verb, host).Observe(size)
}

// clientGo is the process's one hook into client-go: k8s.io/client-go/tools/metrics.Register
// takes effect once per process (later calls are ignored), so the first RegisterRESTClient
// installs forwarders and every later one finds them in place.
var clientGo struct {
	mu    sync.Mutex
	owner *Metrics // the Metrics whose registry receives the requests; nil: none yet
}

// ErrRESTClientTaken is returned by RegisterRESTClient when client-go's request metrics of this
// process already go elsewhere: to another Metrics, or to adapters some other package registered
// with client-go first.
var ErrRESTClientTaken = errors.New("client-go request metrics already registered")

// RegisterRESTClient exposes the requests of every client-go REST client of the process on m's
// registry (RESTRequestsTotal, RESTRequestDuration, RESTRequestRetriesTotal,
// RESTRateLimiterDuration, RESTRequestSize, RESTResponseSize), as kube-proxy does. client-go
// takes one set of request metrics per process (k8s.io/client-go/tools/metrics.Register), so
// one Metrics per process may have them: a second call returns an error wrapping
// ErrRESTClientTaken, as does the first if another package registered its own adapters with
// client-go before. Calling it again on the same Metrics does nothing.
func (m *Metrics) RegisterRESTClient() error {
	clientGo.mu.Lock()
	defer clientGo.mu.Unlock()
	switch clientGo.owner {
	case m:
		return nil
	case nil:
	default:
		return fmt.Errorf("%w by another metrics registry of this process (client-go takes one set per process)", ErrRESTClientTaken)
	}
	r := newRESTClient()
	opts := r.opts()
	clientmetrics.Register(opts)
	// Register does nothing when it was called before (by a package that imports
	// component-base's restclient metrics, say): then client-go feeds those, not ours.
	if clientmetrics.RequestResult != opts.RequestResult {
		return fmt.Errorf("%w by another package: client-go's requests are counted in its metrics, not on /metrics", ErrRESTClientTaken)
	}
	m.reg.MustRegister(r.collectors()...)
	clientGo.owner = m
	return nil
}
