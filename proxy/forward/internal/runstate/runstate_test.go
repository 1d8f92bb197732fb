package runstate

import (
	"errors"
	"testing"
)

// TestStartOnce: Serve may run once; a second start is an error.
func TestStartOnce(t *testing.T) {
	var s State
	if ok, err := s.Start("proxy"); !ok || err != nil {
		t.Fatalf("first Start: %v, %v; want true, nil", ok, err)
	}
	if ok, err := s.Start("proxy"); ok || err == nil {
		t.Fatalf("second Start: %v, %v; want false and an error", ok, err)
	}
}

// TestCloseBeforeStart: a Close that comes first makes Start a no-op without an error.
func TestCloseBeforeStart(t *testing.T) {
	var s State
	if first, err := s.Close(nil, "proxy"); !first || err != nil {
		t.Fatalf("Close: %v, %v; want true, nil", first, err)
	}
	if first, _ := s.Close(nil, "proxy"); first {
		t.Error("second Close reported itself first")
	}
	if ok, err := s.Start("proxy"); ok || err != nil {
		t.Fatalf("Start after Close: %v, %v; want false, nil", ok, err)
	}
	select {
	case <-s.StopChan():
	default:
		t.Error("StopChan not closed after Close")
	}
}

// TestCloseWaitsForLoop: Close returns only once the loop has ended.
func TestCloseWaitsForLoop(t *testing.T) {
	var s State
	if ok, _ := s.Start("proxy"); !ok {
		t.Fatal("Start failed")
	}
	stop := s.StopChan()
	closed := make(chan struct{})
	go func() {
		s.Close(nil, "proxy")
		close(closed)
	}()
	<-stop // Close has begun
	select {
	case <-closed:
		t.Fatal("Close returned before the loop ended")
	default:
	}
	s.Ended()
	<-closed
}

// TestFreezeThawRelease: a frozen state refuses Serve and a second freeze, thaws back to
// serving, and once released is closed.
func TestFreezeThawRelease(t *testing.T) {
	var s State
	if err := s.Freeze("proxy", func() {}); err != nil {
		t.Fatalf("Freeze: %v", err)
	}
	if _, frozen := s.Status(); !frozen || !s.Stopping() {
		t.Fatal("not frozen and stopping after Freeze")
	}
	if _, err := s.Start("proxy"); !errors.Is(err, ErrFrozen) {
		t.Errorf("Start on a frozen state: %v, want ErrFrozen", err)
	}
	if err := s.Freeze("proxy", func() {}); !errors.Is(err, ErrFrozen) {
		t.Errorf("second Freeze: %v, want ErrFrozen", err)
	}
	if !s.Thaw() {
		t.Fatal("Thaw of a frozen state failed")
	}
	if ok, err := s.Start("proxy"); !ok || err != nil {
		t.Fatalf("Start after Thaw: %v, %v", ok, err)
	}
	s.Ended()
	if err := s.Freeze("proxy", func() {}); err != nil {
		t.Fatalf("Freeze again: %v", err)
	}
	if !s.Release() || s.Release() {
		t.Error("Release: want true once, then false")
	}
	if closed, _ := s.Status(); !closed {
		t.Error("not closed after Release")
	}
	if err := s.Freeze("proxy", func() {}); !errors.Is(err, ErrClosed) {
		t.Errorf("Freeze after Release: %v, want ErrClosed", err)
	}
	if s.Thaw() {
		t.Error("Thaw after Release succeeded")
	}
}

// TestParkResume: a parked loop is resumed once; Close ends a parked loop and disarms it.
func TestParkResume(t *testing.T) {
	var s State
	s.Start("proxy")
	disarmed := 0
	if parked, err := s.Park(func() error { return nil }, func() { disarmed++ }); !parked || err != nil {
		t.Fatalf("Park: %v, %v", parked, err)
	}
	if !s.Resume() || s.Resume() {
		t.Fatal("Resume: want true once, then false")
	}
	if parked, _ := s.Park(func() error { return nil }, func() { disarmed++ }); !parked {
		t.Fatal("second Park failed")
	}
	s.Close(nil, "proxy") // must not wait: the parked loop has no goroutine
	if disarmed != 1 {
		t.Errorf("disarmed %d times, want 1", disarmed)
	}
	if s.Resume() {
		t.Error("Resume after Close succeeded")
	}
	if parked, _ := s.Park(func() error { return nil }, func() {}); parked {
		t.Error("Park after Close succeeded")
	}
}

// TestErr names the state a proxy was found in.
func TestErr(t *testing.T) {
	if Err(false, false) != nil || Err(true, false) != ErrClosed || Err(false, true) != ErrFrozen || Err(true, true) != ErrClosed {
		t.Error("Err does not map closed to ErrClosed, frozen to ErrFrozen, neither to nil")
	}
}
