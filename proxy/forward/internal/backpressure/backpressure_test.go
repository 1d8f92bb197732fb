package backpressure

import (
	"errors"
	"fmt"
	"syscall"
	"testing"
	"time"
)

// TestPauseDoubles: an episode's sleeps start at 5 ms and double up to 1 s.
func TestPauseDoubles(t *testing.T) {
	var p Pause
	want := []time.Duration{5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000}
	for i, w := range want {
		if got := p.Next(); got != w*time.Millisecond {
			t.Fatalf("sleep %d: %v, want %v", i+1, got, w*time.Millisecond)
		}
	}
	if p.Attempts != len(want) || p.Start.IsZero() {
		t.Errorf("Attempts %d, Start %v; want %d and the first failure's time", p.Attempts, p.Start, len(want))
	}
}

// TestSleepUnlessStopped: a closed stop channel cuts the sleep short.
func TestSleepUnlessStopped(t *testing.T) {
	stop := make(chan struct{})
	close(stop)
	if SleepUnlessStopped(time.Hour, stop) {
		t.Error("slept through a closed stop channel")
	}
	if !SleepUnlessStopped(0, make(chan struct{})) {
		t.Error("a sleep without a stop reported being stopped")
	}
}

// TestIsResourceExhausted: EMFILE, ENFILE, ENOBUFS and ENOMEM, wrapped or not, and nothing else.
func TestIsResourceExhausted(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{syscall.EMFILE, true},
		{fmt.Errorf("accept: %w", syscall.ENFILE), true},
		{syscall.ENOBUFS, true},
		{syscall.ENOMEM, true},
		{syscall.ECONNRESET, false},
		{errors.New("too many open files"), false},
		{nil, false},
	} {
		if got := IsResourceExhausted(tc.err); got != tc.want {
			t.Errorf("IsResourceExhausted(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}
