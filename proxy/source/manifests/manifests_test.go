package manifests

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/source"
)

// hangGuard bounds waits in the Run tests so a broken test fails instead of hanging; it is not
// a performance threshold.
const hangGuard = time.Minute

// ev is one Handler call: op is add, update or delete; key is "Service ns/name".
type ev struct {
	op, key string
	prev    any
	cur     any
}

func (e ev) String() string { return e.op + " " + e.key }

// rec is a source.Handler that records calls.
type rec struct {
	mu     sync.Mutex
	events []ev
	synced int
	notify chan struct{}
	// objects is the state the calls describe, checked for consistency on every call.
	objects map[string]any
	t       testing.TB
}

var _ source.Handler = (*rec)(nil)

func newRec(t testing.TB) *rec {
	return &rec{notify: make(chan struct{}, 1), objects: map[string]any{}, t: t}
}

func (r *rec) record(kind string, meta func(any) (string, string), prev, cur any, prevNil, curNil bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	e := ev{prev: prev, cur: cur}
	var ns, name string
	switch {
	case prevNil && curNil:
		r.t.Errorf("Handler called with two nil objects")
		return
	case prevNil:
		e.op = "add"
		ns, name = meta(cur)
	case curNil:
		e.op = "delete"
		ns, name = meta(prev)
	default:
		e.op = "update"
		ns, name = meta(cur)
		if pns, pname := meta(prev); pns != ns || pname != name {
			r.t.Errorf("update from %s/%s to %s/%s", pns, pname, ns, name)
		}
	}
	e.key = kind + " " + ns + "/" + name
	// The calls must describe a consistent history.
	have, exists := r.objects[e.key]
	switch e.op {
	case "add":
		if exists {
			r.t.Errorf("add of %s, which exists", e.key)
		}
		r.objects[e.key] = cur
	case "update":
		if !exists || !lastDelivered(have, prev) {
			r.t.Errorf("update of %s: prev is not the object last delivered", e.key)
		}
		r.objects[e.key] = cur
	case "delete":
		if !exists || !lastDelivered(have, prev) {
			r.t.Errorf("delete of %s: prev is not the object last delivered", e.key)
		}
		delete(r.objects, e.key)
	}
	r.events = append(r.events, e)
	select {
	case r.notify <- struct{}{}:
	default:
	}
}

// lastDelivered reports whether prev, handed to the Handler as the previous version, is have,
// the version delivered last: the same Service; the same EndpointSlice or, when the source had
// let the decoded slice go, one decoded again from its encoding (see sliceDoc) and equal to it.
func lastDelivered(have, prev any) bool {
	if have == prev {
		return true
	}
	h, ok1 := have.(*discovery.EndpointSlice)
	p, ok2 := prev.(*discovery.EndpointSlice)
	return ok1 && ok2 && equality.Semantic.DeepEqual(h, p)
}

func (r *rec) OnServiceUpdate(prev, cur *v1.Service) {
	r.record(kindService, func(o any) (string, string) { s := o.(*v1.Service); return s.Namespace, s.Name }, prev, cur, prev == nil, cur == nil)
}

func (r *rec) OnEndpointSliceUpdate(prev, cur *discovery.EndpointSlice) {
	r.record(kindEndpointSlice, func(o any) (string, string) { s := o.(*discovery.EndpointSlice); return s.Namespace, s.Name }, prev, cur, prev == nil, cur == nil)
}

func (r *rec) OnSynced() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.synced++
	select {
	case r.notify <- struct{}{}:
	default:
	}
}

// take returns and forgets the recorded events.
func (r *rec) take() []ev {
	r.mu.Lock()
	defer r.mu.Unlock()
	e := r.events
	r.events = nil
	return e
}

func (r *rec) svc(t testing.TB, ns, name string) *v1.Service {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	s, _ := r.objects["Service "+ns+"/"+name].(*v1.Service)
	if s == nil {
		t.Fatalf("Service %s/%s is not served", ns, name)
	}
	return s
}

func (r *rec) served() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for k := range r.objects {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// expect checks the events since the last call (order-insensitive) against want ("add Service
// ns/name", ...).
func expect(t *testing.T, step string, r *rec, want ...string) {
	t.Helper()
	var got []string
	for _, e := range r.take() {
		got = append(got, e.String())
	}
	slices.Sort(got)
	w := slices.Clone(want)
	slices.Sort(w)
	if !slices.Equal(got, w) {
		t.Errorf("%s: Handler calls %q, want %q", step, got, w)
	}
}

// logBuf collects JSON log lines.
type logBuf struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

// take returns and forgets the lines logged at level or above.
func (l *logBuf) take(t testing.TB, level zerolog.Level) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(l.buf.String()), "\n") {
		if line == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		lv, err := zerolog.ParseLevel(fmt.Sprint(m["level"]))
		if err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if lv >= level {
			out = append(out, m)
		}
	}
	l.buf.Reset()
	return out
}

type fixture struct {
	dir   string
	src   *Source
	rec   *rec
	logs  *logBuf
	clock *fakeClock
	first bool
}

// fakeClock is the clock of a Source's debounce in tests: it moves only when told to.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock { return &fakeClock{t: time.Unix(1_700_000_000, 0)} }

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// settledScan scans, lets the debounce pass on s's clock (a fakeClock), and scans again: what
// was written before it is read, as once the writer has finished and Debounce has passed.
// scannedSource returns a Source for dir on a fake clock, set up by setUp (when not nil), after
// its first settled scan, and what it delivered.
func scannedSource(tb testing.TB, dir string, opts Options, setUp func(*Source)) (*Source, *fakeClock, *rec) {
	tb.Helper()
	s := New(dir, opts)
	if setUp != nil {
		setUp(s)
	}
	clock := newFakeClock()
	s.now = clock.now
	if err := s.prepare(); err != nil {
		tb.Fatal(err)
	}
	r := newRec(tb)
	settledScan(tb, s, clock, r, true)
	return s, clock, r
}

func settledScan(tb testing.TB, s *Source, clock *fakeClock, h source.Handler, first bool) {
	tb.Helper()
	if _, err := s.scan(h, first); err != nil {
		tb.Fatal(err)
	}
	clock.advance(s.opts.debounce())
	if _, err := s.scan(h, false); err != nil {
		tb.Fatal(err)
	}
}

func newFixture(t *testing.T, opts Options) *fixture {
	t.Helper()
	f := &fixture{dir: t.TempDir(), rec: newRec(t), logs: &logBuf{}, clock: newFakeClock(), first: true}
	opts.Log = zerolog.New(f.logs).Level(zerolog.DebugLevel)
	f.src = New(f.dir, opts)
	f.src.now = f.clock.now
	if err := f.src.prepare(); err != nil {
		t.Fatal(err)
	}
	return f
}

// scan is one scan and another once Debounce has passed: everything written before is read.
func (f *fixture) scan(t *testing.T) {
	t.Helper()
	settledScan(t, f.src, f.clock, f.rec, f.first)
	f.first = false
}

// scanOnce is one scan, without moving the clock; it returns when the next file is due.
func (f *fixture) scanOnce(t *testing.T) time.Time {
	t.Helper()
	due, err := f.src.scan(f.rec, f.first)
	if err != nil {
		t.Fatal(err)
	}
	f.first = false
	return due
}

func (f *fixture) write(t *testing.T, name, content string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(f.dir, name), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func (f *fixture) remove(t *testing.T, name string) {
	t.Helper()
	if err := os.Remove(filepath.Join(f.dir, name)); err != nil {
		t.Fatal(err)
	}
}

func service(name string, port int, extra string) string {
	return fmt.Sprintf("apiVersion: v1\nkind: Service\nmetadata:\n  name: %s\nspec:\n  ports:\n  - port: %d\n%s", name, port, extra)
}

func copyDir(t *testing.T, from, to string) {
	t.Helper()
	entries, err := os.ReadDir(from)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		in, err := os.Open(filepath.Join(from, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		out, err := os.Create(filepath.Join(to, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.Copy(out, in); err != nil {
			t.Fatal(err)
		}
		in.Close()
		out.Close()
	}
}

func TestExampleManifests(t *testing.T) {
	f := newFixture(t, Options{})
	copyDir(t, "testdata/example", f.dir)
	f.scan(t)
	want := []string{
		"EndpointSlice default/dns-1", "EndpointSlice shop/api-1", "EndpointSlice shop/lb-1", "EndpointSlice shop/web-abc12",
		"Service default/db", "Service default/dns", "Service default/search", "Service shop/api", "Service shop/lb", "Service shop/web",
	}
	if got := f.rec.served(); !slices.Equal(got, want) {
		t.Fatalf("served %q, want %q", got, want)
	}
	if errs := f.logs.take(t, zerolog.WarnLevel); len(errs) != 0 {
		t.Errorf("example manifests logged problems: %v", errs)
	}

	cidr := netip.MustParsePrefix("10.96.0.0/16")
	dns := f.rec.svc(t, "default", "dns")
	if ip, err := netip.ParseAddr(dns.Spec.ClusterIP); err != nil || !cidr.Contains(ip) || !slices.Equal(dns.Spec.ClusterIPs, []string{dns.Spec.ClusterIP}) {
		t.Errorf("dns cluster IPs %q / %q, want one allocated from %s", dns.Spec.ClusterIP, dns.Spec.ClusterIPs, cidr)
	}
	if web := f.rec.svc(t, "shop", "web"); web.Spec.ClusterIP != "10.96.0.10" {
		t.Errorf("web cluster IP %s, want the explicit 10.96.0.10", web.Spec.ClusterIP)
	}
	api := f.rec.svc(t, "shop", "api")
	if np := api.Spec.Ports[0].NodePort; np < NodePortMin || np > NodePortMax {
		t.Errorf("api node port %d, want one allocated from %d-%d", np, NodePortMin, NodePortMax)
	}
	lb := f.rec.svc(t, "shop", "lb")
	if lb.Spec.HealthCheckNodePort == 0 || lb.Spec.HealthCheckNodePort == lb.Spec.Ports[0].NodePort || lb.Spec.Ports[0].NodePort == 0 {
		t.Errorf("lb node port %d health check node port %d", lb.Spec.Ports[0].NodePort, lb.Spec.HealthCheckNodePort)
	}

	// The model accepts what the source delivers, with the defaults applied.
	f.rec.mu.Lock()
	defer f.rec.mu.Unlock()
	var ports []string
	slicesBySvc := map[types.NamespacedName][]*discovery.EndpointSlice{}
	for k, o := range f.rec.objects {
		switch o := o.(type) {
		case *v1.Service:
			sps, err := proxy.FromService(o)
			if err != nil {
				t.Errorf("%s: model rejects: %v", k, err)
			}
			for _, sp := range sps {
				ports = append(ports, fmt.Sprintf("%s port %d nodePort %v affinity %v local %v", sp, sp.Port, sp.NodePort != 0, sp.SessionAffinity, sp.ExternalPolicyLocal))
			}
		case *discovery.EndpointSlice:
			n, ok := proxy.SliceServiceName(o)
			if !ok {
				t.Errorf("%s: no service name", k)
			}
			slicesBySvc[n] = append(slicesBySvc[n], o)
		}
	}
	slices.Sort(ports)
	wantPorts := []string{
		"default/dns:dns-tcp/TCP port 53 nodePort false affinity true local false",
		"default/dns:dns/UDP port 53 nodePort false affinity true local false",
		"shop/api:/TCP port 8080 nodePort true affinity false local false",
		"shop/lb:/TCP port 443 nodePort true affinity false local true",
		"shop/web:http/TCP port 80 nodePort false affinity false local false",
		"shop/web:https/TCP port 443 nodePort false affinity false local false",
	}
	if !slices.Equal(ports, wantPorts) {
		t.Errorf("service ports\n%s\nwant\n%s", strings.Join(ports, "\n"), strings.Join(wantPorts, "\n"))
	}
	eps, err := endpointsOf(slicesBySvc[types.NamespacedName{Namespace: "shop", Name: "web"}])
	if err != nil || len(eps["http"]) != 2 || len(eps["https"]) != 2 || !eps["http"][1].Terminating {
		t.Errorf("web endpoints %v, %v", eps, err)
	}
}

func TestChangesAreDelivered(t *testing.T) {
	f := newFixture(t, Options{})
	f.write(t, "a.yaml", service("a", 80, "")+"---\n"+service("b", 80, ""))
	f.write(t, "c.json", `{"apiVersion":"v1","kind":"Service","metadata":{"name":"c"},"spec":{"ports":[{"port":1}]}}`)
	f.scan(t)
	expect(t, "initial", f.rec, "add Service default/a", "add Service default/b", "add Service default/c")
	ipA := f.rec.svc(t, "default", "a").Spec.ClusterIP

	f.scan(t)
	expect(t, "rescan without changes", f.rec)

	f.write(t, "a.yaml", service("a", 81, "")+"---\n"+service("b", 80, ""))
	f.scan(t)
	expect(t, "port changed", f.rec, "update Service default/a")
	a := f.rec.svc(t, "default", "a")
	if a.Spec.Ports[0].Port != 81 || a.Spec.ClusterIP != ipA {
		t.Errorf("after update: port %d cluster IP %s (was %s)", a.Spec.Ports[0].Port, a.Spec.ClusterIP, ipA)
	}

	f.write(t, "a.yaml", service("a", 81, ""))
	f.scan(t)
	expect(t, "object removed from file", f.rec, "delete Service default/b")

	f.remove(t, "c.json")
	f.scan(t)
	expect(t, "file deleted", f.rec, "delete Service default/c")

	f.remove(t, "a.yaml")
	f.scan(t)
	expect(t, "last file deleted", f.rec, "delete Service default/a")
}

func TestSameSizeRewriteIsSeen(t *testing.T) {
	f := newFixture(t, Options{})
	f.write(t, "a.yaml", service("a", 80, ""))
	f.scan(t)
	expect(t, "initial", f.rec, "add Service default/a")
	// Same size, and the same mtime, as a rewrite within the file system's timestamp
	// granularity gives: only the content differs.
	fi, err := os.Stat(filepath.Join(f.dir, "a.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	f.write(t, "a.yaml", service("a", 81, ""))
	if err := os.Chtimes(filepath.Join(f.dir, "a.yaml"), fi.ModTime(), fi.ModTime()); err != nil {
		t.Fatal(err)
	}
	f.scan(t)
	expect(t, "same-size rewrite", f.rec, "update Service default/a")
}

func TestUnknownFieldKeepsLastGoodVersion(t *testing.T) {
	f := newFixture(t, Options{})
	f.write(t, "svc.yaml", service("a", 80, "")+"---\n"+service("b", 80, ""))
	f.scan(t)
	expect(t, "initial", f.rec, "add Service default/a", "add Service default/b")
	f.logs.take(t, zerolog.DebugLevel)

	// a gets a new port and a typo; b changes too and is fine.
	f.write(t, "svc.yaml", service("a", 81, "    prtocol: UDP\n")+"---\n"+service("b", 82, ""))
	f.scan(t)
	expect(t, "broken a, changed b", f.rec, "update Service default/b")
	if p := f.rec.svc(t, "default", "a").Spec.Ports[0].Port; p != 80 {
		t.Errorf("a serves port %d, want the last good 80", p)
	}
	errs := f.logs.take(t, zerolog.ErrorLevel)
	if len(errs) != 1 {
		t.Fatalf("logged errors %v, want 1", errs)
	}
	e := errs[0]
	if e["file"] != filepath.Join(f.dir, "svc.yaml") || e["object"] != "Service default/a" || e["field"] != "spec.ports[0].prtocol" ||
		e["where"] != "document 1 (line 1)" || !strings.Contains(fmt.Sprint(e["message"]), `unknown field "spec.ports[0].prtocol"`) {
		t.Errorf("error log %v does not name file, document, object and field", e)
	}

	// Rescans of the same content do not report again, even when the file is touched.
	f.scan(t)
	later := time.Now().Add(time.Hour)
	if err := os.Chtimes(filepath.Join(f.dir, "svc.yaml"), later, later); err != nil {
		t.Fatal(err)
	}
	f.scan(t)
	f.scan(t)
	expect(t, "rescans", f.rec)
	if errs := f.logs.take(t, zerolog.ErrorLevel); len(errs) != 0 {
		t.Errorf("the same broken content was reported again: %v", errs)
	}

	// Fixing it delivers the update.
	f.write(t, "svc.yaml", service("a", 81, "    protocol: UDP\n")+"---\n"+service("b", 82, ""))
	f.scan(t)
	expect(t, "fixed", f.rec, "update Service default/a")
	if a := f.rec.svc(t, "default", "a"); a.Spec.Ports[0].Port != 81 || a.Spec.Ports[0].Protocol != v1.ProtocolUDP {
		t.Errorf("a after the fix: %+v", a.Spec.Ports)
	}
}

func TestUnparsableFileKeepsItsObjects(t *testing.T) {
	f := newFixture(t, Options{})
	f.write(t, "svc.yaml", service("a", 80, "")+"---\n"+service("b", 80, ""))
	f.write(t, "other.yaml", service("c", 80, ""))
	f.scan(t)
	expect(t, "initial", f.rec, "add Service default/a", "add Service default/b", "add Service default/c")
	f.logs.take(t, zerolog.DebugLevel)

	f.write(t, "svc.yaml", "apiVersion: v1\nkind: Service\nmetadata: [oops\n")
	f.write(t, "other.yaml", service("c", 90, ""))
	f.scan(t)
	expect(t, "broken file", f.rec, "update Service default/c")
	if got := f.rec.served(); !slices.Equal(got, []string{"Service default/a", "Service default/b", "Service default/c"}) {
		t.Errorf("served %q", got)
	}
	// One error names the file and the line, one sums up: the file's objects keep serving.
	errs := f.logs.take(t, zerolog.ErrorLevel)
	if len(errs) != 2 || errs[0]["file"] != filepath.Join(f.dir, "svc.yaml") || !strings.Contains(fmt.Sprint(errs[0]["message"]), "line 3") ||
		errs[1]["file"] != filepath.Join(f.dir, "svc.yaml") || errs[1]["keptFromBefore"] != 2.0 ||
		!strings.Contains(fmt.Sprint(errs[1]["message"]), "cannot be decoded in full") {
		t.Errorf("errors %v, want one naming the file and line, and one saying the file's 2 objects keep serving", errs)
	}

	// Partly fixed: b is back but a's document is still unreadable, so a keeps serving.
	f.write(t, "svc.yaml", service("b", 85, "")+"---\nkind: [\n")
	f.scan(t)
	expect(t, "partly fixed", f.rec, "update Service default/b")

	// Fixed, without a: a is deleted now that the file can be read.
	f.write(t, "svc.yaml", service("b", 85, ""))
	f.scan(t)
	expect(t, "fixed", f.rec, "delete Service default/a")
}

func TestUnreadableFileKeepsItsObjects(t *testing.T) {
	f := newFixture(t, Options{})
	f.write(t, "svc.yaml", service("a", 80, ""))
	f.scan(t)
	expect(t, "initial", f.rec, "add Service default/a")
	// Make the file unreadable for the source. Permissions do not stop root, so use a file
	// over the size limit.
	big := make([]byte, maxFileSize+1)
	for i := range big {
		big[i] = '#'
	}
	if err := os.WriteFile(filepath.Join(f.dir, "svc.yaml"), big, 0o644); err != nil {
		t.Fatal(err)
	}
	f.logs.take(t, zerolog.DebugLevel)
	f.scan(t)
	f.scan(t)
	expect(t, "unreadable", f.rec)
	if errs := f.logs.take(t, zerolog.ErrorLevel); len(errs) != 1 || !strings.Contains(fmt.Sprint(errs[0]["error"]), "larger than the limit") {
		t.Errorf("errors %v, want one about the size", errs)
	}
	f.write(t, "svc.yaml", service("a", 81, ""))
	f.scan(t)
	expect(t, "readable again", f.rec, "update Service default/a")
}

func TestDuplicateAcrossFiles(t *testing.T) {
	f := newFixture(t, Options{})
	f.write(t, "b.yaml", service("x", 80, ""))
	f.scan(t)
	expect(t, "initial", f.rec, "add Service default/x")
	f.logs.take(t, zerolog.DebugLevel)

	// a.yaml sorts first, but b.yaml served x before: b.yaml keeps serving it.
	f.write(t, "a.yaml", service("x", 81, ""))
	f.scan(t)
	expect(t, "duplicate added", f.rec)
	errs := f.logs.take(t, zerolog.ErrorLevel)
	if len(errs) != 1 {
		t.Fatalf("errors %v, want 1", errs)
	}
	msg := fmt.Sprint(errs[0]["message"])
	if errs[0]["object"] != "Service default/x" || !strings.Contains(msg, filepath.Join(f.dir, "a.yaml")) || !strings.Contains(msg, filepath.Join(f.dir, "b.yaml")) {
		t.Errorf("duplicate error %v does not name the object and both files", errs[0])
	}
	if p := f.rec.svc(t, "default", "x").Spec.Ports[0].Port; p != 80 {
		t.Errorf("x serves port %d, want b.yaml's 80", p)
	}
	f.scan(t)
	if errs := f.logs.take(t, zerolog.ErrorLevel); len(errs) != 0 {
		t.Errorf("duplicate reported again: %v", errs)
	}

	// Removing b.yaml leaves a.yaml's version.
	f.remove(t, "b.yaml")
	f.scan(t)
	expect(t, "duplicate resolved", f.rec, "update Service default/x")
	if p := f.rec.svc(t, "default", "x").Spec.Ports[0].Port; p != 81 {
		t.Errorf("x serves port %d, want a.yaml's 81", p)
	}

	// At start-up, the file sorting first wins.
	g := newFixture(t, Options{})
	g.write(t, "z.yaml", service("x", 90, ""))
	g.write(t, "m.yaml", service("x", 91, ""))
	g.scan(t)
	if p := g.rec.svc(t, "default", "x").Spec.Ports[0].Port; p != 91 {
		t.Errorf("x serves port %d, want m.yaml's 91", p)
	}
}

func TestIgnoredFiles(t *testing.T) {
	f := newFixture(t, Options{})
	for _, name := range []string{"notes.txt", ".hidden.yaml", "a.yaml~", "#a.yaml#", "a.yaml.swp", "README"} {
		f.write(t, name, service("ignored", 80, ""))
	}
	if err := os.Mkdir(filepath.Join(f.dir, "sub.yaml"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(f.dir, "sub.yaml", "in-subdir.yaml"), []byte(service("subdir", 80, "")), 0o644); err != nil {
		t.Fatal(err)
	}
	// Symlinks are followed (a mounted ConfigMap is made of them); dangling ones are ignored.
	target := filepath.Join(t.TempDir(), "real.yaml")
	if err := os.WriteFile(target, []byte(service("linked", 80, "")), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, filepath.Join(f.dir, "linked.yaml")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(f.dir, "nowhere.yaml"), filepath.Join(f.dir, "dangling.yaml")); err != nil {
		t.Fatal(err)
	}
	f.scan(t)
	expect(t, "scan", f.rec, "add Service default/linked")
	if errs := f.logs.take(t, zerolog.WarnLevel); len(errs) != 0 {
		t.Errorf("problems logged: %v", errs)
	}
}

func TestOtherKindsLoggedAtDebug(t *testing.T) {
	f := newFixture(t, Options{})
	f.write(t, "a.yaml", "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n---\n"+service("a", 80, ""))
	f.scan(t)
	expect(t, "scan", f.rec, "add Service default/a")
	var found bool
	for _, l := range f.logs.take(t, zerolog.DebugLevel) {
		if l["kind"] == "Deployment" && l["level"] == "debug" && l["where"] == "document 1 (line 1)" {
			found = true
		}
		if l["level"] == "warn" || l["level"] == "error" {
			t.Errorf("unexpected problem logged: %v", l)
		}
	}
	if !found {
		t.Error("no debug log about the ignored Deployment")
	}
}

func TestDualStackServiceCIDRs(t *testing.T) {
	cidrs, err := ParseServiceCIDRs("10.96.0.0/16,fd00:10:96::/112")
	if err != nil {
		t.Fatal(err)
	}
	f := newFixture(t, Options{ServiceCIDRs: cidrs})
	f.write(t, "a.yaml", service("single", 80, "")+"---\n"+service("dual", 80, "  ipFamilyPolicy: PreferDualStack\n")+"---\n"+
		service("six", 80, "  ipFamilies: [IPv6]\n"))
	f.scan(t)
	tests := []struct {
		name     string
		prefixes []string
	}{
		{"single", []string{"10.96."}},
		{"dual", []string{"10.96.", "fd00:10:96::"}},
		{"six", []string{"fd00:10:96::"}},
	}
	for _, tc := range tests {
		s := f.rec.svc(t, "default", tc.name)
		if len(s.Spec.ClusterIPs) != len(tc.prefixes) {
			t.Errorf("%s: cluster IPs %v, want %d", tc.name, s.Spec.ClusterIPs, len(tc.prefixes))
			continue
		}
		for i, p := range tc.prefixes {
			if !strings.HasPrefix(s.Spec.ClusterIPs[i], p) {
				t.Errorf("%s: clusterIPs[%d] = %s, want prefix %s", tc.name, i, s.Spec.ClusterIPs[i], p)
			}
		}
		sps, err := proxy.FromService(s)
		if err != nil || len(sps) != 1 || len(sps[0].ClusterIPs) != len(tc.prefixes) {
			t.Errorf("%s: model gives %v, %v", tc.name, sps, err)
		}
	}
}

func TestAllocationProblems(t *testing.T) {
	f := newFixture(t, Options{})
	f.write(t, "a.yaml", service("out", 80, "  clusterIP: 172.16.0.9\n"))
	f.scan(t)
	expect(t, "explicit outside range", f.rec, "add Service default/out")
	warns := f.logs.take(t, zerolog.WarnLevel)
	if len(warns) != 1 || warns[0]["level"] != "warn" || !strings.Contains(fmt.Sprint(warns[0]["message"]), "outside the service CIDRs") {
		t.Errorf("logs %v, want one warning about the range", warns)
	}

	f.write(t, "a.yaml", service("out", 81, "  clusterIP: 172.16.0.9\n"))
	f.scan(t)
	expect(t, "unchanged warning", f.rec, "update Service default/out")
	if warns := f.logs.take(t, zerolog.WarnLevel); len(warns) != 0 {
		t.Errorf("warning repeated: %v", warns)
	}

	// A fatal problem (dual-stack required on a single-stack range) keeps the last version.
	f.write(t, "a.yaml", service("out", 82, "  clusterIP: 172.16.0.9\n  ipFamilyPolicy: RequireDualStack\n"))
	f.scan(t)
	expect(t, "fatal", f.rec)
	if p := f.rec.svc(t, "default", "out").Spec.Ports[0].Port; p != 81 {
		t.Errorf("port %d, want the last good 81", p)
	}
	errs := f.logs.take(t, zerolog.ErrorLevel)
	if len(errs) != 1 || !strings.Contains(fmt.Sprint(errs[0]["message"]), "RequireDualStack") {
		t.Errorf("errors %v", errs)
	}
}

// Many problems at once (a directory whose services all sit outside the service CIDRs): the
// first maxProblemLines are logged a line each, the rest in one line that counts them.
func TestProblemsLoggedBounded(t *testing.T) {
	f := newFixture(t, Options{})
	const n = maxProblemLines + 15
	var content strings.Builder
	for i := range n {
		fmt.Fprintf(&content, "---\n%s", service(fmt.Sprintf("out%d", i), 80, fmt.Sprintf("  clusterIP: 172.16.0.%d\n", i+1)))
	}
	f.write(t, "a.yaml", content.String())
	f.scan(t)
	warns := f.logs.take(t, zerolog.WarnLevel)
	if len(warns) != maxProblemLines+1 {
		t.Fatalf("%d warnings, want %d and a summary: %v", len(warns), maxProblemLines, warns)
	}
	for _, w := range warns[:maxProblemLines] {
		if !strings.Contains(fmt.Sprint(w["message"]), "outside the service CIDRs") || w["object"] == nil {
			t.Errorf("warning %v, want one about an object's range", w)
		}
	}
	if sum := warns[maxProblemLines]; fmt.Sprint(sum["problems"]) != "15" || !strings.Contains(fmt.Sprint(sum["message"]), "15 more objects") {
		t.Errorf("summary %v, want 15 more problems", sum)
	}
	// Nothing new: nothing logged again.
	f.write(t, "a.yaml", content.String()+"---\n"+service("in", 80, ""))
	f.scan(t)
	if warns := f.logs.take(t, zerolog.WarnLevel); len(warns) != 0 {
		t.Errorf("problems logged again: %v", warns)
	}
}

func TestClusterIPStableAcrossRestarts(t *testing.T) {
	dir := t.TempDir()
	var content strings.Builder
	for i := 0; i < 300; i++ {
		fmt.Fprintf(&content, "---\n%s", service(fmt.Sprintf("s%d", i), 80, ""))
	}
	if err := os.WriteFile(filepath.Join(dir, "all.yaml"), []byte(content.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	ips := func() map[string]string {
		_, _, r := scannedSource(t, dir, Options{}, nil)
		out := map[string]string{}
		for k, o := range r.objects {
			out[k] = o.(*v1.Service).Spec.ClusterIP
		}
		return out
	}
	first, second := ips(), ips()
	if len(first) != 300 || !mapsEqual(first, second) {
		t.Errorf("cluster IPs differ between two starts (%d services)", len(first))
	}
}

func TestRun(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "a.yaml"), []byte(service("a", 80, "")), 0o644); err != nil {
		t.Fatal(err)
	}
	r := newRec(t)
	s := New(dir, Options{Interval: 10 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx, r) }()

	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.After(hangGuard)
		for {
			r.mu.Lock()
			ok := cond()
			r.mu.Unlock()
			if ok {
				return
			}
			select {
			case <-r.notify:
			case <-deadline:
				t.Fatalf("never saw %s", what)
			}
		}
	}
	waitFor("OnSynced", func() bool { return r.synced == 1 })
	r.mu.Lock()
	if len(r.events) != 1 || r.events[0].String() != "add Service default/a" {
		t.Errorf("before OnSynced: %v, want the add of a", r.events)
	}
	r.events = nil
	r.mu.Unlock()

	if err := os.WriteFile(filepath.Join(dir, "b.yaml"), []byte(service("b", 80, "")), 0o644); err != nil {
		t.Fatal(err)
	}
	waitFor("the add of b", func() bool { return len(r.events) > 0 })
	if err := s.Run(ctx, r); err == nil {
		t.Error("second Run returned nil")
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run returned %v", err)
	}
	if got := r.take(); len(got) != 1 || got[0].String() != "add Service default/b" || r.synced != 1 {
		t.Errorf("events %v, synced %d", got, r.synced)
	}
}

func TestRunErrors(t *testing.T) {
	tests := []struct {
		name string
		dir  string
		opts Options
		want string
	}{
		{"missing directory", filepath.Join(t.TempDir(), "nope"), Options{}, "read directory"},
		{"two IPv4 ranges", t.TempDir(), Options{ServiceCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/16"), netip.MustParsePrefix("10.1.0.0/16")}}, "same IP family"},
		{"range too small", t.TempDir(), Options{ServiceCIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/31")}}, "too small"},
		{"negative interval", t.TempDir(), Options{Interval: -time.Second}, "interval -1s is negative"},
		{"negative debounce", t.TempDir(), Options{Debounce: -time.Second}, "debounce -1s is negative"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := newRec(t)
			err := New(tc.dir, tc.opts).Run(context.Background(), r)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Run = %v, want an error containing %q", err, tc.want)
			}
			if r.synced != 0 {
				t.Error("OnSynced called")
			}
		})
	}
}

func TestParseServiceCIDRs(t *testing.T) {
	tests := []struct {
		in      string
		want    []string
		wantErr string
	}{
		{in: "10.96.0.0/16", want: []string{"10.96.0.0/16"}},
		{in: "10.96.0.0/16,fd00::/108", want: []string{"10.96.0.0/16", "fd00::/108"}},
		{in: "fd00::/108, 10.96.0.0/16", want: []string{"fd00::/108", "10.96.0.0/16"}},
		{in: "10.96.0.0/16,10.97.0.0/16", wantErr: "same IP family"},
		{in: "10.96.0.0/16,fd00::/108,fd01::/108", wantErr: "at most two"},
		{in: "10.96.0.0", wantErr: "no '/'"},
		{in: "", wantErr: "parse"},
		{in: "10.0.0.0/32", wantErr: "too small"},
	}
	for _, tc := range tests {
		got, err := ParseServiceCIDRs(tc.in)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("ParseServiceCIDRs(%q) error %v, want %q", tc.in, err, tc.wantErr)
			}
			continue
		}
		var s []string
		for _, p := range got {
			s = append(s, p.String())
		}
		if err != nil || !slices.Equal(s, tc.want) {
			t.Errorf("ParseServiceCIDRs(%q) = %v, %v; want %v", tc.in, s, err, tc.want)
		}
	}
}

func TestObjectMovedOutOfBrokenFile(t *testing.T) {
	f := newFixture(t, Options{})
	f.write(t, "a.yaml", service("x", 80, ""))
	f.scan(t)
	expect(t, "initial", f.rec, "add Service default/x")
	f.logs.take(t, zerolog.DebugLevel)
	// a.yaml breaks (x is kept from it) while x moves to b.yaml: the fresh copy wins, silently.
	f.write(t, "a.yaml", "kind: [\n")
	f.write(t, "b.yaml", service("x", 81, ""))
	f.scan(t)
	expect(t, "moved", f.rec, "update Service default/x")
	if p := f.rec.svc(t, "default", "x").Spec.Ports[0].Port; p != 81 {
		t.Errorf("x serves port %d, want b.yaml's 81", p)
	}
	for _, l := range f.logs.take(t, zerolog.ErrorLevel) {
		if strings.Contains(fmt.Sprint(l["message"]), "more than one file") {
			t.Errorf("a kept copy was reported as a duplicate: %v", l)
		}
	}
}

// sliceYAML is an EndpointSlice of service svc with one ready endpoint ip:8080.
func sliceYAML(name, svc, ip string) string {
	return fmt.Sprintf("apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: %s\n  labels: {kubernetes.io/service-name: %s}\n"+
		"addressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints:\n- addresses: [%q]\n", name, svc, ip)
}

// TestSlicesKeptEncoded: once a scan has delivered them, the source holds no decoded
// EndpointSlice, only its encoding (see sliceDoc); the paths that hand out a slice decoded in an
// earlier scan (an update's previous version, a delete, another file's copy taking over) decode
// it again, into the object the first decode gave.
func TestSlicesKeptEncoded(t *testing.T) {
	f := newFixture(t, Options{})
	f.write(t, "a.yaml", service("web", 80, "")+"---\n"+sliceYAML("web-1", "web", "10.0.0.1"))
	f.write(t, "b.yaml", sliceYAML("web-1", "web", "10.0.0.2")) // a duplicate: a.yaml's is served
	f.scan(t)
	expect(t, "initial", f.rec, "add Service default/web", "add EndpointSlice default/web-1")
	decoded := func() int {
		n := 0
		for _, st := range f.src.files {
			for _, e := range st.objects {
				if e.slice != nil && e.slice.obj != nil {
					n++
				}
			}
		}
		return n
	}
	if n := decoded(); n != 0 {
		t.Fatalf("%d decoded EndpointSlices held after the scan, want 0", n)
	}
	served := func() string {
		f.rec.mu.Lock()
		defer f.rec.mu.Unlock()
		s, _ := f.rec.objects["EndpointSlice default/web-1"].(*discovery.EndpointSlice)
		if s == nil || len(s.Endpoints) != 1 || len(s.Endpoints[0].Addresses) != 1 {
			t.Fatalf("web-1 served as %+v", s)
		}
		return s.Endpoints[0].Addresses[0]
	}
	if ip := served(); ip != "10.0.0.1" {
		t.Fatalf("web-1 serves %s, want a.yaml's 10.0.0.1", ip)
	}

	// a.yaml loses its slice: b.yaml's copy, decoded two scans ago, takes over. The update's
	// previous version is a.yaml's, decoded again (rec checks it equals what it was given).
	f.write(t, "a.yaml", service("web", 80, ""))
	f.scan(t)
	expect(t, "b.yaml's copy served", f.rec, "update EndpointSlice default/web-1")
	if ip := served(); ip != "10.0.0.2" {
		t.Fatalf("web-1 serves %s, want b.yaml's 10.0.0.2", ip)
	}
	// The same content written again delivers nothing (compared by encoding).
	f.write(t, "b.yaml", "# a comment\n"+sliceYAML("web-1", "web", "10.0.0.2"))
	f.scan(t)
	expect(t, "same slice rewritten", f.rec)
	f.remove(t, "b.yaml")
	f.scan(t)
	expect(t, "b.yaml removed", f.rec, "delete EndpointSlice default/web-1")
	if n := decoded(); n != 0 {
		t.Fatalf("%d decoded EndpointSlices held, want 0", n)
	}
}

// ParseServiceCIDRs parses kube-apiserver's --service-cluster-ip-range syntax: one CIDR, or an
// IPv4 and an IPv6 CIDR separated by a comma (the first is the primary family).
func ParseServiceCIDRs(s string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, part := range strings.Split(s, ",") {
		p, err := netip.ParsePrefix(strings.TrimSpace(part))
		if err != nil {
			return nil, fmt.Errorf("parse service CIDRs %q: %w", s, err)
		}
		out = append(out, p)
	}
	if err := validateCIDRs(out); err != nil {
		return nil, fmt.Errorf("parse service CIDRs %q: %w", s, err)
	}
	return out, nil
}

// endpointsOf merges one service's EndpointSlices into endpoints per port name, as the Tracker
// does (proxy.FromSlice per slice, then proxy.MergeSlices).
func endpointsOf(slices []*discovery.EndpointSlice) (map[string][]proxy.Endpoint, error) {
	each := make([]proxy.SliceEndpoints, 0, len(slices))
	for _, s := range slices {
		if s != nil {
			each = append(each, proxy.FromSlice(s))
		}
	}
	eps, err := proxy.MergeSlices(each)
	out := make(map[string][]proxy.Endpoint, len(eps))
	for _, pe := range eps {
		out[pe.Port] = pe.Endpoints
	}
	return out, err
}
