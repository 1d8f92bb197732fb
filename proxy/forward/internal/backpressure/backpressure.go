// Package backpressure is how the data path meets running out of file descriptors or memory
// (EMFILE on accept, ENOBUFS on receive): not as a failure but as a condition that goes away
// when load drops. IsResourceExhausted recognises it; a Pause is one episode of it, a sleep
// that doubles from 5 ms up to 1 s with each failure in a row, cut short by a stop channel
// (SleepUnlessStopped).
package backpressure

import (
	"errors"
	"syscall"
	"time"
)

// IsResourceExhausted reports whether err means the process or the kernel ran out of file
// descriptors or memory: a condition that goes away when load drops, to be met with
// back-pressure rather than failure.
func IsResourceExhausted(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
		errors.Is(err, syscall.ENOBUFS) || errors.Is(err, syscall.ENOMEM)
}

// Back-pressure on resource exhaustion (EMFILE on accept, ENOBUFS on receive): the loop sleeps
// pauseMin, doubling up to pauseMax, until the call succeeds again.
const (
	pauseMin = 5 * time.Millisecond
	pauseMax = time.Second
)

// Pause is one episode of back-pressure: consecutive failures of a loop's call for lack
// of file descriptors or memory. The zero value is no episode.
type Pause struct {
	Start    time.Time // the episode's first failure
	Attempts int       // failures so far
	delay    time.Duration
}

// Next records another failure and returns how long to sleep before retrying.
func (r *Pause) Next() time.Duration {
	if r.Attempts == 0 {
		r.Start = time.Now()
		r.delay = pauseMin
	} else {
		r.delay = min(2*r.delay, pauseMax)
	}
	r.Attempts++
	return r.delay
}

// SleepUnlessStopped sleeps for d and returns true, or returns false as soon as stop is closed.
func SleepUnlessStopped(d time.Duration, stop <-chan struct{}) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-stop:
		return false
	}
}
