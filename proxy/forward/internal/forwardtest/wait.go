package forwardtest

import (
	"testing"
	"time"
)

// WaitTimeout bounds every wait of the tests for something that must happen. It is a guard
// against hangs, not a measurement: reaching it fails the test.
const WaitTimeout = 20 * time.Second

// Eventually polls cond until it holds, failing the test after waitTimeout.
func Eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(WaitTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}
