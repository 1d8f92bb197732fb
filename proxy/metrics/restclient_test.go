package metrics

import (
	"context"
	"errors"
	"math"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"sync"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/rest"
)

// TestRESTClientAdapters feeds the adapters as client-go does and reads the series back by the
// labels kube-proxy's families have.
func TestRESTClientAdapters(t *testing.T) {
	m := New(Options{NoRuntimeCollectors: true})
	r := newRESTClient()
	m.reg.MustRegister(r.collectors()...)
	o := r.opts()
	ctx := context.Background()
	u := url.URL{Scheme: "https", Host: "10.96.0.1:443", Path: "/api/v1/services"}
	o.RequestResult.Increment(ctx, "200", "GET", u.Host)
	o.RequestResult.Increment(ctx, "200", "GET", u.Host)
	o.RequestResult.Increment(ctx, "403", "POST", u.Host)
	o.RequestLatency.Observe(ctx, "GET", u, 30*time.Millisecond)
	o.RequestLatency.Observe(ctx, "POST", u, 3*time.Second)
	o.RequestRetry.IncrementRetry(ctx, "503", "GET", u.Host)
	o.RateLimiterLatency.Observe(ctx, "GET", u, time.Millisecond)
	o.RequestSize.Observe(ctx, "POST", u.Host, 300)
	o.ResponseSize.Observe(ctx, "GET", u.Host, 5000)

	fams := scrape(t, m)
	for _, c := range []struct {
		metric string
		labels map[string]string
		want   float64
	}{
		{RESTRequestsTotal, map[string]string{"code": "200", "method": "GET", "host": "10.96.0.1:443"}, 2},
		{RESTRequestsTotal, map[string]string{"code": "403", "method": "POST", "host": "10.96.0.1:443"}, 1},
		{RESTRequestDuration, map[string]string{"verb": "GET", "host": "10.96.0.1:443"}, 1},
		{RESTRequestDuration, map[string]string{"verb": "POST", "host": "10.96.0.1:443"}, 1},
		{RESTRequestRetriesTotal, map[string]string{"code": "503", "verb": "GET", "host": "10.96.0.1:443"}, 1},
		{RESTRateLimiterDuration, map[string]string{"verb": "GET", "host": "10.96.0.1:443"}, 1},
		{RESTRequestSize, map[string]string{"verb": "POST", "host": "10.96.0.1:443"}, 1},
		{RESTResponseSize, map[string]string{"verb": "GET", "host": "10.96.0.1:443"}, 1},
	} {
		if got, ok := fams.Value(c.metric, c.labels); !ok || got != c.want {
			t.Errorf("%s%v = %v (present %v), want %v", c.metric, c.labels, got, ok, c.want)
		}
	}
	// Exactly kube-proxy's label sets and buckets.
	for name, want := range map[string][]string{
		RESTRequestsTotal: {"code", "host", "method"}, RESTRequestDuration: {"host", "verb"},
		RESTRequestRetriesTotal: {"code", "host", "verb"}, RESTRateLimiterDuration: {"host", "verb"},
		RESTRequestSize: {"host", "verb"}, RESTResponseSize: {"host", "verb"},
	} {
		for _, s := range fams[name].GetMetric() {
			var got []string
			for _, l := range s.GetLabel() {
				got = append(got, l.GetName())
			}
			if !slices.Equal(got, want) {
				t.Errorf("%s labels %v, want %v", name, got, want)
			}
		}
	}
	var bounds []float64
	for _, b := range fams[RESTRequestDuration].GetMetric()[0].GetHistogram().GetBucket() {
		bounds = append(bounds, b.GetUpperBound())
	}
	if want := []float64{0.005, 0.025, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, math.Inf(1)}; !slices.Equal(bounds, want) {
		t.Errorf("%s buckets %v, want %v", RESTRequestDuration, bounds, want)
	}
}

// restOwner is the Metrics of this test binary that holds client-go's request metrics (they
// are taken once per process, and a test may run more than once).
var restOwner = sync.OnceValues(func() (*Metrics, error) {
	m := New(Options{NoRuntimeCollectors: true})
	return m, m.RegisterRESTClient()
})

// TestRegisterRESTClient sends real requests with a client-go REST client and finds them on
// the registry that took client-go's request metrics; a second registry is refused.
func TestRegisterRESTClient(t *testing.T) {
	m, err := restOwner()
	if err != nil {
		t.Fatalf("RegisterRESTClient: %v", err)
	}
	if err := m.RegisterRESTClient(); err != nil {
		t.Errorf("RegisterRESTClient again on the same Metrics: %v", err)
	}
	other := New(Options{NoRuntimeCollectors: true})
	if err := other.RegisterRESTClient(); !errors.Is(err, ErrRESTClientTaken) {
		t.Errorf("RegisterRESTClient on a second Metrics = %v, want ErrRESTClientTaken", err)
	}

	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/api/v1/missing" {
			http.Error(w, `{"kind":"Status","apiVersion":"v1","status":"Failure","code":404}`, http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{}`))
	}))
	defer srv.Close()
	host := srv.Listener.Addr().String()
	before := scrape(t, m)
	ok0, _ := before.Value(RESTRequestsTotal, map[string]string{"code": "200", "method": "GET", "host": host})
	nf0, _ := before.Value(RESTRequestsTotal, map[string]string{"code": "404", "method": "GET", "host": host})

	gv := schema.GroupVersion{Version: "v1"}
	rc, err := rest.RESTClientFor(&rest.Config{Host: srv.URL, ContentConfig: rest.ContentConfig{
		GroupVersion: &gv, NegotiatedSerializer: serializer.NewCodecFactory(runtime.NewScheme()).WithoutConversion()},
		APIPath: "/api"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for range 3 {
		if err := rc.Get().AbsPath("/api/v1/present").Do(ctx).Error(); err != nil {
			t.Fatalf("GET present: %v", err)
		}
	}
	if err := rc.Get().AbsPath("/api/v1/missing").Do(ctx).Error(); err == nil {
		t.Fatal("GET missing: no error")
	}

	fams := scrape(t, m)
	if got, _ := fams.Value(RESTRequestsTotal, map[string]string{"code": "200", "method": "GET", "host": host}); got-ok0 != 3 {
		t.Errorf("%s{code=200,method=GET,host=%s} grew by %v, want 3", RESTRequestsTotal, host, got-ok0)
	}
	if got, _ := fams.Value(RESTRequestsTotal, map[string]string{"code": "404", "method": "GET", "host": host}); got-nf0 != 1 {
		t.Errorf("%s{code=404,method=GET,host=%s} grew by %v, want 1", RESTRequestsTotal, host, got-nf0)
	}
	if got, ok := fams.Value(RESTRequestDuration, map[string]string{"verb": "GET", "host": host}); !ok || got < 4 {
		t.Errorf("%s{verb=GET,host=%s} count %v (present %v), want at least 4", RESTRequestDuration, host, got, ok)
	}
	if _, ok := scrape(t, other)[RESTRequestsTotal]; ok {
		t.Errorf("the refused registry has %s", RESTRequestsTotal)
	}
}
