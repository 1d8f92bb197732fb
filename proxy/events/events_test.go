package events

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// memSink records what a Recorder writes. Its Create fails with the errors of failCreate first.
type memSink struct {
	created    []*eventsv1.Event
	patches    map[string][]eventsv1.EventSeries // by namespace/name
	services   map[string]types.UID              // namespace/name → UID
	failCreate []error
	creates    int
}

func newMemSink() *memSink {
	return &memSink{patches: map[string][]eventsv1.EventSeries{}, services: map[string]types.UID{}}
}

func (s *memSink) Create(_ context.Context, ev *eventsv1.Event) (string, error) {
	s.creates++
	if len(s.failCreate) > 0 {
		err := s.failCreate[0]
		s.failCreate = s.failCreate[1:]
		return "", err
	}
	s.created = append(s.created, ev.DeepCopy())
	return ev.Name, nil
}

func (s *memSink) PatchSeries(_ context.Context, ns, name string, series eventsv1.EventSeries) error {
	s.patches[ns+"/"+name] = append(s.patches[ns+"/"+name], series)
	return nil
}

func (s *memSink) ServiceUID(_ context.Context, ns, name string) (types.UID, bool, error) {
	uid, ok := s.services[ns+"/"+name]
	return uid, ok, nil
}

// clock is a settable time.
type clock struct{ t time.Time }

func (c *clock) now() time.Time      { return c.t }
func (c *clock) add(d time.Duration) { c.t = c.t.Add(d) }
func newClock() *clock               { return &clock{t: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)} }
func drain(r *Recorder, ctx context.Context) {
	for {
		select {
		case ev := <-r.queue:
			r.write(ctx, ev)
		default:
			return
		}
	}
}

var web = types.NamespacedName{Namespace: "ns", Name: "web"}

func TestNodeStarted(t *testing.T) {
	sink, c := newMemSink(), newClock()
	r := New(Options{Sink: sink, Instance: "kube-userspace-proxy-host1", Now: c.now})
	r.NodeStarted("node1")
	drain(r, context.Background())
	if len(sink.created) != 1 {
		t.Fatalf("created %d events, want 1", len(sink.created))
	}
	ev := sink.created[0]
	want := v1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: "node1"}
	if ev.Regarding != want || ev.Type != v1.EventTypeNormal || ev.Reason != "Starting" || ev.Action != "StartKubeProxy" ||
		ev.Note != "" || ev.Namespace != "default" || ev.ReportingController != Controller ||
		ev.ReportingInstance != "kube-userspace-proxy-host1" || !ev.EventTime.Time.Equal(c.t) || ev.Series != nil {
		t.Errorf("start event %+v", ev)
	}
	if !strings.HasPrefix(ev.Name, "node1.") {
		t.Errorf("event name %q, want node1.<hex time>", ev.Name)
	}
}

// TestAggregated: the same problem reported again is counted in the first Event's series,
// written at the next flush; a different note is an Event of its own.
func TestAggregated(t *testing.T) {
	sink, c := newMemSink(), newClock()
	r := New(Options{Sink: sink, Now: c.now})
	ctx := context.Background()
	p := proxy.Problem{Service: web, UID: "u1", Reason: proxy.ReasonInvalidField, Message: "metadata.annotations[x]: invalid"}
	for range 5 {
		r.Problem(p)
		c.add(time.Second)
	}
	drain(r, ctx)
	if len(sink.created) != 1 {
		t.Fatalf("created %d events for one problem reported 5 times, want 1", len(sink.created))
	}
	ev := sink.created[0]
	if ev.Regarding.Kind != "Service" || ev.Regarding.Namespace != "ns" || ev.Regarding.Name != "web" || ev.Regarding.UID != "u1" ||
		ev.Type != v1.EventTypeWarning || ev.Reason != proxy.ReasonInvalidField || ev.Note != p.Message || ev.Namespace != "ns" {
		t.Errorf("problem event %+v", ev)
	}
	r.flush(ctx)
	got := sink.patches["ns/"+ev.Name]
	if len(got) != 1 || got[0].Count != 5 {
		t.Fatalf("series patches %+v, want one with count 5", got)
	}
	r.flush(ctx) // nothing new: no patch
	if n := len(sink.patches["ns/"+ev.Name]); n != 1 {
		t.Errorf("%d patches after a flush with nothing new, want 1", n)
	}

	p2 := p
	p2.Message = "metadata.annotations[x]: another"
	r.Problem(p2)
	drain(r, ctx)
	if len(sink.created) != 2 {
		t.Errorf("a different note: %d events, want 2", len(sink.created))
	}

	// Past the series window the same problem is a new Event.
	c.add(DefaultSeriesWindow)
	r.flush(ctx)
	r.Problem(p)
	drain(r, ctx)
	if len(sink.created) != 3 {
		t.Errorf("after the series window: %d events, want 3", len(sink.created))
	}
}

// TestRateLimitedPerObject: one object gets Burst events at once, then one per Refill; another
// object is not held back by it.
func TestRateLimitedPerObject(t *testing.T) {
	sink, c := newMemSink(), newClock()
	r := New(Options{Sink: sink, Now: c.now, Burst: 3, Refill: time.Minute, Queue: 100})
	ctx := context.Background()
	for i := range 10 {
		r.Problem(proxy.Problem{Service: web, UID: "u1", Reason: proxy.ReasonInvalidField, Message: fmt.Sprint("note ", i)})
	}
	r.Problem(proxy.Problem{Service: types.NamespacedName{Namespace: "ns", Name: "other"}, UID: "u2", Reason: proxy.ReasonInvalidField, Message: "x"})
	drain(r, ctx)
	if len(sink.created) != 4 {
		t.Fatalf("created %d, want 3 for web (its burst) and 1 for other", len(sink.created))
	}
	if r.Dropped() != 7 {
		t.Errorf("dropped %d, want 7", r.Dropped())
	}
	c.add(time.Minute)
	for i := range 3 {
		r.Problem(proxy.Problem{Service: web, UID: "u1", Reason: proxy.ReasonInvalidField, Message: fmt.Sprint("later ", i)})
	}
	drain(r, ctx)
	if len(sink.created) != 5 {
		t.Errorf("a minute later: created %d in all, want one more (5)", len(sink.created))
	}
}

// TestQueueBounded: Record never blocks; what does not fit is dropped and counted.
func TestQueueBounded(t *testing.T) {
	r := New(Options{Sink: newMemSink(), Queue: 2})
	for range 5 {
		r.NodeStarted("n")
	}
	if r.Dropped() != 3 {
		t.Errorf("dropped %d, want 3", r.Dropped())
	}
	var nilRec *Recorder
	nilRec.NodeStarted("n") // a nil Recorder records nothing
	nilRec.Problem(proxy.Problem{})
	if nilRec.Dropped() != 0 {
		t.Error("nil Recorder counted drops")
	}
}

// TestServiceUIDResolved: a Problem without the Service's UID gets it from the sink; one whose
// Service is gone is dropped.
func TestServiceUIDResolved(t *testing.T) {
	sink := newMemSink()
	sink.services["ns/web"] = "uid-web"
	r := New(Options{Sink: sink})
	r.Problem(proxy.Problem{Service: web, Reason: proxy.ReasonProxyPortExhausted, Message: "m"})
	r.Problem(proxy.Problem{Service: types.NamespacedName{Namespace: "ns", Name: "gone"}, Reason: proxy.ReasonProxyPortExhausted, Message: "m"})
	drain(r, context.Background())
	if len(sink.created) != 1 || sink.created[0].Regarding.UID != "uid-web" {
		t.Fatalf("created %+v, want one event on web with its UID", sink.created)
	}
	if r.Dropped() != 1 {
		t.Errorf("dropped %d, want 1 (the gone Service)", r.Dropped())
	}
}

func TestNoteTruncated(t *testing.T) {
	sink := newMemSink()
	r := New(Options{Sink: sink})
	r.Problem(proxy.Problem{Service: web, UID: "u", Reason: proxy.ReasonInvalidField, Message: strings.Repeat("é", 600)})
	drain(r, context.Background())
	n := sink.created[0].Note
	if len(n) > 1024 || !strings.HasSuffix(n, "…") || !strings.HasPrefix(n, "éé") {
		t.Errorf("note of %d bytes: %q…", len(n), n[:10])
	}
	for _, r := range n {
		if r == '\uFFFD' {
			t.Fatal("note cut inside a character")
		}
	}
}

// TestCreateRetried: a create that did not reach the API server is tried again; one the server
// refused is not.
func TestCreateRetried(t *testing.T) {
	sink := newMemSink()
	sink.failCreate = []error{errors.New("connection refused"), errors.New("connection refused")}
	r := New(Options{Sink: sink, RetryBackoff: time.Millisecond})
	r.NodeStarted("n")
	drain(r, context.Background())
	if len(sink.created) != 1 || sink.creates != 3 {
		t.Errorf("created %d after %d attempts, want 1 after 3", len(sink.created), sink.creates)
	}

	sink = newMemSink()
	sink.failCreate = []error{apierrors.NewForbidden(schema.GroupResource{Group: "events.k8s.io", Resource: "events"}, "x", errors.New("no"))}
	r = New(Options{Sink: sink, RetryBackoff: time.Millisecond})
	r.NodeStarted("n")
	drain(r, context.Background())
	if sink.creates != 1 || len(sink.created) != 0 {
		t.Errorf("forbidden: %d attempts, %d created; want 1, 0", sink.creates, len(sink.created))
	}
	// Not remembered: the next occurrence is tried anew.
	r.NodeStarted("n")
	drain(r, context.Background())
	if len(sink.created) != 1 {
		t.Errorf("after a refused create, the next one: %d created, want 1", len(sink.created))
	}
}

// TestRunStops: Run writes what is queued and returns when its context ends.
func TestRunStops(t *testing.T) {
	sink := &syncSink{memSink: newMemSink(), created: make(chan struct{}, 1)}
	r := New(Options{Sink: sink})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.Run(ctx); close(done) }()
	r.NodeStarted("n")
	<-sink.created
	cancel()
	<-done
	var nilRec *Recorder
	ctx2, cancel2 := context.WithCancel(context.Background())
	cancel2()
	nilRec.Run(ctx2) // returns at once
}

type syncSink struct {
	*memSink
	created chan struct{}
}

func (s *syncSink) Create(ctx context.Context, ev *eventsv1.Event) (string, error) {
	name, err := s.memSink.Create(ctx, ev)
	s.created <- struct{}{}
	return name, err
}
