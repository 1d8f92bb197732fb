// Package kubeapi is the source of Services and EndpointSlices that watches a Kubernetes API
// server through client-go shared informers and delivers every change to a source.Handler.
//
// It filters at list/watch time exactly what kube-proxy filters there, so the API server does the
// work and the proxy never caches those objects:
//   - Services labelled service.kubernetes.io/service-proxy-name (they belong to another proxy),
//     and headless Services (field selector spec.clusterIP!=None);
//   - EndpointSlices labelled service.kubernetes.io/headless (their service is headless).
//
// With Options.NodeName it also watches that one Node (field selector metadata.name) for
// NodeEligible, which /healthz reports as kube-proxy's does, and for its
// topology.kubernetes.io/zone label, which it hands to a Handler that implements
// source.TopologyHandler (the proxy's zone for topology hints). The initial sync does not wait
// for the Node: until it is seen, the zone is unknown and hints are ignored.
//
// Every object is passed through, less what the proxy never reads (trimObject: managed fields,
// other annotations, owner references, endpoints' pod references, a Node's status), which the
// informers would otherwise cache for the life of the process; the informers cache Services and
// EndpointSlices protobuf-encoded (packed), and the Handler gets each decoded anew; in particular ExternalName
// Services reach the Handler and are skipped by the model (proxy.FromService), as are headless
// Services on a server or fake that ignores the field selector.
//
// The API client is the package's own (NewClient: REST clients for the two API groups it
// reads), not client-go's clientset, which would link every API group into the binary.
//
// Use:
//
//	cfg, err := kubeapi.BuildConfig(kubeconfig, master)
//	client, err := kubeapi.NewClient(cfg)
//	err = kubeapi.New(client, kubeapi.Options{Log: log}).Run(ctx, handler)
package kubeapi

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	v1 "k8s.io/api/core/v1"
	discovery "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/selection"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/source"
)

// Options configures a Source. The zero value is valid.
type Options struct {
	// ResyncPeriod is the informers' resync period: every period each cached object is delivered
	// again as an update whose prev and cur are the same object (the proxy drops such no-op
	// updates). 0 disables resyncs.
	ResyncPeriod time.Duration
	// WaitLogInterval is how often Run logs, at info level, that it is still waiting for the
	// initial sync (for example while the API server is unreachable). 0 means 10s.
	WaitLogInterval time.Duration
	// Log receives the source's logs. The zero value discards them.
	Log zerolog.Logger
	// NodeName, when set, makes Run also watch that Node, for NodeEligible and its zone.
	NodeName string
}

func (o *Options) waitLogInterval() time.Duration {
	if o.WaitLogInterval <= 0 {
		return 10 * time.Second
	}
	return o.WaitLogInterval
}

// Source watches Services and EndpointSlices on an API server. Create it with New; Run it once.
type Source struct {
	client Client
	opts   Options
	log    zerolog.Logger

	// svcW, sliceW and nodeW remember each informer's current list/watch failure.
	svcW, sliceW, nodeW *watchState
	// nodeIneligible is the negation of NodeEligible (so that the zero value means eligible).
	nodeIneligible atomic.Bool

	started atomic.Bool // Run was called
}

// New returns a Source that watches through client. Nothing happens until Run.
func New(client Client, opts Options) *Source {
	log := opts.Log.With().Str("source", "kubeapi").Logger()
	return &Source{client: client, opts: opts, log: log,
		svcW:   &watchState{resource: "services", log: log},
		sliceW: &watchState{resource: "endpointslices", log: log},
		nodeW:  &watchState{resource: "nodes", log: log},
	}
}

// Err returns the API server failure the source is currently retrying after (nil when its
// informers are connected): the proxy keeps serving the last state meanwhile, and /healthz says so.
func (s *Source) Err() error {
	var errs []error
	for _, w := range []*watchState{s.svcW, s.sliceW} {
		if since, err := w.failure(); err != nil {
			errs = append(errs, fmt.Errorf("%s: API server unreachable since %s: %s", w.resource, since.UTC().Format(time.RFC3339), cause(err)))
		}
	}
	return errors.Join(errs...)
}

// ServiceSelectors returns the label and field selectors the Service informer lists and watches
// with: no service.kubernetes.io/service-proxy-name label, and spec.clusterIP!=None.
func ServiceSelectors() (labelSelector, fieldSelector string) {
	return mustNotExist(proxy.ServiceProxyNameLabel).String(),
		fields.OneTermNotEqualSelector("spec.clusterIP", v1.ClusterIPNone).String()
}

// EndpointSliceSelector returns the label selector the EndpointSlice informer lists and watches
// with: no service.kubernetes.io/headless label.
func EndpointSliceSelector() string {
	return mustNotExist(v1.IsHeadlessService).String()
}

// mustNotExist builds the selector "!key". key is one of our constants, which are valid label
// keys, so NewRequirement cannot fail; should it ever, the selector degrades to "everything"
// (the model filters the same objects again).
func mustNotExist(key string) labels.Selector {
	req, err := labels.NewRequirement(key, selection.DoesNotExist, nil)
	if err != nil {
		return labels.Everything()
	}
	return labels.NewSelector().Add(*req)
}

// Run starts the informers, delivers every change to h and calls h.OnSynced once both the
// Services and the EndpointSlices have been listed and delivered. It blocks until ctx is done,
// then stops the informers, waits for them and returns nil. Handler calls are serialised (one at
// a time) and all happen before Run returns.
//
// An unreachable or failing API server is not an error: client-go retries with back-off; Run
// logs each list/watch failure and, every WaitLogInterval until the initial sync, what it is
// still waiting for. Run returns an error only when it was already called.
//
// While the API server is unreachable, Run may return up to one back-off interval (at most about
// a minute) after ctx is done: client-go's reflector sleeps out its watch-list back-off without
// watching for cancellation, and Run waits for the informers. A caller that must not wait that
// long (a process shutting down) bounds its wait and leaves the goroutine to end with the process.
func (s *Source) Run(ctx context.Context, h source.Handler) error {
	if !s.started.CompareAndSwap(false, true) {
		return errors.New("kubeapi: Run called more than once")
	}

	svcLabels, svcFields := ServiceSelectors()
	sliceLabels := EndpointSliceSelector()
	svcW, sliceW := s.svcW, s.sliceW
	services := s.client.Services()
	slices := s.client.EndpointSlices()
	svcInf := newInformer(s.client, &v1.Service{}, svcW, s.opts.ResyncPeriod,
		func(o *metav1.ListOptions) {
			o.LabelSelector = svcLabels
			o.FieldSelector = svcFields
		},
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return services.List(ctx, o) },
		services.Watch)
	sliceInf := newInformer(s.client, &discovery.EndpointSlice{}, sliceW, s.opts.ResyncPeriod,
		func(o *metav1.ListOptions) { o.LabelSelector = sliceLabels },
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return slices.List(ctx, o) },
		slices.Watch)

	d := &dispatcher{h: h}
	svcReg, err := setup(svcInf, svcW, &eventHandler[v1.Service]{kind: "Service", log: s.log, d: d, deliver: h.OnServiceUpdate, unpack: unpack[v1.Service]}, s.opts.ResyncPeriod)
	if err != nil {
		return err
	}
	sliceReg, err := setup(sliceInf, sliceW, &eventHandler[discovery.EndpointSlice]{kind: "EndpointSlice", log: s.log, d: d, deliver: h.OnEndpointSliceUpdate,
		unpack: unpack[discovery.EndpointSlice]}, s.opts.ResyncPeriod)
	if err != nil {
		return err
	}

	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { svcInf.RunWithContext(ctx) })
	wg.Go(func() { sliceInf.RunWithContext(ctx) })
	if s.opts.NodeName != "" {
		wg.Go(func() { s.watchNode(ctx, d, h) })
	}

	s.log.Info().Str("serviceLabelSelector", svcLabels).Str("serviceFieldSelector", svcFields).
		Str("endpointSliceLabelSelector", sliceLabels).Msg("starting Service and EndpointSlice informers")
	if s.waitForSync(ctx, waitItem{svcW, svcReg.HasSyncedChecker().Done()}, waitItem{sliceW, sliceReg.HasSyncedChecker().Done()}) {
		d.synced()
		s.log.Info().Int("services", len(svcInf.GetStore().ListKeys())).
			Int("endpointSlices", len(sliceInf.GetStore().ListKeys())).Msg("initial sync complete")
	}
	<-ctx.Done()
	return nil
}

// setup configures one informer: trim what the proxy does not read and pack Services and
// EndpointSlices (trimAndPack), log watch errors, add the handler.
func setup(inf cache.SharedIndexInformer, w *watchState, eh cache.ResourceEventHandler, resync time.Duration) (cache.ResourceEventHandlerRegistration, error) {
	if err := inf.SetTransform(trimAndPack); err != nil {
		return nil, fmt.Errorf("kubeapi: set %s transform: %w", w.resource, err)
	}
	if err := inf.SetWatchErrorHandlerWithContext(w.onError); err != nil {
		return nil, fmt.Errorf("kubeapi: set %s watch error handler: %w", w.resource, err)
	}
	reg, err := inf.AddEventHandlerWithResyncPeriod(eh, resync)
	if err != nil {
		return nil, fmt.Errorf("kubeapi: add %s event handler: %w", w.resource, err)
	}
	return reg, nil
}

// trimObject is every informer's transform: it drops from each freshly decoded object (which
// transforms may modify) what the proxy never reads, before the informer caches it — kept for
// every object of the cluster for the life of the process:
//   - every object: metadata.managedFields (often the largest part of an object);
//   - a Service: its annotations other than those the proxy reads (proxy.UsedServiceAnnotations;
//     kubectl's last-applied-configuration alone repeats the whole object);
//   - an EndpointSlice: its annotations but the last-change-trigger-time (the start of the
//     network programming latency), its owner references, and of each endpoint its
//     targetRef (a Pod reference: kind, namespace, name, uid), hostname and deprecatedTopology;
//   - a Node: its annotations and its status (images, volumes, addresses, conditions); the
//     proxy reads its labels, taints and deletion.
func trimObject(obj any) (any, error) {
	if m, ok := obj.(metav1.Object); ok {
		m.SetManagedFields(nil)
	}
	switch o := obj.(type) {
	case *v1.Service:
		o.Annotations = keepAnnotations(o.Annotations, proxy.UsedServiceAnnotations)
	case *discovery.EndpointSlice:
		o.Annotations, o.OwnerReferences = keepAnnotations(o.Annotations, sliceAnnotations), nil
		for i := range o.Endpoints {
			e := &o.Endpoints[i]
			e.TargetRef, e.Hostname, e.DeprecatedTopology = nil, nil, nil
		}
	case *v1.Node:
		o.Annotations = nil
		o.Status = v1.NodeStatus{}
	}
	return obj, nil
}

// sliceAnnotations are the EndpointSlice annotations the proxy reads.
var sliceAnnotations = []string{v1.EndpointsLastChangeTriggerTime}

// keepAnnotations returns the entries of a whose keys are in keep: a itself when that is all
// of them, nil when none.
func keepAnnotations(a map[string]string, keep []string) map[string]string {
	n := 0
	for _, k := range keep {
		if _, ok := a[k]; ok {
			n++
		}
	}
	switch n {
	case len(a):
		return a
	case 0:
		return nil
	}
	out := make(map[string]string, n)
	for _, k := range keep {
		if v, ok := a[k]; ok {
			out[k] = v
		}
	}
	return out
}

// waitForSync waits until both registrations have delivered their initial list (true) or ctx
// is done (false), logging what it still waits for every WaitLogInterval.
func (s *Source) waitForSync(ctx context.Context, svc, slices waitItem) bool {
	start := time.Now()
	t := time.NewTicker(s.opts.waitLogInterval())
	defer t.Stop()
	for svc.done != nil || slices.done != nil {
		// A nil channel blocks forever, which disables a case once it has fired.
		select {
		case <-ctx.Done():
			return false
		case <-svc.done:
			svc.done = nil
			s.log.Debug().Str("resource", svc.w.resource).Msg("initial list delivered")
		case <-slices.done:
			slices.done = nil
			s.log.Debug().Str("resource", slices.w.resource).Msg("initial list delivered")
		case <-t.C:
			for _, it := range []waitItem{svc, slices} {
				if it.done == nil {
					continue
				}
				ev := s.log.Info().Str("resource", it.w.resource).Dur("waited", time.Since(start).Round(time.Millisecond))
				if err := it.w.lastError(); err != nil {
					ev = ev.Str("lastError", cause(err))
				}
				ev.Msg("waiting for initial sync of " + it.w.resource + " from the API server")
			}
		}
	}
	return true
}

// waitItem is one informer registration Run waits for.
type waitItem struct {
	w    *watchState
	done <-chan struct{}
}

// newInformer builds a shared informer the way client-go's generated informers do (including
// the watch-list semantics detection, so fake clients fall back to list+watch), but with every
// list and watch call reporting its outcome to w. client-go retries some failures (connection
// refused, 429) inside the reflector without telling the watch error handler; this is how Run
// still knows and logs why the initial sync is not happening.
func newInformer(client Client, example runtime.Object, w *watchState, resync time.Duration,
	tweak func(*metav1.ListOptions),
	list func(context.Context, metav1.ListOptions) (runtime.Object, error),
	watchFn func(context.Context, metav1.ListOptions) (watch.Interface, error),
) cache.SharedIndexInformer {
	listCtx := func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
		tweak(&o)
		obj, err := list(ctx, o)
		w.record(ctx, "list", err)
		return obj, err
	}
	watchCtx := func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
		tweak(&o)
		wi, err := watchFn(ctx, o)
		w.record(ctx, "watch", err)
		return wi, err
	}
	lw := &cache.ListWatch{
		// ListWatch's deprecated context-free List and Watch fall back to these too.
		ListWithContextFunc:  listCtx,
		WatchFuncWithContext: watchCtx,
	}
	return cache.NewSharedIndexInformerWithOptions(cache.ToListWatcherWithWatchListSemantics(lw, client), example,
		cache.SharedIndexInformerOptions{ResyncPeriod: resync, Indexers: cache.Indexers{}})
}

// watchState logs an informer's list/watch failures and remembers the last one. A failure is
// logged when it differs from the previous one (client-go retries with back-off, so a dead API
// server would otherwise log the same line forever); success after failures is logged once.
type watchState struct {
	resource string
	log      zerolog.Logger

	mu      sync.Mutex // guards following fields
	lastErr error
	since   time.Time // when the current run of failures began
}

// onError is the informer's watch error handler: errors that end a running list/watch.
func (w *watchState) onError(ctx context.Context, _ *cache.Reflector, err error) {
	w.record(ctx, "list/watch", err)
}

func (w *watchState) record(ctx context.Context, op string, err error) {
	if ctx.Err() != nil {
		return // shutting down: failures are expected and not interesting
	}
	switch {
	case err == nil:
		w.mu.Lock()
		had := w.lastErr
		w.lastErr = nil
		w.mu.Unlock()
		if had != nil {
			w.log.Info().Str("resource", w.resource).Str("op", op).Msg("API server " + op + " succeeded again")
		}
		return
	case errors.Is(err, io.EOF):
		return // the watch closed normally; the reflector re-establishes it
	case apierrors.IsResourceExpired(err) || apierrors.IsGone(err):
		w.log.Debug().Str("resource", w.resource).Err(err).Msg("watch expired, relisting")
		return
	}
	w.mu.Lock()
	repeated := w.lastErr != nil && cause(w.lastErr) == cause(err)
	if w.lastErr == nil {
		w.since = time.Now()
	}
	w.lastErr = err
	w.mu.Unlock()
	if !repeated {
		w.log.Warn().Str("resource", w.resource).Str("op", op).Err(err).Msg("API server " + op + " failed, client-go retries with back-off")
	}
}

// cause returns what identifies a failure for de-duplication: for a failed HTTP request the
// transport error without the URL (whose query carries a random timeout), else the message.
func cause(err error) string {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Op + ": " + ue.Err.Error()
	}
	return err.Error()
}

func (w *watchState) lastError() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.lastErr
}

// failure returns the current failure and when it began (nil when connected).
func (w *watchState) failure() (since time.Time, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.since, w.lastErr
}
