package kubeapi

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	clienttesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/source"
)

// hangGuard bounds every wait so a broken test fails with a message instead of hanging until
// the test binary's timeout. It is not a performance threshold.
const hangGuard = time.Minute

// event is one Handler call.
type event struct {
	kind      string // "svc", "slice", "synced"
	prev, cur string // "ns/name@resourceVersion" or ""
	same      bool   // prev and cur are the same object (resync)
}

func (e event) String() string { return fmt.Sprintf("%s(%s -> %s)", e.kind, e.prev, e.cur) }

// recorder is a source.Handler that records calls and fails the test on concurrent calls.
type recorder struct {
	t        *testing.T
	inFlight atomic.Int32
	events   chan event
}

var _ source.Handler = (*recorder)(nil)

func newRecorder(t *testing.T) *recorder {
	return &recorder{t: t, events: make(chan event, 1000)}
}

func (r *recorder) enter() func() {
	if n := r.inFlight.Add(1); n != 1 {
		r.t.Errorf("concurrent Handler calls: %d in flight", n)
	}
	return func() { r.inFlight.Add(-1) }
}

func id(m *metav1.ObjectMeta) string {
	return m.Namespace + "/" + m.Name + "@" + m.ResourceVersion
}

func (r *recorder) OnServiceUpdate(prev, cur *v1.Service) {
	defer r.enter()()
	e := event{kind: "svc", same: prev != nil && prev == cur}
	if prev != nil {
		e.prev = id(&prev.ObjectMeta)
	}
	if cur != nil {
		e.cur = id(&cur.ObjectMeta)
	}
	r.events <- e
}

func (r *recorder) OnEndpointSliceUpdate(prev, cur *discovery.EndpointSlice) {
	defer r.enter()()
	e := event{kind: "slice", same: prev != nil && prev == cur}
	if prev != nil {
		e.prev = id(&prev.ObjectMeta)
	}
	if cur != nil {
		e.cur = id(&cur.ObjectMeta)
	}
	r.events <- e
}

func (r *recorder) OnSynced() {
	defer r.enter()()
	r.events <- event{kind: "synced"}
}

// next returns the next recorded event.
func (r *recorder) next(t *testing.T) event {
	t.Helper()
	select {
	case e := <-r.events:
		return e
	case <-time.After(hangGuard):
		t.Fatal("no Handler call within the hang guard")
		return event{}
	}
}

// expectSet reads len(want) events and compares them with want, ignoring order.
func (r *recorder) expectSet(t *testing.T, want ...event) {
	t.Helper()
	got := map[string]int{}
	for range want {
		got[r.next(t).String()]++
	}
	for _, w := range want {
		if got[w.String()] == 0 {
			t.Errorf("missing Handler call %s; got %v", w, got)
		}
		got[w.String()]--
	}
}

// noMore checks that nothing else was recorded so far.
func (r *recorder) noMore(t *testing.T) {
	t.Helper()
	select {
	case e := <-r.events:
		t.Errorf("unexpected Handler call %s", e)
	default:
	}
}

func svc(ns, name, rv string, lbls map[string]string) *v1.Service {
	return &v1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, ResourceVersion: rv, Labels: lbls,
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kubectl"}}},
		Spec: v1.ServiceSpec{ClusterIP: "10.96.0.10", Ports: []v1.ServicePort{{Port: 80, Protocol: v1.ProtocolTCP}}},
	}
}

func slice(ns, name, rv string, lbls map[string]string) *discovery.EndpointSlice {
	l := map[string]string{discovery.LabelServiceName: "svc"}
	for k, v := range lbls {
		l[k] = v
	}
	return &discovery.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: name, ResourceVersion: rv, Labels: l},
		AddressType: discovery.AddressTypeIPv4,
		Endpoints:   []discovery.Endpoint{{Addresses: []string{"10.0.0.1"}}},
	}
}

// fakeClient returns a fake clientset holding objs and a channel that receives one value per
// watch the informers open (the fake tracker drops events that happen before a watch exists).
func fakeClient(objs ...runtime.Object) (*fake.Clientset, chan string) {
	c := fake.NewClientset(objs...)
	watches := make(chan string, 10)
	c.PrependWatchReactor("*", func(a clienttesting.Action) (bool, watch.Interface, error) {
		wa := a.(clienttesting.WatchActionImpl)
		w, err := c.Tracker().Watch(a.GetResource(), a.GetNamespace(), wa.ListOptions)
		watches <- a.GetResource().Resource
		return true, w, err
	})
	return c, watches
}

// clientsetClient adapts a client-go clientset (the fake one, in these tests) to Client.
type clientsetClient struct{ cs kubernetes.Interface }

func (c clientsetClient) Services() ListWatcher {
	return typedListWatcher[*v1.ServiceList]{c.cs.CoreV1().Services(metav1.NamespaceAll)}
}

func (c clientsetClient) EndpointSlices() ListWatcher {
	return typedListWatcher[*discovery.EndpointSliceList]{c.cs.DiscoveryV1().EndpointSlices(metav1.NamespaceAll)}
}

func (c clientsetClient) Nodes() ListWatcher {
	return typedListWatcher[*v1.NodeList]{c.cs.CoreV1().Nodes()}
}

// typedListWatcher is a typed client's list and watch as a ListWatcher.
type typedListWatcher[L runtime.Object] struct {
	c interface {
		List(context.Context, metav1.ListOptions) (L, error)
		Watch(context.Context, metav1.ListOptions) (watch.Interface, error)
	}
}

func (t typedListWatcher[L]) List(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
	return t.c.List(ctx, o)
}

func (t typedListWatcher[L]) Watch(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
	return t.c.Watch(ctx, o)
}

// IsWatchListSemanticsUnSupported passes on what the clientset says of itself to the
// reflector (the fake clientset cannot serve watch-list requests).
func (c clientsetClient) IsWatchListSemanticsUnSupported() bool {
	u, ok := c.cs.(interface{ IsWatchListSemanticsUnSupported() bool })
	return ok && u.IsWatchListSemanticsUnSupported()
}

func startSource(t *testing.T, client kubernetes.Interface, opts Options, h source.Handler) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- New(clientsetClient{client}, opts).Run(ctx, h) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run returned %v after cancel, want nil", err)
			}
		case <-time.After(hangGuard):
			t.Errorf("Run did not return after cancel")
		}
	})
}

func waitWatches(t *testing.T, watches chan string, want ...string) {
	t.Helper()
	seen := map[string]bool{}
	for len(seen) < len(want) {
		select {
		case r := <-watches:
			seen[r] = true
		case <-time.After(hangGuard):
			t.Fatalf("watches opened: %v, want %v", seen, want)
		}
	}
}

func TestEventMapping(t *testing.T) {
	proxyName := map[string]string{proxy.ServiceProxyNameLabel: "other"}
	headless := map[string]string{v1.IsHeadlessService: ""}
	client, watches := fakeClient(
		svc("ns", "a", "1", nil),
		svc("ns", "other", "1", proxyName),
		slice("ns", "a-1", "1", nil),
		slice("ns", "hl-1", "1", headless),
	)
	rec := newRecorder(t)
	startSource(t, client, Options{}, rec)

	// Initial list: only the objects the selectors let through, then OnSynced last.
	rec.expectSet(t, event{kind: "svc", cur: "ns/a@1"}, event{kind: "slice", cur: "ns/a-1@1"})
	if e := rec.next(t); e.kind != "synced" {
		t.Fatalf("after the initial list got %s, want synced", e)
	}
	rec.noMore(t)
	waitWatches(t, watches, "services", "endpointslices")

	ctx := context.Background()
	steps := []struct {
		name string
		do   func() error
		want event
	}{
		{"add service", func() error {
			_, err := client.CoreV1().Services("ns").Create(ctx, svc("ns", "b", "2", nil), metav1.CreateOptions{})
			return err
		}, event{kind: "svc", cur: "ns/b@2"}},
		{"update service", func() error {
			_, err := client.CoreV1().Services("ns").Update(ctx, svc("ns", "a", "3", nil), metav1.UpdateOptions{})
			return err
		}, event{kind: "svc", prev: "ns/a@1", cur: "ns/a@3"}},
		{"delete service", func() error {
			return client.CoreV1().Services("ns").Delete(ctx, "a", metav1.DeleteOptions{})
		}, event{kind: "svc", prev: "ns/a@3"}},
		{"add slice", func() error {
			_, err := client.DiscoveryV1().EndpointSlices("ns").Create(ctx, slice("ns", "b-1", "4", nil), metav1.CreateOptions{})
			return err
		}, event{kind: "slice", cur: "ns/b-1@4"}},
		{"update slice", func() error {
			_, err := client.DiscoveryV1().EndpointSlices("ns").Update(ctx, slice("ns", "a-1", "5", nil), metav1.UpdateOptions{})
			return err
		}, event{kind: "slice", prev: "ns/a-1@1", cur: "ns/a-1@5"}},
		{"delete slice", func() error {
			return client.DiscoveryV1().EndpointSlices("ns").Delete(ctx, "a-1", metav1.DeleteOptions{})
		}, event{kind: "slice", prev: "ns/a-1@5"}},
	}
	for _, st := range steps {
		if err := st.do(); err != nil {
			t.Fatalf("%s: %v", st.name, err)
		}
		if got := rec.next(t); got.String() != st.want.String() {
			t.Errorf("%s: got %s, want %s", st.name, got, st.want)
		}
	}
	rec.noMore(t)
}

func TestSelectorsSentToAPIServer(t *testing.T) {
	client, watches := fakeClient()
	rec := newRecorder(t)
	startSource(t, client, Options{}, rec)
	if e := rec.next(t); e.kind != "synced" {
		t.Fatalf("got %s, want synced", e)
	}
	waitWatches(t, watches, "services", "endpointslices")

	want := map[string]struct{ labels, fields string }{
		"services":       {"!service.kubernetes.io/service-proxy-name", "spec.clusterIP!=None"},
		"endpointslices": {"!service.kubernetes.io/headless", ""},
	}
	seen := map[string]bool{}
	for _, a := range client.Actions() {
		var opts metav1.ListOptions
		switch a := a.(type) {
		case clienttesting.ListActionImpl:
			opts = a.ListOptions
		case clienttesting.WatchActionImpl:
			opts = a.ListOptions
		default:
			t.Errorf("unexpected API call %s %s", a.GetVerb(), a.GetResource().Resource)
			continue
		}
		res := a.GetResource().Resource
		w, ok := want[res]
		if !ok {
			t.Errorf("%s of unexpected resource %s", a.GetVerb(), res)
			continue
		}
		if opts.LabelSelector != w.labels || opts.FieldSelector != w.fields {
			t.Errorf("%s %s: selectors %q / %q, want %q / %q", a.GetVerb(), res, opts.LabelSelector, opts.FieldSelector, w.labels, w.fields)
		}
		if a.GetNamespace() != "" {
			t.Errorf("%s %s in namespace %q, want all namespaces", a.GetVerb(), res, a.GetNamespace())
		}
		seen[a.GetVerb()+" "+res] = true
	}
	for _, k := range []string{"list services", "watch services", "list endpointslices", "watch endpointslices"} {
		if !seen[k] {
			t.Errorf("no %s call; saw %v", k, seen)
		}
	}
}

func TestManagedFieldsStripped(t *testing.T) {
	client, _ := fakeClient(svc("ns", "a", "1", nil))
	var got atomic.Pointer[v1.Service]
	h := &funcHandler{svc: func(_, cur *v1.Service) { got.Store(cur) }, synced: make(chan struct{})}
	startSource(t, client, Options{}, h)
	select {
	case <-h.synced:
	case <-time.After(hangGuard):
		t.Fatal("not synced")
	}
	s := got.Load()
	if s == nil {
		t.Fatal("service not delivered")
	}
	if len(s.ManagedFields) != 0 {
		t.Errorf("managedFields kept: %v", s.ManagedFields)
	}
}

type funcHandler struct {
	svc    func(prev, cur *v1.Service)
	synced chan struct{}
}

func (f *funcHandler) OnServiceUpdate(prev, cur *v1.Service)               { f.svc(prev, cur) }
func (f *funcHandler) OnEndpointSliceUpdate(_, _ *discovery.EndpointSlice) {}
func (f *funcHandler) OnSynced()                                           { close(f.synced) }

func TestResyncPassesThrough(t *testing.T) {
	client, _ := fakeClient(svc("ns", "a", "1", nil))
	rec := newRecorder(t)
	// One second is client-go's minimum resync period.
	startSource(t, client, Options{ResyncPeriod: time.Second}, rec)
	sawSynced := false
	for {
		e := rec.next(t)
		if e.kind == "synced" {
			if sawSynced {
				t.Fatal("OnSynced called twice")
			}
			sawSynced = true
			continue
		}
		if e.kind == "svc" && e.same {
			if e.prev != "ns/a@1" || !sawSynced {
				t.Errorf("resync event %s (after synced: %v)", e, sawSynced)
			}
			return
		}
	}
}

func TestTombstoneAndBadObjects(t *testing.T) {
	var buf safeBuffer
	log := zerolog.New(&buf)
	type call struct{ prev, cur *v1.Service }
	var calls []call
	d := &dispatcher{h: &funcHandler{svc: func(p, c *v1.Service) { calls = append(calls, call{p, c}) }, synced: make(chan struct{})}}
	eh := &eventHandler[v1.Service]{kind: "Service", log: log, d: d, deliver: d.h.OnServiceUpdate}
	a := svc("ns", "a", "1", nil)
	b := svc("ns", "a", "2", nil)

	tests := []struct {
		name      string
		do        func()
		wantPrev  *v1.Service
		wantCur   *v1.Service
		wantCalls int
		wantLog   string
	}{
		{"add", func() { eh.OnAdd(a, true) }, nil, a, 1, ""},
		{"update", func() { eh.OnUpdate(a, b) }, a, b, 1, ""},
		{"delete", func() { eh.OnDelete(b) }, b, nil, 1, ""},
		{"tombstone", func() { eh.OnDelete(cache.DeletedFinalStateUnknown{Key: "ns/a", Obj: b}) }, b, nil, 1, ""},
		{"tombstone of wrong type", func() {
			eh.OnDelete(cache.DeletedFinalStateUnknown{Key: "ns/a", Obj: &v1.Pod{}})
		}, nil, nil, 0, "unexpected object"},
		{"tombstone without object", func() { eh.OnDelete(cache.DeletedFinalStateUnknown{Key: "ns/a"}) }, nil, nil, 0, "unexpected object"},
		{"add of wrong type", func() { eh.OnAdd(&v1.Pod{}, false) }, nil, nil, 0, "*v1.Pod"},
		{"update with wrong old type", func() { eh.OnUpdate(&v1.Pod{}, b) }, nil, nil, 0, "unexpected object"},
		{"update with nil new", func() { eh.OnUpdate(a, (*v1.Service)(nil)) }, nil, nil, 0, "unexpected object"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			calls = nil
			buf.Reset()
			tc.do()
			if len(calls) != tc.wantCalls {
				t.Fatalf("%d Handler calls, want %d", len(calls), tc.wantCalls)
			}
			if tc.wantCalls == 1 && (calls[0].prev != tc.wantPrev || calls[0].cur != tc.wantCur) {
				t.Errorf("Handler got (%p, %p), want (%p, %p)", calls[0].prev, calls[0].cur, tc.wantPrev, tc.wantCur)
			}
			if !strings.Contains(buf.String(), tc.wantLog) {
				t.Errorf("log %q does not contain %q", buf.String(), tc.wantLog)
			}
			if tc.wantLog != "" && !strings.Contains(buf.String(), `"level":"error"`) {
				t.Errorf("log %q is not at error level", buf.String())
			}
		})
	}
}

func TestOnSyncedOnce(t *testing.T) {
	n := 0
	d := &dispatcher{h: &countSynced{n: &n}}
	d.synced()
	d.synced()
	if n != 1 {
		t.Errorf("OnSynced called %d times, want 1", n)
	}
}

type countSynced struct{ n *int }

func (c *countSynced) OnServiceUpdate(_, _ *v1.Service)                    {}
func (c *countSynced) OnEndpointSliceUpdate(_, _ *discovery.EndpointSlice) {}
func (c *countSynced) OnSynced()                                           { *c.n++ }

func TestRunTwice(t *testing.T) {
	client, _ := fakeClient()
	s := New(clientsetClient{client}, Options{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	rec := newRecorder(t)
	go func() { done <- s.Run(ctx, rec) }()
	if e := rec.next(t); e.kind != "synced" {
		t.Fatalf("got %s, want synced", e)
	}
	if err := s.Run(ctx, rec); err == nil {
		t.Error("second Run returned nil, want an error")
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("first Run returned %v", err)
	}
}

// safeBuffer is a bytes.Buffer safe for concurrent use that signals when a string shows up.
type safeBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *safeBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *safeBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func (b *safeBuffer) Reset() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf.Reset()
}

func TestUnreachableAPIServer(t *testing.T) {
	// A port that was just free: connections to it are refused.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()

	cfg, err := BuildConfig("", "http://"+addr)
	if err != nil {
		t.Fatal(err)
	}
	client, err := NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	var buf safeBuffer
	rec := newRecorder(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	src := New(client, Options{WaitLogInterval: 10 * time.Millisecond, Log: zerolog.New(&buf)})
	if err := src.Err(); err != nil {
		t.Fatalf("Err before Run = %v, want nil", err)
	}
	go func() {
		done <- src.Run(ctx, rec)
	}()

	wantLogs := []string{
		"waiting for initial sync of services from the API server",
		"waiting for initial sync of endpointslices from the API server",
		"connection refused",
		`"level":"warn"`,
		"failed, client-go retries with back-off",
	}
	deadline := time.Now().Add(hangGuard)
	for {
		missing := ""
		out := buf.String()
		for _, w := range wantLogs {
			if !strings.Contains(out, w) {
				missing = w
				break
			}
		}
		if missing == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("log never contained %q:\n%s", missing, out)
		}
		time.Sleep(10 * time.Millisecond)
	}
	select {
	case err := <-done:
		t.Fatalf("Run returned %v while the API server is unreachable", err)
	default:
	}
	// The failure is reported for /healthz, naming both resources and the cause.
	if err := src.Err(); err == nil || !strings.Contains(err.Error(), "services: API server unreachable since") ||
		!strings.Contains(err.Error(), "endpointslices: API server unreachable since") || !strings.Contains(err.Error(), "connection refused") {
		t.Errorf("Err while unreachable = %v", err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run returned %v after cancel, want nil", err)
	}
	rec.noMore(t)
}

func TestBuildConfig(t *testing.T) {
	dir := t.TempDir()
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters:
- name: c
  cluster:
    server: https://192.0.2.1:6443
    insecure-skip-tls-verify: true
users:
- name: u
  user:
    token: secret-token
contexts:
- name: ctx
  context: {cluster: c, user: u}
current-context: ctx
`), 0o600); err != nil {
		t.Fatal(err)
	}
	// Not in a cluster: the in-cluster config must fail.
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	t.Setenv("KUBERNETES_SERVICE_PORT", "")

	tests := []struct {
		name       string
		kubeconfig string
		master     string
		wantHost   string
		wantToken  string
		wantErr    string
	}{
		{name: "kubeconfig", kubeconfig: kubeconfig, wantHost: "https://192.0.2.1:6443", wantToken: "secret-token"},
		{name: "master overrides kubeconfig server", kubeconfig: kubeconfig, master: "https://198.51.100.7:443", wantHost: "https://198.51.100.7:443", wantToken: "secret-token"},
		{name: "master only", master: "http://127.0.0.1:8080", wantHost: "http://127.0.0.1:8080"},
		{name: "neither, not in cluster", wantErr: "in-cluster"},
		{name: "missing kubeconfig", kubeconfig: filepath.Join(dir, "nope"), wantErr: "nope"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := BuildConfig(tc.kubeconfig, tc.master)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if cfg.Host != tc.wantHost || cfg.BearerToken != tc.wantToken {
				t.Errorf("host %q token %q, want %q %q", cfg.Host, cfg.BearerToken, tc.wantHost, tc.wantToken)
			}
			if cfg.UserAgent != UserAgent || !strings.HasPrefix(cfg.ContentType, "application/vnd.kubernetes.protobuf") {
				t.Errorf("user agent %q content type %q", cfg.UserAgent, cfg.ContentType)
			}
		})
	}
}

func TestWatchStateLogging(t *testing.T) {
	refused := func(timeout string) error {
		return &url.Error{Op: "Get", URL: "http://127.0.0.1:1/api/v1/services?timeout=" + timeout,
			Err: errors.New("dial tcp 127.0.0.1:1: connect: connection refused")}
	}
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	live := context.Background()

	steps := []struct {
		name     string
		ctx      context.Context
		err      error
		wantLog  string // substring of the new log output; "" means nothing logged
		wantLast string // cause of lastError afterwards; "" means nil
	}{
		{"first failure", live, refused("7m1s"), `"level":"warn"`, "Get: dial tcp 127.0.0.1:1: connect: connection refused"},
		{"same cause, other URL", live, refused("8m2s"), "", "Get: dial tcp 127.0.0.1:1: connect: connection refused"},
		{"different failure", live, errors.New("forbidden"), "forbidden", "forbidden"},
		{"watch closed normally", live, io.EOF, "", "forbidden"},
		{"expired", live, apierrors.NewResourceExpired("too old"), "", "forbidden"},
		{"failure while shutting down", canceled, errors.New("context canceled"), "", "forbidden"},
		{"success", live, nil, "succeeded again", ""},
		{"success again", live, nil, "", ""},
	}
	var buf safeBuffer
	w := &watchState{resource: "services", log: zerolog.New(&buf).Level(zerolog.InfoLevel)}
	for _, st := range steps {
		buf.Reset()
		w.record(st.ctx, "watch", st.err)
		out := buf.String()
		if st.wantLog == "" && out != "" {
			t.Errorf("%s: logged %q, want nothing", st.name, out)
		}
		if st.wantLog != "" && !strings.Contains(out, st.wantLog) {
			t.Errorf("%s: logged %q, want %q", st.name, out, st.wantLog)
		}
		last := ""
		if err := w.lastError(); err != nil {
			last = cause(err)
		}
		if last != st.wantLast {
			t.Errorf("%s: lastError %q, want %q", st.name, last, st.wantLast)
		}
	}
}
