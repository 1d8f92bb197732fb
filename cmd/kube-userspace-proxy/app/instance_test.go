package app

import (
	"errors"
	"os"
	"strconv"
	"strings"
	"testing"
)

// TestLockInstance: the second lock of a network namespace fails, naming the holder's pid, until
// the first is released.
func TestLockInstance(t *testing.T) {
	dir := t.TempDir()
	lock, err := lockInstance(dir)
	if err != nil {
		t.Fatal(err)
	}
	_, err = lockInstance(dir)
	if !errors.Is(err, errInstanceRunning) || !strings.Contains(err.Error(), "pid "+strconv.Itoa(os.Getpid())) {
		t.Fatalf("second lock: %v, want errInstanceRunning naming pid %d", err, os.Getpid())
	}
	lock.release()
	lock.release() // twice: nothing more
	again, err := lockInstance(dir)
	if err != nil {
		t.Fatalf("lock after release: %v", err)
	}
	again.release()
}
