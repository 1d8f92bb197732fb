// Package events writes the proxy's Kubernetes Events (events.k8s.io/v1): the Normal "Starting"
// Event on its Node that kube-proxy records at start, and a Warning Event on each Service the
// proxy cannot serve as it asks (proxy.Problem), so that `kubectl describe service` says why.
//
// A Recorder takes events without blocking (a bounded queue; what does not fit is dropped and
// counted) and writes them from its own goroutine (Run), so neither a sync nor the source ever
// waits for the API server. Like client-go's event broadcaster it aggregates: an event
// identical to one written in the last SeriesWindow (same object, type, reason, action and note)
// is not written again but counted in the first one's series, which is patched at most once per
// FlushInterval. A token bucket per object (Burst events, one more per Refill) bounds what one
// object can cause, whatever its churn: one bad Service cannot flood the API server.
//
// The package's own REST client (NewRESTSink) asks for events.k8s.io/v1 and Services only, so
// that client-go's clientset (every API group of Kubernetes) stays out of the binary.
//
// A nil *Recorder records nothing: the manifests source, which has no API server, uses one.
package events

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
)

// Controller is the reportingController of the proxy's Events.
const Controller = "kube-userspace-proxy"

// The Node start Event, as kube-proxy records it (cmd/kube-proxy/app: its "birth cry").
const (
	ReasonStarting = "Starting"
	ActionStart    = "StartKubeProxy"
)

// ActionServe is the action of the Warning Events on Services: serving them.
const ActionServe = "ServeService"

// Defaults of Options.
const (
	DefaultQueue         = 256
	DefaultBurst         = 10
	DefaultRefill        = time.Minute
	DefaultSeriesWindow  = 6 * time.Minute
	DefaultFlushInterval = 30 * time.Second
)

// noteLimit is the API server's bound on an Event's note, in bytes.
const noteLimit = 1024

// Sink is where a Recorder writes: the API server (NewRESTSink) or a test's double.
type Sink interface {
	// Create creates ev and returns the name it got.
	Create(ctx context.Context, ev *eventsv1.Event) (string, error)
	// PatchSeries sets the series of the Event namespace/name (a JSON merge patch).
	PatchSeries(ctx context.Context, namespace, name string, series eventsv1.EventSeries) error
	// ServiceUID returns the UID of the Service namespace/name, and false when there is none.
	ServiceUID(ctx context.Context, namespace, name string) (types.UID, bool, error)
}

// Options configures a Recorder. Sink is required; zero values take the defaults.
type Options struct {
	Sink Sink
	// Instance is the reportingInstance; empty means Controller-<hostname>, as client-go names it.
	Instance string
	// Log receives what could not be written; the zero value logs nothing.
	Log zerolog.Logger
	// Queue bounds the events waiting to be written (DefaultQueue).
	Queue int
	// Burst and Refill are each object's token bucket: Burst events at once, one more per Refill.
	Burst  int
	Refill time.Duration
	// SeriesWindow is how long an event is aggregated into after it last happened.
	SeriesWindow time.Duration
	// FlushInterval is how often the counts of aggregated events are written.
	FlushInterval time.Duration
	// Retries is how many times a create that failed on the way to the API server is tried
	// again (its backoff doubles from RetryBackoff); 3 and 1 s when zero.
	Retries      int
	RetryBackoff time.Duration
	// Now returns the current time; nil means time.Now.
	Now func() time.Time
}

// Event is one event to record.
type Event struct {
	Regarding v1.ObjectReference
	Type      string // v1.EventTypeNormal or v1.EventTypeWarning
	Reason    string
	Action    string
	Note      string
}

// Recorder queues events and writes them in Run.
type Recorder struct {
	opts    Options
	queue   chan Event
	dropped atomic.Int64
	// Owned by Run's goroutine:
	series  map[key]*entry
	buckets map[objKey]*bucket
}

// key identifies isomorphic events: written once, counted in a series after.
type key struct {
	obj                       objKey
	typ, reason, action, note string
}

type objKey struct {
	kind, namespace, name string
	uid                   types.UID
}

type entry struct {
	namespace, name string // the Event written
	count           int32
	last            time.Time // last occurrence
	dirty           bool      // count not written yet
}

type bucket struct {
	tokens float64
	at     time.Time
}

// New returns a Recorder writing to opts.Sink once Run runs.
func New(opts Options) *Recorder {
	if opts.Instance == "" {
		host, _ := os.Hostname()
		opts.Instance = Controller + "-" + host
	}
	if len(opts.Instance) > 128 {
		opts.Instance = opts.Instance[:128]
	}
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	defDur := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	def(&opts.Queue, DefaultQueue)
	def(&opts.Burst, DefaultBurst)
	def(&opts.Retries, 3)
	defDur(&opts.Refill, DefaultRefill)
	defDur(&opts.SeriesWindow, DefaultSeriesWindow)
	defDur(&opts.FlushInterval, DefaultFlushInterval)
	defDur(&opts.RetryBackoff, time.Second)
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return &Recorder{opts: opts, queue: make(chan Event, opts.Queue), series: map[key]*entry{}, buckets: map[objKey]*bucket{}}
}

// NodeStarted records the Normal "Starting" Event on the Node nodeName, as kube-proxy does at
// start (reason Starting, action StartKubeProxy, no note, the Node referred to without UID).
func (r *Recorder) NodeStarted(nodeName string) {
	r.Record(Event{
		Regarding: v1.ObjectReference{APIVersion: "v1", Kind: "Node", Name: nodeName},
		Type:      v1.EventTypeNormal, Reason: ReasonStarting, Action: ActionStart,
	})
}

// Problem records a Warning Event on the Service of p (proxy.Options.OnProblem's signature). A
// Problem without the Service's UID gets it from the Sink when it is written, and is dropped if
// the Service is gone by then.
func (r *Recorder) Problem(p proxy.Problem) {
	r.Record(Event{
		Regarding: v1.ObjectReference{APIVersion: "v1", Kind: "Service", Namespace: p.Service.Namespace, Name: p.Service.Name, UID: p.UID},
		Type:      v1.EventTypeWarning, Reason: p.Reason, Action: ActionServe, Note: p.Message,
	})
}

// Record queues ev without blocking: when the queue is full it is dropped (and counted in
// Dropped). A nil Recorder records nothing.
func (r *Recorder) Record(ev Event) {
	if r == nil {
		return
	}
	select {
	case r.queue <- ev:
	default:
		r.dropped.Add(1)
	}
}

// Dropped returns how many events were dropped: the queue was full, the object's bucket empty,
// or their Service gone.
func (r *Recorder) Dropped() int64 {
	if r == nil {
		return 0
	}
	return r.dropped.Load()
}

// Run writes the queued events until ctx is done, then returns at once (what is still queued is
// dropped: the process is ending). A nil Recorder waits for ctx.
func (r *Recorder) Run(ctx context.Context) {
	if r == nil {
		<-ctx.Done()
		return
	}
	t := time.NewTicker(r.opts.FlushInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case ev := <-r.queue:
			r.write(ctx, ev)
		case <-t.C:
			r.flush(ctx)
		}
	}
}

// write writes ev, or counts it in the series of an isomorphic event.
func (r *Recorder) write(ctx context.Context, ev Event) {
	now := r.opts.Now()
	ref := ev.Regarding
	if ref.UID == "" && ref.Kind == "Service" {
		uid, ok, err := r.opts.Sink.ServiceUID(ctx, ref.Namespace, ref.Name)
		if err != nil || !ok {
			r.dropped.Add(1)
			if err != nil {
				r.opts.Log.Warn().Err(err).Str("service", ref.Namespace+"/"+ref.Name).Str("reason", ev.Reason).Msg("event not written: cannot find the Service")
			}
			return
		}
		ref.UID = uid
	}
	ev.Note = truncate(ev.Note, noteLimit)
	k := key{obj: objKey{ref.Kind, ref.Namespace, ref.Name, ref.UID}, typ: ev.Type, reason: ev.Reason, action: ev.Action, note: ev.Note}
	if e := r.series[k]; e != nil && now.Sub(e.last) < r.opts.SeriesWindow {
		e.count++
		e.last = now
		e.dirty = true
		return
	}
	if !r.take(k.obj, now) {
		r.dropped.Add(1)
		return
	}
	ns := ref.Namespace
	if ns == "" {
		ns = metav1.NamespaceDefault // where events about cluster-scoped objects go
	}
	obj := &eventsv1.Event{
		ObjectMeta: metav1.ObjectMeta{
			Name:      ref.Name + "." + strconv.FormatInt(now.UnixNano(), 16),
			Namespace: ns,
		},
		EventTime:           metav1.NewMicroTime(now),
		ReportingController: Controller,
		ReportingInstance:   r.opts.Instance,
		Action:              ev.Action,
		Reason:              ev.Reason,
		Regarding:           ref,
		Note:                ev.Note,
		Type:                ev.Type,
	}
	name, err := r.create(ctx, obj)
	if err != nil {
		r.opts.Log.Warn().Err(err).Str("object", ref.Kind+" "+ref.Namespace+"/"+ref.Name).Str("reason", ev.Reason).Msg("event not written")
		return
	}
	r.series[k] = &entry{namespace: ns, name: name, count: 1, last: now}
}

// create creates obj, trying again after errors on the way to the API server.
func (r *Recorder) create(ctx context.Context, obj *eventsv1.Event) (string, error) {
	backoff := r.opts.RetryBackoff
	for try := 0; ; try++ {
		name, err := r.opts.Sink.Create(ctx, obj)
		if err == nil || !retriable(err) || try >= r.opts.Retries {
			return name, err
		}
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(backoff):
		}
		backoff *= 2
	}
}

// take takes a token of obj's bucket, and reports whether there was one.
func (r *Recorder) take(obj objKey, now time.Time) bool {
	b := r.buckets[obj]
	if b == nil {
		b = &bucket{tokens: float64(r.opts.Burst), at: now}
		r.buckets[obj] = b
	}
	b.tokens = min(float64(r.opts.Burst), b.tokens+float64(now.Sub(b.at))/float64(r.opts.Refill))
	b.at = now
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}

// flush writes the counts of the series that grew, and forgets the series and buckets that
// have been quiet for longer than SeriesWindow and Burst refills.
func (r *Recorder) flush(ctx context.Context) {
	now := r.opts.Now()
	for k, e := range r.series {
		if e.dirty {
			s := eventsv1.EventSeries{Count: e.count, LastObservedTime: metav1.NewMicroTime(e.last)}
			if err := r.opts.Sink.PatchSeries(ctx, e.namespace, e.name, s); err != nil {
				r.opts.Log.Debug().Err(err).Str("event", e.namespace+"/"+e.name).Msg("event series not written; trying again")
				continue
			}
			e.dirty = false
		}
		if now.Sub(e.last) >= r.opts.SeriesWindow {
			delete(r.series, k)
		}
	}
	full := time.Duration(r.opts.Burst) * r.opts.Refill
	for k, b := range r.buckets {
		if now.Sub(b.at) >= full {
			delete(r.buckets, k)
		}
	}
}

// truncate shortens s to at most n bytes, on a rune boundary, marking the cut with "…".
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := n - len("…")
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}

// seriesPatch is the JSON merge patch that sets an Event's series.
func seriesPatch(s eventsv1.EventSeries) ([]byte, error) {
	b, err := json.Marshal(map[string]any{"series": s})
	if err != nil {
		return nil, fmt.Errorf("event series patch: %w", err)
	}
	return b, nil
}
