// Package syncrunner runs a function at bounded frequency: as soon as possible after a trigger,
// but on average no more often than once per MinInterval, and at least once per MaxInterval.
//
// Like kube-proxy's BoundedFrequencyRunner, it allows a burst: up to Burst runs back to back
// after a quiet spell, then one per MinInterval. A Service created just before its
// EndpointSlice is thus programmed at once both times, instead of the second change waiting a
// whole MinInterval for the first's run.
//
// It is the sync loop's heartbeat: every Service or EndpointSlice event triggers it, bursts of
// events merge into one run (a one-slot channel holds the pending trigger), and the periodic run
// repairs state that someone else changed (rules deleted by hand, say).
//
// A trigger may also allow a delay (TriggerWithin): the run comes at the latest then, or with
// the next plain trigger, whichever is first. The proxy uses it for a new Service whose first
// EndpointSlice has not arrived: the slice usually follows within milliseconds, and one run then
// programs both (a Service first programmed alone gets a REJECT rule that its slice's run
// replaces at once; each run costs two iptables-restore executions).
package syncrunner

import (
	"context"
	"sync"
	"time"
)

// Runner calls fn at bounded frequency. Create it with New and start it with Run.
type Runner struct {
	fn       func(periodic bool) bool
	min, max time.Duration
	burst    int
	trigger  chan struct{}
	// soft is signalled when due moves earlier (see TriggerWithin).
	soft chan struct{}

	mu  sync.Mutex // guards due
	due time.Time  // the latest start of the next run that TriggerWithin asked for; zero for none
}

// New returns a Runner for fn, which is told whether its run is the periodic one (the
// MaxInterval timer fired, perhaps together with triggers) rather than one for triggers only,
// and returns whether it did anything: a run that returns false (it had nothing to work on yet,
// say before the initial state arrived) takes nothing from the rate limit, so the first real
// run after it is not held back by runs that did nothing.
// minInterval ≤ 0 means no lower bound; maxInterval ≤ 0 means no
// periodic run; burst is how many runs may follow each other without waiting (at least 1;
// kube-proxy's iptables mode uses 2).
func New(fn func(periodic bool) bool, minInterval, maxInterval time.Duration, burst int) *Runner {
	return &Runner{fn: fn, min: minInterval, max: maxInterval, burst: max(burst, 1),
		trigger: make(chan struct{}, 1), soft: make(chan struct{}, 1)}
}

// Trigger asks for a run. It never blocks; triggers before the run starts merge into it.
func (r *Runner) Trigger() {
	select {
	case r.trigger <- struct{}{}:
	default:
	}
}

// TriggerWithin asks for a run within d: the run starts when d has passed, or earlier with the
// next Trigger or period (a run serves every request made before it starts). Like a Trigger,
// the run is subject to the rate limit. It never blocks.
func (r *Runner) TriggerWithin(d time.Duration) {
	at := time.Now().Add(d)
	r.mu.Lock()
	earlier := r.due.IsZero() || at.Before(r.due)
	if earlier {
		r.due = at
	}
	r.mu.Unlock()
	if earlier {
		select {
		case r.soft <- struct{}{}:
		default:
		}
	}
}

// takeDue returns the pending TriggerWithin deadline (zero for none); clear also forgets it,
// for the run about to start serves it.
func (r *Runner) takeDue(clear bool) time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	due := r.due
	if clear {
		r.due = time.Time{}
	}
	return due
}

// Run calls fn once per trigger or period until ctx is done. It does not run fn until the first
// trigger or the first period has passed. It returns when ctx is done and fn has returned.
func (r *Runner) Run(ctx context.Context) {
	// The rate limit is a token bucket of burst tokens refilled at one per min, kept as the
	// time the bucket would be back to full (the generic cell rate algorithm): a run may start
	// once that is no more than (burst-1)·min ahead of now.
	var full time.Time
	periodic := time.NewTimer(r.periodic())
	defer periodic.Stop()
	// deferred fires at the deadline of TriggerWithin; stopped while there is none.
	deferred := time.NewTimer(time.Hour)
	deferred.Stop()
	defer deferred.Stop()
	for {
		isPeriodic := false
		select {
		case <-ctx.Done():
			return
		case <-r.trigger:
		case <-periodic.C:
			isPeriodic = true
		case <-r.soft:
			// A run since the request (one whose trigger this select took first) has
			// served it and cleared the deadline: nothing is due then.
			if due := r.takeDue(false); !due.IsZero() {
				deferred.Reset(time.Until(due))
			}
			continue
		case <-deferred.C:
		}
		// This run serves a deferred request too.
		deferred.Stop()
		r.takeDue(true)
		if wait := time.Until(full.Add(-time.Duration(r.burst-1) * r.min)); r.min > 0 && wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			// The period may have ended meanwhile: this run is the periodic one then.
			select {
			case <-periodic.C:
				isPeriodic = true
			default:
			}
		}
		// Triggers that arrived while waiting are served by this run.
		select {
		case <-r.trigger:
		default:
		}
		if now := time.Now(); full.Before(now) {
			full = now
		}
		prev := full
		full = full.Add(r.min)
		if !r.fn(isPeriodic) {
			full = prev
		}
		periodic.Reset(r.periodic())
	}
}

func (r *Runner) periodic() time.Duration {
	if r.max <= 0 {
		return 1<<63 - 1
	}
	return r.max
}
