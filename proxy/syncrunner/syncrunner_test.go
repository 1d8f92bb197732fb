package syncrunner

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// runs records when fn ran.
type runs struct {
	mu sync.Mutex
	at []time.Time
	ch chan struct{}
}

func (r *runs) fn() {
	r.mu.Lock()
	r.at = append(r.at, time.Now())
	r.mu.Unlock()
	r.ch <- struct{}{}
}

func start(t *testing.T, min, max time.Duration) (*Runner, *runs) {
	t.Helper()
	rec := &runs{ch: make(chan struct{}, 100)}
	r := New(rec.fn, min, max)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return r, rec
}

func TestTriggersMergeAndRespectMinInterval(t *testing.T) {
	const min = 200 * time.Millisecond
	r, rec := start(t, min, time.Hour)
	r.Trigger()
	<-rec.ch
	// A burst of triggers right after a run gives exactly one more run, no earlier than min.
	for range 50 {
		r.Trigger()
	}
	<-rec.ch
	select {
	case <-rec.ch:
		t.Fatal("a burst of triggers produced more than one run")
	case <-time.After(3 * min):
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if gap := rec.at[1].Sub(rec.at[0]); gap < min {
		t.Errorf("runs %v apart, want at least %v", gap, min)
	}
}

func TestPeriodicRun(t *testing.T) {
	_, rec := start(t, 0, 50*time.Millisecond)
	for range 3 {
		select {
		case <-rec.ch:
		case <-time.After(10 * time.Second):
			t.Fatal("no periodic run")
		}
	}
}

func TestRunStopsOnCancel(t *testing.T) {
	var n atomic.Int32
	r := New(func() { n.Add(1) }, 0, 0)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.Run(ctx); close(done) }()
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
	r.Trigger() // must not block after Run returned
	if n.Load() != 0 {
		t.Errorf("fn ran %d times without trigger", n.Load())
	}
}
