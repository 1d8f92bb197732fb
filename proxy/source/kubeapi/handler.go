package kubeapi

import (
	"fmt"
	"sync"

	"github.com/rs/zerolog"
	"k8s.io/client-go/tools/cache"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/source"
)

// dispatcher serialises calls to the Handler: the two informers deliver from their own
// goroutines, and source.Handler promises one call at a time.
type dispatcher struct {
	mu         sync.Mutex // guards following fields and serialises calls to h
	h          source.Handler
	syncedDone bool
}

// synced calls OnSynced, once.
func (d *dispatcher) synced() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.syncedDone {
		return
	}
	d.syncedDone = true
	d.h.OnSynced()
}

// run calls f as one serialised Handler call.
func (d *dispatcher) run(f func()) {
	d.mu.Lock()
	defer d.mu.Unlock()
	f()
}

// eventHandler maps informer notifications for objects of type T to deliver(prev, cur):
// add → (nil, obj), update → (old, new), delete → (obj, nil), including deletes that arrive as
// a cache.DeletedFinalStateUnknown tombstone (a delete missed while the watch was down).
type eventHandler[T any] struct {
	kind    string
	log     zerolog.Logger
	d       *dispatcher
	deliver func(prev, cur *T)
	// unpack decodes the packed form the informer caches (see packed); nil for a kind that is
	// cached as it is.
	unpack func(*packed) (*T, error)
}

var _ cache.ResourceEventHandler = &eventHandler[struct{}]{}

func (e *eventHandler[T]) call(prev, cur *T) {
	e.d.mu.Lock()
	defer e.d.mu.Unlock()
	e.deliver(prev, cur)
}

func (e *eventHandler[T]) cast(obj any, op string) (*T, bool) {
	if p, ok := obj.(*packed); ok && p != nil && e.unpack != nil {
		o, err := e.unpack(p)
		if err != nil {
			e.log.Error().Err(err).Str("kind", e.kind).Str("op", op).Msg("internal error: a cached object does not decode again; its change is not delivered")
			return nil, false
		}
		return o, true
	}
	o, ok := obj.(*T)
	if !ok || o == nil {
		e.log.Error().Str("kind", e.kind).Str("op", op).Str("type", typeName(obj)).Msg("informer delivered an unexpected object, ignoring it")
		return nil, false
	}
	return o, true
}

// OnAdd implements cache.ResourceEventHandler.
func (e *eventHandler[T]) OnAdd(obj any, _ bool) {
	if o, ok := e.cast(obj, "add"); ok {
		e.call(nil, o)
	}
}

// OnUpdate implements cache.ResourceEventHandler.
func (e *eventHandler[T]) OnUpdate(oldObj, newObj any) {
	prev, ok := e.cast(oldObj, "update")
	if !ok {
		return
	}
	if newObj == oldObj { // a resync: one object, decoded once, delivered as both
		e.call(prev, prev)
		return
	}
	cur, ok := e.cast(newObj, "update")
	if !ok {
		return
	}
	e.call(prev, cur)
}

// OnDelete implements cache.ResourceEventHandler.
func (e *eventHandler[T]) OnDelete(obj any) {
	if t, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		e.log.Debug().Str("kind", e.kind).Str("key", t.Key).Msg("delete seen as tombstone")
		obj = t.Obj
	}
	if o, ok := e.cast(obj, "delete"); ok {
		e.call(o, nil)
	}
}

func typeName(obj any) string {
	return fmt.Sprintf("%T", obj)
}
