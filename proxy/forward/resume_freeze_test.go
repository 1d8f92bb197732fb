package forward

import (
	"bytes"
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

// resumedSplicer returns a splicer as a direction woken from parking makes it (see
// direction.unshelve): it parks at its next wait and sets its next park deadline at its first
// chunk; spliced says whether it splices through a pipe or copies through a buffer. frozen is
// the connection's freeze flag.
func resumedSplicer(t *testing.T, pool *pipePool, spliced bool, frozen *atomic.Bool) (s *splicer, write func([]byte)) {
	t.Helper()
	client, src := tcpPair(t, nil)
	_, dst := tcpPair(t, nil)
	s, err := newSplicer(pool, dst, src)
	if err != nil {
		t.Fatalf("splicer: %v", err)
	}
	s.frozen, s.parkAfter, s.spliced, s.parkNow = frozen, time.Hour, spliced, true
	return s, func(b []byte) {
		if _, err := client.Write(b); err != nil {
			t.Fatalf("write to the source: %v", err)
		}
	}
}

// TestResumedDirectionFrozenBeforeMovedKeepsChunk: a direction resumed from parking that reads a
// chunk while its connection is being frozen (the freeze's flag set, its deadline not yet) stops
// with errFrozen at its first moved() and returns the chunk as pending bytes: the hand-over
// exports it, none is lost. Copying and splicing directions alike.
func TestResumedDirectionFrozenBeforeMovedKeepsChunk(t *testing.T) {
	for _, spliced := range []bool{false, true} {
		name := map[bool]string{false: "copying", true: "splicing"}[spliced]
		t.Run(name, func(t *testing.T) {
			var pool pipePool
			defer pool.closeAll()
			var frozen atomic.Bool
			s, write := resumedSplicer(t, &pool, spliced, &frozen)
			msg := []byte("the chunk read as the freeze starts")
			write(msg)
			waitReadable(t, s)
			frozen.Store(true)
			n, err := s.run()
			if !errors.Is(err, errFrozen) {
				t.Fatalf("run: %d bytes, %v; want errFrozen", n, err)
			}
			if n != 0 || !bytes.Equal(s.pending, msg) {
				t.Fatalf("frozen resumed direction: %d bytes written, pending %q; want 0 written, pending %q", n, s.pending, msg)
			}
		})
	}
}

// TestResumedDirectionFailedMovedPoolsNoData: a splicing direction resumed from parking whose
// first moved() fails leaves no byte of its connection in a pipe that the pool hands to the
// next connection (of any service port: the pool is the proxy's).
func TestResumedDirectionFailedMovedPoolsNoData(t *testing.T) {
	var pool pipePool
	defer pool.closeAll()
	var frozen atomic.Bool
	s, write := resumedSplicer(t, &pool, true, &frozen)
	write([]byte("one tenant's bytes"))
	waitReadable(t, s)
	frozen.Store(true)
	if _, err := s.run(); err == nil {
		t.Fatalf("run: no error; want the freeze's")
	}
	p, err := pool.get()
	if err != nil {
		t.Fatalf("pipe: %v", err)
	}
	defer pool.discard(p)
	if n, err := p.buffered(); err != nil || n != 0 {
		t.Fatalf("the next pipe the pool hands out holds %d bytes (%v); want an empty pipe", n, err)
	}
}

// waitReadable waits until s's source has bytes to read.
func waitReadable(t *testing.T, s *splicer) {
	t.Helper()
	eventually(t, "the source to be readable", func() bool {
		n := 0
		s.srcRC.Control(func(fd uintptr) { n, _ = fionread(int(fd)) })
		return n > 0
	})
}
