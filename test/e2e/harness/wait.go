//go:build linux

package harness

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
)

// PollInterval is how often WaitFor tries again.
const PollInterval = 100 * time.Millisecond

// WaitFor calls fn every PollInterval until it returns nil and returns how long that took; it
// fails the test (t.Fatal) with fn's last error when timeout passes first.
func WaitFor(t testing.TB, timeout time.Duration, fn func() error) time.Duration {
	t.Helper()
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := poll(ctx, PollInterval, fn); err != nil {
		t.Fatalf("harness: still failing after %v: %v", timeout, err)
	}
	return time.Since(start)
}

// Eventually is WaitFor returning the error instead of failing the test, for use off the test's
// goroutine.
func Eventually(ctx context.Context, timeout time.Duration, fn func() error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	return poll(ctx, PollInterval, fn)
}

// stopPolling wraps an error that ends poll at once.
type stopPolling struct{ err error }

func (s stopPolling) Error() string { return s.err.Error() }

// poll calls fn every interval until it returns nil (poll returns nil), returns a stopPolling
// (poll returns its error) or ctx ends (poll returns fn's last error).
func poll(ctx context.Context, interval time.Duration, fn func() error) error {
	var last error
	for {
		last = fn()
		if last == nil {
			return nil
		}
		var stop stopPolling
		if errors.As(last, &stop) {
			return stop.err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last error: %v)", ctx.Err(), last)
		case <-time.After(interval):
		}
	}
}
