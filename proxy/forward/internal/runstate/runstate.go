// Package runstate is the Serve/Close life cycle of the data path's proxies (State), with the
// errors of a proxy found closed or frozen (ErrClosed, ErrFrozen).
package runstate

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
)

// State is the Serve/Close life cycle that the TCP and UDP proxies share: Serve may run once,
// Close may come before, during or after it, and Close returns only once Serve's loop has
// returned. Freeze (a hand-over) stops Serve's loop like Close but keeps the socket open. The
// zero value is ready; it owns its lock.
type State struct {
	mu                      sync.Mutex // guards the following fields
	started, closed, frozen bool
	// running is set from start until Serve's loop returns (ended); done is closed then, made
	// by the first close or freeze that waits for it (the loop of an idle listener never meets
	// one).
	running bool
	// stop is closed by Close or freeze, and wakes a pausing loop; made by the first stopChan
	// (closed already when it comes after them), as few loops ever pause: every listener has a
	// State.
	stop chan struct{}
	done chan struct{} // see running
	// parked: the loop ended for want of work and waits, without a goroutine, for resume (see
	// park); close and freeze then end it themselves. disarm, set by the first park, stops
	// the watch of the socket; close and freeze call it.
	parked bool
	disarm func()
}

// closeStopLocked closes stop, if made; s.mu must be held.
func (s *State) closeStopLocked() {
	if s.stop != nil {
		close(s.stop)
	}
}

// Start is Serve's admission: an error when Serve was called before, ok=false (and no error)
// when Close came first. When ok, the caller calls ended as its loop returns.
func (s *State) Start(what string) (ok bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started {
		return false, fmt.Errorf("serve %s: Serve called twice", what)
	}
	s.started = true
	if s.frozen {
		return false, fmt.Errorf("serve %s: %w", what, ErrFrozen)
	}
	if s.closed {
		return false, nil
	}
	s.running = true
	return true, nil
}

// Ended is the loop's last act when it returns for good: close and freeze stop waiting.
func (s *State) Ended() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.endedLocked()
}

func (s *State) endedLocked() {
	s.running = false
	if s.done != nil {
		close(s.done)
	}
}

// Done returns what Close and Freeze wait on: nil when the loop is not running, else a channel
// closed when it returns.
func (s *State) Done() chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.doneLocked()
}

// doneLocked returns what close and freeze wait on: nil when the loop is not running, else
// done, made by the first of them. s.mu must be held.
func (s *State) doneLocked() chan struct{} {
	if !s.running {
		return nil
	}
	if s.done == nil {
		s.done = make(chan struct{})
	}
	return s.done
}

// Close marks the state closed, closes sock on the first call, waits for Serve's loop to return,
// and reports whether this call was the first. sock may be nil.
func (s *State) Close(sock io.Closer, what string) (first bool, err error) {
	s.mu.Lock()
	first = !s.closed
	if first {
		s.closed = true
		if !s.frozen {
			s.closeStopLocked()
		}
		s.unparkLocked()
	}
	done := s.doneLocked()
	s.mu.Unlock()
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

// Freeze stops Serve's loop for a hand-over without closing the socket: it marks the state
// frozen, calls wake (which makes the loop's blocking call return, e.g. with a deadline in the
// past) and waits for the loop to return. It fails when the proxy was closed or frozen before.
func (s *State) Freeze(what string, wake func()) error {
	s.mu.Lock()
	switch {
	case s.closed:
		s.mu.Unlock()
		return fmt.Errorf("freeze %s: %w", what, ErrClosed)
	case s.frozen:
		s.mu.Unlock()
		return fmt.Errorf("freeze %s: %w", what, ErrFrozen)
	}
	s.frozen = true
	s.closeStopLocked()
	s.unparkLocked()
	done := s.doneLocked()
	s.mu.Unlock()
	if done != nil {
		wake()
		<-done
	}
	return nil
}

// Park is the loop's last act when it ends for want of work: unless the state is closed or
// frozen it calls arm, which arranges for resume to be called later (the Poller, when the socket
// is readable), marks the state parked and returns true; the loop's goroutine then returns
// without closing done. It returns false, and arm's error if that failed, when the loop must go
// on or end as it would without parking.
func (s *State) Park(arm func() error, disarm func()) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.frozen {
		return false, nil
	}
	if err := arm(); err != nil {
		return false, err
	}
	s.parked, s.disarm = true, disarm
	return true, nil
}

// Resume takes the state out of parked and reports whether it did; the caller then runs the
// loop again (on a new goroutine). False means close or freeze came first.
func (s *State) Resume() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.parked {
		return false
	}
	s.parked = false
	return true
}

// unparkLocked is close's and freeze's: nothing watches the socket any more (before it is
// closed: its descriptor's number may be reused), and a parked loop ends for good, done closed
// as the loop would have. s.mu must be held.
func (s *State) unparkLocked() {
	if s.disarm != nil {
		s.disarm()
		s.disarm = nil
	}
	if s.parked {
		s.parked = false
		s.endedLocked()
	}
}

// Thaw undoes freeze for a hand-over that failed: the state runs again and Serve may be called
// anew. It reports false when the state is not frozen or was released (closed) since.
func (s *State) Thaw() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.frozen || s.closed {
		return false
	}
	s.frozen, s.started, s.running, s.done = false, false, false, nil
	s.stop = nil // made again by the next stopChan
	return true
}

// Release marks a frozen state closed and reports whether it did: false when the state is not
// frozen or was closed before.
func (s *State) Release() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.frozen || s.closed {
		return false
	}
	s.closed = true
	return true
}

// Status reports whether the proxy was closed and whether it was frozen.
func (s *State) Status() (closed, frozen bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed, s.frozen
}

// StopChan returns the channel Close (or freeze) closes.
func (s *State) StopChan() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stop == nil {
		s.stop = make(chan struct{})
		if s.closed || s.frozen {
			close(s.stop)
		}
	}
	return s.stop
}

// Stopping reports whether Close (or freeze) was called: whether stopChan's channel is closed.
func (s *State) Stopping() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed || s.frozen
}

// Err is the error for a proxy found closed or frozen.
func Err(closed, frozen bool) error {
	if closed {
		return ErrClosed
	}
	if frozen {
		return ErrFrozen
	}
	return nil
}

// ErrClosed is returned (wrapped) by Freeze and Adopt on a proxy that was closed or released.
var ErrClosed = errors.New("proxy closed")

// ErrFrozen is returned (wrapped) by Freeze and Adopt on a proxy that was frozen before.
var ErrFrozen = errors.New("proxy frozen for a hand-over")
