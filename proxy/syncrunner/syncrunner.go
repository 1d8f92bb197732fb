// Package syncrunner runs a function at bounded frequency: as soon as possible after a trigger,
// but never more often than once per MinInterval, and at least once per MaxInterval.
//
// It is the sync loop's heartbeat: every Service or EndpointSlice event triggers it, bursts of
// events merge into one run (a one-slot channel holds the pending trigger), and the periodic run
// repairs state that someone else changed (rules deleted by hand, say).
package syncrunner

import (
	"context"
	"time"
)

// Runner calls fn at bounded frequency. Create it with New and start it with Run.
type Runner struct {
	fn       func()
	min, max time.Duration
	trigger  chan struct{}
}

// New returns a Runner for fn. minInterval ≤ 0 means no lower bound; maxInterval ≤ 0 means no
// periodic run.
func New(fn func(), minInterval, maxInterval time.Duration) *Runner {
	return &Runner{fn: fn, min: minInterval, max: maxInterval, trigger: make(chan struct{}, 1)}
}

// Trigger asks for a run. It never blocks; triggers before the run starts merge into it.
func (r *Runner) Trigger() {
	select {
	case r.trigger <- struct{}{}:
	default:
	}
}

// Run calls fn once per trigger or period until ctx is done. It does not run fn until the first
// trigger or the first period has passed. It returns when ctx is done and fn has returned.
func (r *Runner) Run(ctx context.Context) {
	var last time.Time
	periodic := time.NewTimer(r.periodic())
	defer periodic.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.trigger:
		case <-periodic.C:
		}
		if wait := r.min - time.Since(last); !last.IsZero() && wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
		}
		// Triggers that arrived while waiting are served by this run.
		select {
		case <-r.trigger:
		default:
		}
		last = time.Now()
		r.fn()
		periodic.Reset(r.periodic())
	}
}

func (r *Runner) periodic() time.Duration {
	if r.max <= 0 {
		return 1<<63 - 1
	}
	return r.max
}
