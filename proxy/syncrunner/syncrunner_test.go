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
	mu       sync.Mutex
	at       []time.Time
	periodic []bool
	ch       chan struct{}
	// idleRuns is how many first runs report that they did nothing.
	idleRuns int
}

func (r *runs) fn(periodic bool) bool {
	r.mu.Lock()
	r.at = append(r.at, time.Now())
	r.periodic = append(r.periodic, periodic)
	idle := len(r.at) <= r.idleRuns
	r.mu.Unlock()
	r.ch <- struct{}{}
	return !idle
}

func start(t *testing.T, min, max time.Duration) (*Runner, *runs) {
	return startBurst(t, min, max, 1)
}

func startBurst(t *testing.T, min, max time.Duration, burst int) (*Runner, *runs) {
	t.Helper()
	rec := &runs{ch: make(chan struct{}, 100)}
	r := New(rec.fn, min, max, burst)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return r, rec
}

// Runs that did nothing (fn returned false) take nothing from the rate limit: the first run
// that does work follows at once, then the limit applies.
func TestIdleRunsAreNotCounted(t *testing.T) {
	const min = time.Hour
	rec := &runs{ch: make(chan struct{}, 100), idleRuns: 3}
	r := New(rec.fn, min, time.Hour, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { r.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	for i := range 4 {
		r.Trigger()
		select {
		case <-rec.ch:
		case <-time.After(5 * time.Second):
			t.Fatalf("run %d did not follow its trigger: %d idle runs before it were counted against the limit", i+1, i)
		}
	}
	r.Trigger()
	select {
	case <-rec.ch:
		t.Fatal("a run that did work was not counted: the next one came at once with a burst of 1")
	case <-time.After(300 * time.Millisecond):
	}
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
	if rec.periodic[0] || rec.periodic[1] {
		t.Errorf("triggered runs reported periodic: %v", rec.periodic)
	}
}

// With a burst of 2, two triggers after a quiet spell run at once; the third waits for the
// bucket to refill (one run per min), and so does everything after it.
func TestBurst(t *testing.T) {
	const min = time.Second // wide: the burst check is an upper bound on a gap
	r, rec := startBurst(t, min, time.Hour, 2)
	for range 4 {
		r.Trigger()
		<-rec.ch
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if gap := rec.at[1].Sub(rec.at[0]); gap >= min {
		t.Errorf("second run of the burst %v after the first, want it without waiting (< %v)", gap, min)
	}
	for i := 2; i < 4; i++ {
		if gap := rec.at[i].Sub(rec.at[i-2]); gap < min {
			t.Errorf("runs %d and %d %v apart, want at least %v (one token per interval)", i-2, i, gap, min)
		}
		if gap := rec.at[i].Sub(rec.at[i-1]); gap < min/2 {
			t.Errorf("run %d only %v after run %d: the burst was not used up", i, gap, i-1)
		}
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
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for i, p := range rec.periodic[:3] {
		if !p {
			t.Errorf("run %d: periodic=false, want true for a run the period started", i)
		}
	}
}

func TestRunStopsOnCancel(t *testing.T) {
	var n atomic.Int32
	r := New(func(bool) bool { n.Add(1); return true }, 0, 0, 1)
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

// TriggerWithin runs at its deadline when nothing else comes; a plain trigger before the
// deadline runs at once and serves it (no second run at the deadline); of two deadlines the
// earlier counts.
func TestTriggerWithin(t *testing.T) {
	const wait = 300 * time.Millisecond
	t.Run("deadline", func(t *testing.T) {
		r, rec := start(t, 0, time.Hour)
		asked := time.Now()
		r.TriggerWithin(wait)
		if ran := firstRun(t, rec).Sub(asked); ran < wait {
			t.Errorf("run %v after TriggerWithin(%v): before its deadline with nothing else asking", ran, wait)
		}
	})
	t.Run("trigger-first", func(t *testing.T) {
		r, rec := start(t, 0, time.Hour)
		r.TriggerWithin(wait)
		time.Sleep(20 * time.Millisecond)
		asked := time.Now()
		r.Trigger()
		if ran := firstRun(t, rec).Sub(asked); ran >= wait/2 {
			t.Errorf("Trigger ran %v later: it waited for an earlier TriggerWithin's deadline", ran)
		}
		select {
		case <-rec.ch:
			t.Error("a second run at the deadline that the first run already served")
		case <-time.After(2 * wait):
		}
	})
	t.Run("both-pending-at-start", func(t *testing.T) {
		// A Trigger and a TriggerWithin both made before Run starts: the first run serves
		// both, whichever of the two Run's select takes first. (Ten rounds: the select picks
		// at random.)
		const wait = 100 * time.Millisecond
		for range 10 {
			rec := &runs{ch: make(chan struct{}, 100)}
			r := New(rec.fn, 0, time.Hour, 1)
			r.TriggerWithin(wait)
			r.Trigger()
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { r.Run(ctx); close(done) }()
			firstRun(t, rec)
			select {
			case <-rec.ch:
				t.Error("a second run for a deadline that the first run already served")
			case <-time.After(2 * wait):
			}
			cancel()
			<-done
		}
	})
	t.Run("earlier-wins", func(t *testing.T) {
		r, rec := start(t, 0, time.Hour)
		asked := time.Now()
		r.TriggerWithin(time.Hour)
		r.TriggerWithin(wait)
		r.TriggerWithin(time.Hour) // a later deadline does not postpone the earlier one
		if ran := firstRun(t, rec).Sub(asked); ran < wait {
			t.Errorf("run %v after asking, before the earliest deadline %v", ran, wait)
		}
	})
}

// firstRun waits for rec's first run and returns when it started.
func firstRun(t *testing.T, rec *runs) time.Time {
	t.Helper()
	select {
	case <-rec.ch:
	case <-time.After(10 * time.Second):
		t.Fatal("no run")
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return rec.at[0]
}
