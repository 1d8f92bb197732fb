package forward

import (
	"runtime/debug"
	"sync/atomic"
	"time"
)

// Returning parked goroutines' stacks to the system. A goroutine that parks on the Poller (an
// idle listener's loop, an idle direction of a TCP connection, an idle UDP socket) ends, and its
// stack goes back to the Go heap, but the heap keeps the pages: the runtime's background
// scavenger returns free pages only above the heap goal of the last collection, and that goal
// was set while the goroutines lived (stacks count toward it), and no collection comes while
// the node is idle, since nothing allocates. 10,000 idle connections that had parked were
// still 9.1 KiB of RSS each in the full benchmark (HAProxy: 3.2): their stacks, free but kept.
//
// So the Poller counts the directions that park (each one a goroutine that ends) and, after a
// burst of returnAfterParks of them, waits for the burst to settle and has the runtime collect
// and return free memory (debug.FreeOSMemory): at most once per returnMinInterval, and never
// while parkings stay rare, so a node whose connections park one by one pays nothing. The
// collection is a full GC with its usual short pauses; its CPU time grows with the live heap
// (tens of milliseconds at 10,000 services), bounded by the interval. Listener loops are not
// counted: at 10,000 service ports they park in a burst as the ports open and close, where a
// return (a full collection, and every free page given back to be faulted in again by the next
// sync) would land in the middle of the control plane's work.

// Defaults of memReturner.
const (
	returnAfterParks  = 1024                   // ~8 MiB of goroutine stacks at the 8 KiB minimum
	returnSettle      = 200 * time.Millisecond // one ParkIdleAfter: 500 ms left the 10,000-connection bench 1.5 KiB each higher 1 s after its ramp
	returnMaxWait     = 4 * time.Second        // a burst that goes on longer is returned as it stands
	returnMinInterval = 10 * time.Second       // between two returns; 30 s kept the second burst of the bench's idle rows (~20 s after the first) 0.6 KiB each higher
)

// memReturner returns freed memory to the system after bursts of parkings (see above). Its
// goroutine waits on a channel between bursts: no timer runs while the node is idle.
type memReturner struct {
	after       int64 // parkings in a burst
	settle      time.Duration
	maxWait     time.Duration
	minInterval time.Duration
	release     func() // debug.FreeOSMemory; tests count calls instead

	parks    atomic.Int64  // since the last return
	kick     chan struct{} // a burst began (capacity 1)
	stop     chan struct{} // closed by close
	done     chan struct{} // closed when run has returned
	returned atomic.Int64  // returns so far (tests, debug logs)
}

func newMemReturner() *memReturner {
	return &memReturner{after: returnAfterParks, settle: returnSettle, maxWait: returnMaxWait,
		minInterval: returnMinInterval, release: debug.FreeOSMemory,
		kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
}

// parked counts one parking; the one that completes a burst wakes run. It does not block.
func (r *memReturner) parked() {
	if r.parks.Add(1) == r.after {
		select {
		case r.kick <- struct{}{}:
		default:
		}
	}
}

// run returns memory after each burst, until close. The Poller starts it.
func (r *memReturner) run() {
	defer close(r.done)
	var last time.Time // of the last return
	for {
		select {
		case <-r.kick:
		case <-r.stop:
			return
		}
		// Let the burst settle: parking connections go idle over a ParkIdleAfter or two.
		start := time.Now()
		for seen := int64(-1); ; {
			n := r.parks.Load()
			if n == seen || time.Since(start) >= r.maxWait {
				break
			}
			seen = n
			if !r.sleep(r.settle) {
				return
			}
		}
		if wait := r.minInterval - time.Since(last); !last.IsZero() && wait > 0 && !r.sleep(wait) {
			return
		}
		r.parks.Store(0)
		r.release()
		r.returned.Add(1)
		last = time.Now()
	}
}

// sleep waits d, or until close: it reports whether to go on.
func (r *memReturner) sleep(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-r.stop:
		return false
	}
}

// close stops run and waits for it (a return under way finishes first).
func (r *memReturner) close() {
	close(r.stop)
	<-r.done
}
