package udp

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/runstate"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/sys"
	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// Poller calls a function when a socket becomes readable, from one goroutine for every socket it
// watches: an idle UDP service port needs no goroutine of its own parked in read (at 10,000
// service ports those goroutines' stacks were 40 MB). Each Arm is one-shot: the function runs once, on the
// Poller's goroutine, and must not block; to be called again, Arm again.
//
// It is its own epoll instance, beside the Go runtime's: a socket can be in both, and the runtime
// keeps serving the socket's reads and accepts as before. Its goroutine waits for the epoll
// descriptor to be readable in the runtime's poller (an epoll descriptor is pollable), not in a
// blocking epoll_wait: a blocked system call would hold its thread and processor, and each
// goroutine its functions start would then need another thread woken to run.
//
// Create it with NewPoller and Close it when no socket needs it any more.
type Poller struct {
	epfd int
	ep   *os.File        // epfd, non-blocking, in the runtime's poller; closing it ends run's wait
	rc   syscall.RawConn // ep's

	mu     sync.Mutex // guards the following fields
	fds    []watch    // by descriptor number
	closed bool

	done chan struct{} // closed when the goroutine has returned
}

// watch is a descriptor's entry in a Poller: in the epoll set, with the function to call, or
// nil once called. A slice by descriptor number rather than a map: descriptors are small and
// dense, and a map's slots cost ~100 bytes per idle connection at 10,000 (it keeps the room it
// grew to).
type watch struct {
	fn      func()
	watched bool
}

// NewPoller creates a Poller and starts its goroutine.
func NewPoller() (*Poller, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("poller: epoll_create1: %w", err)
	}
	if err := unix.SetNonblock(epfd, true); err != nil {
		unix.Close(epfd)
		return nil, fmt.Errorf("poller: non-blocking epoll descriptor: %w", err)
	}
	ep := os.NewFile(uintptr(epfd), "epoll") // non-blocking: registered with the runtime's poller
	rc, err := ep.SyscallConn()
	if err != nil {
		ep.Close()
		return nil, fmt.Errorf("poller: %w", err)
	}
	p := &Poller{epfd: epfd, ep: ep, rc: rc, done: make(chan struct{})}
	go p.run()
	return p, nil
}

// Arm has fn called once, on the Poller's goroutine, as soon as fd is readable (at once when it
// is readable already). A second Arm of the same fd before fn ran replaces fn. The caller keeps
// fd open until Disarm.
func (p *Poller) Arm(fd int, fn func()) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errors.New("poller: closed")
	}
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLONESHOT, Fd: int32(fd)}
	// Modified when it was watched before, added when not; the other when the guess is wrong (a
	// descriptor closed while watched leaves the set, one disarmed stays while a duplicate of it
	// lives).
	op, other := unix.EPOLL_CTL_ADD, unix.EPOLL_CTL_MOD
	if fd < 0 {
		return fmt.Errorf("poller: descriptor %d", fd)
	}
	if fd < len(p.fds) && p.fds[fd].watched {
		op, other = other, op
	}
	err := sys.EpollCtl(p.epfd, op, fd, &ev)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.EEXIST) {
		err = sys.EpollCtl(p.epfd, other, fd, &ev)
	}
	if err != nil {
		return fmt.Errorf("poller: watching descriptor %d: %w", fd, err)
	}
	if fd >= len(p.fds) {
		p.fds = slices.Grow(p.fds, fd+1-len(p.fds))[:fd+1]
	}
	p.fds[fd] = watch{fn: fn, watched: true}
	return nil
}

// Disarm stops watching fd: its function will not be called, unless the Poller's goroutine took
// it already (readiness came first), so a function checks that it is still wanted. Call it
// before closing fd (a later descriptor with the same number is another socket).
func (p *Poller) Disarm(fd int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if fd < 0 || fd >= len(p.fds) || !p.fds[fd].watched {
		return
	}
	p.fds[fd] = watch{}
	if !p.closed {
		_ = sys.EpollCtl(p.epfd, unix.EPOLL_CTL_DEL, fd, nil)
	}
}

// Close stops the Poller's goroutine and waits for it, then calls, on the caller's goroutine,
// the functions still armed, as if their sockets had become readable: nothing waiting on the
// Poller is stranded (their next Arm fails; they must wait some other way).
func (p *Poller) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		<-p.done
		return nil
	}
	p.closed = true
	armed := p.fds
	p.fds = nil
	p.mu.Unlock()
	err := p.ep.Close() // wakes run's wait; the descriptor is closed once run has left it
	<-p.done
	for _, w := range armed {
		if w.fn != nil { // nil: called already, or not watched
			w.fn()
		}
	}
	if err != nil {
		return fmt.Errorf("poller: close: %w", err)
	}
	return nil
}

// run waits for readiness and calls the functions armed for it, until Close.
func (p *Poller) run() {
	defer close(p.done)
	events := make([]unix.EpollEvent, 128)
	var ready []func()
	var n int
	var werr error
	collect := func(fd uintptr) bool {
		n, werr = sys.EpollPoll(int(fd), events)
		return n > 0 || (werr != nil && werr != unix.EINTR) // nothing ready: wait in the runtime
	}
	for {
		if err := p.rc.Read(collect); err != nil || werr != nil {
			return // the epoll descriptor is closed (or broken), which only Close does
		}
		ready = ready[:0]
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			return
		}
		for _, ev := range events[:n] {
			if fd := int(ev.Fd); fd < len(p.fds) && p.fds[fd].fn != nil {
				ready = append(ready, p.fds[fd].fn)
				p.fds[fd].fn = nil // one-shot: armed again by the next Arm (MOD)
			}
		}
		p.mu.Unlock()
		for _, fn := range ready {
			fn()
		}
	}
}

// loopIdle is how long the loop of a proxy's Start waits for work before it parks.
const loopIdle = time.Second

// errLoopIdle ends a loop of Start that waited for work in vain.
var errLoopIdle = errors.New("idle")

// idleDeadline is the read deadline of a loop of Start that parks when idle: it renews the
// deadline at most every loopIdle/2 (a deadline per accept or per batch costs ~2 % on short
// connections), so the loop ends after half a second to a second without work.
type idleDeadline struct {
	set time.Time // when the deadline was last set
}

// renew sets a new deadline with setDeadline when the last one is due for renewal, and reports
// whether run is stopping: a freeze's wake-up deadline, set before the one set here, is lost, so
// the caller must not wait.
func (d *idleDeadline) renew(run *runstate.State, setDeadline func(time.Time) error) bool {
	now := time.Now()
	if now.Sub(d.set) < loopIdle/2 {
		return false
	}
	d.set = now
	_ = setDeadline(now.Add(loopIdle))
	return run.Stopping()
}

// parkedLoop is the loop of a proxy's Start, run while there is work and parked on a Poller
// while there is none. owner.serveLoop(true) returns errLoopIdle when it found no work for a
// while; any other return ends it for good (runstate.State.ended). It is small, and holds no closure:
// every idle listener has one.
type parkedLoop struct {
	run    *runstate.State
	poller *Poller
	fd     int
	owner  loopOwner
}

// loopOwner is the proxy whose loop a parkedLoop runs.
type loopOwner interface {
	// serveLoop is the loop (see parkedLoop).
	serveLoop(idle bool) error
	// logWarn and logError start events of the proxy's log.
	logWarn() *zerolog.Event
	logError() *zerolog.Event
}

// startParked starts owner's loop for Start: parked on poller at once (the first readiness of
// sock starts it), or on a goroutine of its own for good when there is no poller or it cannot
// watch sock. An error that ends the loop is logged.
func startParked(run *runstate.State, poller *Poller, sock syscall.Conn, owner loopOwner) {
	l := &parkedLoop{run: run, poller: poller, owner: owner}
	if poller != nil {
		if fd, err := sys.FD(sock); err == nil {
			l.fd = fd
			l.parkOrEnd(errLoopIdle)
			return
		}
	}
	go l.runForGood()
}

// runOnce runs the loop until it is idle, then parks it.
func (l *parkedLoop) runOnce() { l.parkOrEnd(l.owner.serveLoop(true)) }

// runForGood runs the loop without parking, until it ends.
func (l *parkedLoop) runForGood() { l.end(l.owner.serveLoop(false)) }

// parkOrEnd follows a loop that ended with err: idle, it parks on the poller (whose call resumes
// the loop on a new goroutine) unless the proxy is stopping; otherwise it ends.
func (l *parkedLoop) parkOrEnd(err error) {
	if !errors.Is(err, errLoopIdle) {
		l.end(err)
		return
	}
	parked, perr := l.run.Park(func() error {
		return l.poller.Arm(l.fd, func() {
			if l.run.Resume() {
				go l.runOnce()
			}
		})
	}, func() { l.poller.Disarm(l.fd) })
	switch {
	case parked:
	case perr != nil: // on a goroutine: parkOrEnd may run on Start's caller's
		l.owner.logWarn().Err(perr).Msg("cannot watch the idle socket; its loop keeps a goroutine")
		go l.runForGood()
	default:
		l.end(nil) // stopping
	}
}

// end logs err, if any, and ends the loop's run: it is over.
func (l *parkedLoop) end(err error) {
	if err != nil {
		l.owner.logError().Err(err).Msg("proxy listener stopped serving")
	}
	l.run.Ended()
}
