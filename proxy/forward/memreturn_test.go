package forward

import (
	"net/netip"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// testReturner is a memReturner with short waits that counts its returns instead of making them.
func testReturner(after int64, minInterval time.Duration) (*memReturner, *atomic.Int64) {
	r := newMemReturner()
	r.after, r.settle, r.maxWait, r.minInterval = after, 10*time.Millisecond, 100*time.Millisecond, minInterval
	var calls atomic.Int64
	r.release = func() { calls.Add(1) }
	go r.run()
	return r, &calls
}

// TestMemReturnerAfterBurst: fewer parkings than a burst return nothing; the one that completes one
// has memory returned once the burst settles, and the count starts again.
func TestMemReturnerAfterBurst(t *testing.T) {
	r, calls := testReturner(10, 0)
	defer r.close()
	for range 9 {
		r.parked()
	}
	time.Sleep(100 * time.Millisecond) // ten settles
	if n := calls.Load(); n != 0 {
		t.Fatalf("%d returns after 9 parkings of a 10-parking burst, want none", n)
	}
	r.parked()
	eventually(t, "a return after the burst", func() bool { return calls.Load() == 1 })
	if n := r.parks.Load(); n != 0 {
		t.Errorf("%d parkings counted after the return, want 0", n)
	}
	for range 10 {
		r.parked()
	}
	eventually(t, "a return after the second burst", func() bool { return calls.Load() == 2 })
}

// TestMemReturnerEndlessBurst: parkings that never stop coming still get a return (after maxWait).
func TestMemReturnerEndlessBurst(t *testing.T) {
	r, calls := testReturner(5, 0)
	defer r.close()
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
				r.parked()
			}
		}
	}()
	eventually(t, "a return while parkings go on", func() bool { return calls.Load() >= 1 })
	close(stop)
	<-done
}

// TestMemReturnerMinInterval: a second burst within minInterval waits for it, and close does not
// wait for the interval.
func TestMemReturnerMinInterval(t *testing.T) {
	r, calls := testReturner(3, time.Hour)
	for range 3 {
		r.parked()
	}
	eventually(t, "the first return", func() bool { return calls.Load() == 1 })
	for range 3 {
		r.parked()
	}
	time.Sleep(100 * time.Millisecond)
	if n := calls.Load(); n != 1 {
		t.Errorf("%d returns within the minimum interval, want 1", n)
	}
	closed := make(chan struct{})
	go func() { r.close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("close waited for the minimum interval")
	}
}

// TestParkingReturnsMemory: a burst of real idle connections parking on a Poller has memory
// returned once, and none while the burst is not complete (the check of the check). What it
// saves is measured by make bench (idle connections, 5 s later).
func TestParkingReturnsMemory(t *testing.T) {
	const n = 300 // 600 directions park
	for _, tc := range []struct {
		name  string
		after int64
		want  int64
	}{{"burst of 300", n, 1}, {"burst never complete", 1 << 40, 0}} {
		t.Run(tc.name, func(t *testing.T) {
			var poller *Poller
			backend := startTCPEcho(t, loopback("4"))
			pr := startTCPProxy(t, "4", &fakeChooser{endpoints: []netip.AddrPort{backend}}, func(p *TCPProxy) {
				poller = withParking(t, p, 20*time.Millisecond)
				poller.mem.after, poller.mem.settle, poller.mem.minInterval = tc.after, 50*time.Millisecond, 0
			})
			conns := idleConns(t, pr.addr, n)
			defer func() {
				for _, c := range conns {
					c.Close()
				}
			}()
			awaitParked(t)
			if tc.want == 0 {
				time.Sleep(500 * time.Millisecond) // ten settles
				if got := poller.mem.returned.Load(); got != 0 {
					t.Fatalf("%d returns with bursts of %d parkings, want none", got, tc.after)
				}
				return
			}
			eventually(t, "memory returned after the connections parked", func() bool { return poller.mem.returned.Load() >= tc.want })
		})
	}
}

// TestPollerCountsOnlyParkedDirections: arming a socket (a listener's loop parking) does not
// count toward a burst; a parked direction does.
func TestPollerCountsOnlyParkedDirections(t *testing.T) {
	poller, err := NewPoller()
	if err != nil {
		t.Fatal(err)
	}
	defer poller.Close()
	poller.mem.after, poller.mem.settle, poller.mem.minInterval = 2, 10*time.Millisecond, 0
	var fds [2]int
	if err := syscall.Pipe2(fds[:], syscall.O_CLOEXEC|syscall.O_NONBLOCK); err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fds[0])
	defer syscall.Close(fds[1])
	for range 3 {
		if err := poller.Arm(fds[0], func() {}); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(100 * time.Millisecond) // ten settles
	if n := poller.mem.returned.Load(); n != 0 {
		t.Fatalf("%d returns after arms alone, want none", n)
	}
	poller.parked()
	poller.parked()
	eventually(t, "a return after two parked directions", func() bool { return poller.mem.returned.Load() == 1 })
}
