package forward

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
)

// runState is the Serve/Close life cycle that TCPProxy and UDPProxy share. Its fields are
// guarded by the owner's mutex.
type runState struct {
	started, closed bool
	stop            chan struct{} // closed by Close; wakes a pausing loop
	done            chan struct{} // closed when Serve's loop returns; nil until it starts
}

func (s *runState) initLocked() {
	if s.stop == nil {
		s.stop = make(chan struct{})
	}
}

// startLocked is Serve's admission: an error when Serve was called before, ok=false (and no
// error) when Close came first. When ok, the caller closes done as its loop returns.
func (s *runState) startLocked(what string) (done chan struct{}, ok bool, err error) {
	if s.started {
		return nil, false, fmt.Errorf("serve %s: Serve called twice", what)
	}
	s.started = true
	s.initLocked()
	if s.closed {
		return nil, false, nil
	}
	s.done = make(chan struct{})
	return s.done, true, nil
}

// close marks the state closed (calling initLocked under mu first), closes sock on the first
// call, waits for Serve's loop to return, and reports whether this call was the first. sock may
// be nil.
func (s *runState) close(mu *sync.Mutex, initLocked func(), sock io.Closer, what string) (first bool, err error) {
	mu.Lock()
	initLocked()
	first = !s.closed
	if first {
		s.closed = true
		close(s.stop)
	}
	done := s.done
	mu.Unlock()
	if first && sock != nil {
		if cerr := sock.Close(); cerr != nil && !errors.Is(cerr, net.ErrClosed) {
			err = fmt.Errorf("close %s: %w", what, cerr)
		}
	}
	if done != nil {
		<-done
	}
	return first, err
}

// stopping reports whether Close was called; s.stop must exist (after initLocked).
func (s *runState) stopping() bool {
	select {
	case <-s.stop:
		return true
	default:
		return false
	}
}
