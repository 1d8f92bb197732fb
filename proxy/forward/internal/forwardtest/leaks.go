package forwardtest

import (
	"runtime"
	"strings"
	"testing"
	"time"
)

// CheckNoLeaks fails the test if, once its cleanups have run, goroutines whose stacks name one
// of markers (the functions of a package's proxies, such as "forward.(*TCPProxy)") remain. Call
// it first in a test, so its cleanup runs last.
func CheckNoLeaks(t *testing.T, markers ...string) {
	t.Cleanup(func() {
		var leaked string
		deadline := time.Now().Add(WaitTimeout)
		for {
			leaked = Goroutines(markers...)
			if leaked == "" {
				return
			}
			if time.Now().After(deadline) {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		t.Errorf("goroutines left behind:\n%s", leaked)
	})
}

// Goroutines returns the stacks of the goroutines whose stacks name one of markers.
func Goroutines(markers ...string) string {
	buf := AllStacks()
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		for _, marker := range markers {
			if strings.Contains(g, marker) {
				out = append(out, g)
				break
			}
		}
	}
	return strings.Join(out, "\n\n")
}

// AllStacks returns the stacks of every goroutine (runtime.Stack, all of them, whole).
func AllStacks() []byte {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return buf[:n]
		}
		buf = make([]byte, 2*len(buf))
	}
}
