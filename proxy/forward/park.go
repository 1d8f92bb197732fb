package forward

import (
	"net"
	"sync/atomic"
	"time"
)

// Parking idle directions: under Start, a direction of a connection that has waited
// ParkIdleAfter for data gives its goroutine up. Its splicer returns errWouldBlock on EAGAIN
// instead of waiting in the Go runtime's network poller; the direction registers its source
// socket with the proxy's Poller (one-shot) and its goroutine returns. Whatever it needs to go on
// is in its direction struct, on the heap; what wakes it (the Poller when the socket is readable
// — data, EOF, a reset from the peer —, the idle timeout's timer, a freeze, a reset by the proxy)
// starts a goroutine that calls the copy again, which reads the data, or sees the freeze's
// deadline, the idle deadline or the closed socket as it would have in its wait. An idle
// connection thus costs no goroutine stack at all, only its heap state (HAProxy's model).
//
// The delay keeps a busy connection's goroutine (a keep-alive request/response costs a
// runtime wake-up, not an epoll_ctl and a goroutine start: parking at every wait made
// BenchmarkTCPRequestResponse's round trip ~40 % slower). It is a read deadline every
// ParkIdleAfter: one that finds the direction moved nothing since the one before parks it
// (see splicer.waitExpired), so a busy direction pays a flag per chunk and one deadline
// wake-up per ParkIdleAfter, and an idle one parks after one to two ParkIdleAfter.
//
// Descriptor numbers: a socket registered with the Poller stays registered until disarmed, and
// is disarmed (under p.mu) before the proxy closes it: resetBothLocked, finish and Release all
// disarm first, and a direction registers (under p.mu, and with the descriptor held by
// RawConn.Control) only while the connection is neither reset nor frozen. A Poller call for a
// direction that is not parked, or a second wake-up, does nothing: wake-ups may be spurious.

// DefaultParkIdleAfter is ParkIdleAfter's default. Shorter costs a busy direction that waits
// in read more deadline wake-ups (one per ParkIdleAfter) and parks keep-alive connections whose
// requests come less often; longer keeps more goroutines alive after a burst of new connections,
// and a goroutine's descriptor (~480 bytes) is never freed, only reused. The partial bench
// (KUP_BENCH_ONLY=idle, 10,000 connections, 5 s later) found 4.66 KiB per idle connection at 1 s
// and 4.00 at 200 ms; the data-path rows (KUP_BENCH_ONLY=datapath) showed no cost at 200 ms.
const DefaultParkIdleAfter = 200 * time.Millisecond

// parkAfterLocked resolves ParkIdleAfter for the splicers of a relay (see splicer.parkAfter):
// negative when the proxy serves without a Poller. A relay that starts before the proxy serves
// (an adopted connection: Adopt may come before Start) may park, and finds out in parkOn
// whether there is a Poller. p.mu must be held.
func (p *TCPProxy) parkAfterLocked() time.Duration {
	switch d := p.ParkIdleAfter; {
	case d < 0 || p.poller == nil && p.run.isStarted():
		return -1
	case d == 0:
		return DefaultParkIdleAfter
	case d < time.Millisecond:
		return 0
	default:
		return d
	}
}

// The states of a direction (parkState.state).
const (
	dirRunning int32 = iota // a goroutine runs it
	dirParking              // parkOn is registering it
	dirParked               // no goroutine: the first wake starts one
	dirWoken                // woken while parking: parkOn's goroutine goes on
)

// parkState is a direction's parking.
type parkState struct {
	state  atomic.Int32
	wakeFn func()      // the direction's wake, bound once: the Poller's and the timer's function
	timer  *time.Timer // the idle timeout's, while parked with an IdleTimeout; owned by the direction's goroutine
}

// parkOn parks the direction, whose source has nothing to read, and reports whether it did:
// the caller's goroutine then returns. False means go on on this goroutine: the connection is
// being frozen or was reset (the next read sees it), the direction was woken meanwhile, or the
// Poller refused (then the direction never parks again).
func (d *direction) parkOn() bool {
	c := d.r.c
	p := c.p
	p.mu.Lock()
	defer p.mu.Unlock()
	if c.frozen.Load() || c.reset {
		return false
	}
	if p.poller == nil { // an adopted connection of a proxy that Serve runs
		d.s.neverPark()
		return false
	}
	d.park.state.Store(dirParking)
	if err := c.armLocked(d.src, d.park.wakeFn); err != nil {
		d.park.state.Store(dirRunning)
		d.s.neverPark()
		p.logDebug().Err(err).Stringer("client", c.clientAddr).
			Msg("cannot park an idle direction on the poller; it keeps its goroutine")
		return false
	}
	if c.idle != nil {
		// Just after the socket's idle deadline, which the next read then reports.
		wait := time.Until(c.idle.expiry()) + time.Millisecond
		if d.park.timer == nil {
			d.park.timer = time.AfterFunc(wait, d.park.wakeFn)
		} else {
			d.park.timer.Reset(wait)
		}
	}
	s := d.shelve()
	if d.park.state.CompareAndSwap(dirParking, dirParked) {
		p.poller.parked()
		return true
	}
	d.s, d.res.n = s, d.res.n-s.total // woken while parking: go on with it
	d.park.state.Store(dirRunning)
	return false
}

// shelve lets the direction's splicer go before it parks, keeping in the direction what the
// next one needs (unshelve), the bytes it wrote added to the result: a parked direction holds no splicer (~300 bytes with its bound
// functions and raw connections: two per idle connection, a tenth of what one costs). Parking
// comes after an idle delay (ParkIdleAfter), so the splicer a resumed direction makes is one
// allocation per wake-up after idling, not per chunk. It returns the splicer, for a park that
// does not happen. The caller owns the direction: its state is dirParking.
func (d *direction) shelve() *splicer {
	s := d.s
	d.s, d.res.n, d.spliced = nil, d.res.n+s.total, s.spliced
	return s
}

// unshelve makes the splicer of a direction woken from parking; false means the direction has
// ended, with its result written. The new splicer waits as the old one did when it parked (the
// socket's deadlines are as it left them; the first chunk sets the next park deadline).
func (d *direction) unshelve() bool {
	c := d.r.c
	s, err := newSplicer(c.p.pipePool(), d.dst, d.src)
	if err != nil {
		d.end(0, nil, err)
		return false
	}
	s.idle, s.frozen, s.parkAfter = c.idle, &c.frozen, d.r.parkAfter
	s.spliced, s.parkNow = d.spliced, true
	d.s = s
	return true
}

// wake resumes a parked direction on a new goroutine (or has a parking one go on); on a running
// direction it does nothing. It does not block: it is the Poller's function.
func (d *direction) wake() {
	for {
		switch st := d.park.state.Load(); st {
		case dirParked:
			if d.park.state.CompareAndSwap(st, dirRunning) {
				go d.resume()
				return
			}
		case dirParking:
			if d.park.state.CompareAndSwap(st, dirWoken) {
				return
			}
		default:
			return
		}
	}
}

// resume is a parked direction's copier, woken: it goes on with the copy.
func (d *direction) resume() { d.copy() }

// stopTimer stops the idle timer, if any: the direction has ended.
func (d *direction) stopTimer() {
	if d.park.timer != nil {
		d.park.timer.Stop()
	}
}

// armLocked registers src, one of the connection's sockets, with the Poller, to call fn once
// when readable. The descriptor is held (RawConn.Control) while it is registered, so a
// concurrent close cannot hand its number to another socket meanwhile. p.mu must be held.
func (c *tcpConn) armLocked(src *net.TCPConn, fn func()) error {
	rc, err := src.SyscallConn()
	if err != nil {
		return err
	}
	var aerr error
	if err := rc.Control(func(fd uintptr) { aerr = c.p.poller.Arm(int(fd), fn) }); err != nil {
		return err
	}
	if aerr == nil {
		if src == c.client {
			c.clientPolled = true
		} else {
			c.backendPolled = true
		}
	}
	return aerr
}

// disarmLocked takes the connection's sockets off the Poller, before they are closed. p.mu must
// be held.
func (c *tcpConn) disarmLocked() {
	if c.clientPolled {
		c.disarmConnLocked(c.client)
		c.clientPolled = false
	}
	if c.backendPolled {
		c.disarmConnLocked(c.backend)
		c.backendPolled = false
	}
}

func (c *tcpConn) disarmConnLocked(conn *net.TCPConn) {
	if conn == nil {
		return
	}
	rc, err := conn.SyscallConn()
	if err != nil {
		return
	}
	_ = rc.Control(func(fd uintptr) { c.p.poller.Disarm(int(fd)) }) // fails, doing nothing, once closed
}

// wakeParkedLocked wakes the relay's parked directions (a freeze, a reset). p.mu must be held.
func (c *tcpConn) wakeParkedLocked() {
	if r := c.relayed; r != nil {
		r.to.wake()
		r.from.wake()
	}
}
