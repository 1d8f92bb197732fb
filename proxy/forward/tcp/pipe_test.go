//go:build linux

package tcp

import (
	"syscall"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
)

// TestPipePoolNeverReusesNonEmptyPipe: a pipe returned to the pool while it still holds bytes
// is closed, its descriptors given back to the budget, and the pool hands out an empty pipe:
// no byte of one connection reaches another through a reused pipe, whichever engine returned
// it.
func TestPipePoolNeverReusesNonEmptyPipe(t *testing.T) {
	budget := forward.NewBudget(100)
	pool := pipePool{budget: budget}
	defer pool.closeAll()
	p, err := pool.get()
	if err != nil {
		t.Fatalf("pipe: %v", err)
	}
	if _, err := syscall.Write(p.w, []byte("stale")); err != nil {
		t.Fatalf("write to the pipe: %v", err)
	}
	pool.put(p)
	if n := len(pool.free); n != 0 {
		t.Fatalf("the pool keeps %d pipes after a non-empty one was returned; want 0", n)
	}
	if got := budget.InUse(); got != 0 {
		t.Fatalf("budget: %d descriptors in use after the non-empty pipe was returned; want 0", got)
	}
	q, err := pool.get()
	if err != nil {
		t.Fatalf("pipe: %v", err)
	}
	if n, err := q.buffered(); err != nil || n != 0 {
		t.Fatalf("the pool hands out a pipe holding %d bytes (%v); want an empty one", n, err)
	}
	pool.put(q) // empty: kept
	if n := len(pool.free); n != 1 {
		t.Fatalf("the pool keeps %d pipes after an empty one was returned; want 1", n)
	}
}
