package tcp

import (
	"fmt"
	"net/netip"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/backpressure"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/logscope"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/internal/sys"
	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward/proxyproto"
	"golang.org/x/sys/unix"
)

// The TCP data path: event loops (Proxy.Loops).
//
// Why: with goroutines per connection every short connection costs a goroutine for its dial,
// two for its copiers, two net.TCPConns with their runtime pollDescs, and the scheduler's
// wake-ups in between: ~40 % of the proxy's own cost per short connection and nearly all of an
// idle connection's memory. Here a connection is a small lconn in a slice indexed by
// descriptor, moved on by the one goroutine of its loop.
//
// Shape: Loops holds one loop per processor. A proxy is placed at its first use on
// loopsPerPort loops (round robin; the first is its home loop): its listener is on each of them,
// each accepts for itself, and a connection stays on the loop that accepted it, thawed too
// (adopted ones go on the home loop). A loop
// waits for its epoll descriptor in Go's poller (one RawConn.Read for its whole life, polling
// with a zero timeout: see run): blocking in epoll_wait would hold a thread and double the cost
// of each message.
// Other goroutines hand work to a loop with post (a queue and an eventfd). Timeouts (dials,
// IdleTimeout, the listener's pause after EMFILE) are checked by a coarse sweep driven by a
// timerfd that is armed only while something needs it: an idle process does not wake.
//
// Triggering: listeners are level-triggered and accept one connection per readiness, so a flood
// on one port takes turns with the others; connection sockets are edge-triggered (IN, OUT,
// RDHUP), added once and never modified. A direction remembers whether its source may still be
// readable: a read shorter than the buffer drained it (new data queues a new edge). A direction
// reads at most loopReadsPerTurn buffers per turn and then waits for the loop's next turn.
//
// Relay: a direction reads into the loop's shared 16 KiB buffer and writes at once; only what
// the destination does not take is copied into a buffer of the direction's own, and its source
// is not read until that is written. The first EOF is passed on with shutdown(SHUT_WR), the
// second by closing both sockets; a read or write error resets both (SO_LINGER 0), so a reset
// is passed on as a reset. A direction whose read fills the buffer is bulk traffic: from then
// on it moves socket → pipe → socket with splice(2), through a pipe from the proxy's pool held
// only while data flows (splice-auto; see pipe_linux.go).
//
// Epoll events carry a generation besides the descriptor, so an event of a socket closed
// earlier in the same batch is never delivered to a new socket that reused its number.

// loopBufSize is a loop's shared read buffer: one read per turn moves at most this much.
const loopBufSize = 16 << 10

// loopReadsPerTurn bounds the reads of one direction per turn of its loop (fairness between
// connections and service ports).
const loopReadsPerTurn = 4

// Sweep intervals: while a listener is paused or a dial is in progress, and the bounds of the
// interval used for IdleTimeout alone (an eighth of the smallest IdleTimeout on the loop).
const (
	loopTickBusy    = 10 * time.Millisecond
	loopTickIdleMin = 10 * time.Millisecond
	loopTickIdleMax = time.Second
)

// Loops is a set of event loops for Proxy.Loops. Create it with NewLoops, give it to the
// proxies, and Close it after them.
type Loops struct {
	loops     []*loop
	next      atomic.Uint32
	closeOnce sync.Once
}

// NewLoops starts n event loops (at least one), each with a goroutine of its own until Close.
func NewLoops(n int) (*Loops, error) {
	ls := &Loops{}
	for i := range max(n, 1) {
		l, err := newLoop()
		if err != nil {
			_ = ls.Close()
			return nil, fmt.Errorf("start event loop %d of %d: %w", i+1, max(n, 1), err)
		}
		ls.loops = append(ls.loops, l)
		go l.run()
	}
	return ls, nil
}

// Close stops every loop: connections still on them are reset, listeners are let go (their
// proxies' Close still closes them). It waits for the loops' goroutines. Close the proxies
// first (Shutdown), so that their connections end as they should.
func (ls *Loops) Close() error {
	ls.closeOnce.Do(func() {
		for _, l := range ls.loops {
			l.stop()
		}
	})
	return nil
}

// Served returns how many connections the loops have taken (accepted and admitted, or adopted).
func (ls *Loops) Served() uint64 {
	var n uint64
	for _, l := range ls.loops {
		n += l.served.Load()
	}
	return n
}

// loopsPerPort is how many loops a proxy's listener is on (fewer when there are fewer loops).
// Every one of them wakes for each new connection and all but one find nothing to accept (see
// watchListener). Two spread a busy port over two processors at one wasted wake-up per
// connection.
const loopsPerPort = 2

// pick returns the loops of a proxy placed now, its home loop first: the next loopsPerPort in
// round robin.
func (ls *Loops) pick() []*loop {
	first := int(ls.next.Add(1) - 1)
	set := make([]*loop, min(loopsPerPort, len(ls.loops)))
	for i := range set {
		set[i] = ls.loops[(first+i)%len(ls.loops)]
	}
	return set
}

// loop is one event loop: its goroutine owns every field below the lock.
type loop struct {
	epfd, evfd, tfd int
	ep              *os.File        // epfd, waited on in the runtime's poller
	rc              syscall.RawConn // ep's
	done            chan struct{}   // closed when run has returned and everything is closed
	served          atomic.Uint64   // see Loops.Served

	mu       sync.Mutex // guards posts and stopped
	posts    []func()
	stopped  bool // run no longer takes posts
	stopping bool // a stop was posted (loop goroutine)

	// turn is held by the loop's goroutine while it handles a batch of events, and guards the
	// fields below: another goroutine takes it to act on the loop at once (withTurn) while the
	// loop waits, instead of waking it with a post.
	turn    sync.Mutex
	fds     []fdSlot // by descriptor
	gen     uint32   // the last generation given to a registration
	buf     []byte
	events  [128]unix.EpollEvent
	epoch   time.Time
	now     time.Duration // since epoch, at the start of the current turn
	again   []*lconn      // connections with a direction to pump next turn, not waiting for an event
	dialing int           // connections whose endpoint socket is connecting
	// dials holds every connecting connection (lconn.inDials), and connections whose dial
	// ended since the last sweep: the sweep checks dial deadlines there rather than walking
	// every descriptor of the loop. Emptied when no dial is left.
	dials, dialsSpare []*lconn
	timed             int           // connections with an IdleTimeout
	idleTick          time.Duration // the interval of IdleTimeout checks: the smallest seen while timed > 0
	idleSweepAt       time.Duration // the next sweep at or after it walks the connections for IdleTimeout
	paused            []*loopListener
	tick              time.Duration // the timerfd's interval; 0: disarmed
}

// fdSlot is what a descriptor of the loop belongs to: a listener, or side 0 (client) or 1
// (endpoint) of a connection.
type fdSlot struct {
	ln   *loopListener
	c    *lconn
	side uint8
	gen  uint32
}

// loopListener is a proxy's listening socket on its loop.
type loopListener struct {
	p   *Proxy
	fd  int
	gen uint32
	// setNoDelay is how many more accepted sockets need TCP_NODELAY set on them: those already
	// queued when the listener was attached (see noDelayToSet); -1 for every one.
	setNoDelay int
	paused     bool
	pause      backpressure.Pause
	resumeAt   time.Duration
}

// lconn is one connection on a loop: sockets 0 (client) and 1 (endpoint), and the directions
// dir[i], from fd[i] to fd[1-i].
//
// A connection belongs to one loop, l, for its whole life (thawed, it goes back there): only
// that loop's goroutine, or a holder of its turn, touches it.
type lconn struct {
	p          *Proxy
	l          *loop    // the loop that owns it
	fd         [2]int32 // -1: none
	gen        [2]uint32
	clientAddr netip.AddrPort
	endpoint   netip.AddrPort // the endpoint being dialled, then the connected one
	dl         *ldial         // until connected: the dial's state (an idle connection keeps none)
	last       time.Duration  // the last byte moved (IdleTimeout)
	n          [2]int64       // bytes written each way since accepted (or frozen)
	dir        [2]ldir
	connecting bool
	connected  bool
	freezing   bool // a Freeze waits for this connection's dial to end
	timed      bool // counted in loop.timed
	inDials    bool // in loop.dials
	queued     bool // in loop.again
	closed     bool // ended or frozen: events and sweeps skip it
}

// ldial is the state of a connection's dial.
type ldial struct {
	dst        netip.AddrPort     // the original destination, once asked
	deadline   time.Duration      // of the attempt in progress
	proxyProto proxyproto.Version // the target's, sent once connected
	plan       dialPlan
	dstAsked   bool
}

// ldir is one direction of a connection.
type ldir struct {
	pending  []byte // read from the source (or adopted), not yet taken by the destination
	pipe     *pipe  // while spliced data is in flight: the pool's pipe holding inPipe bytes
	inPipe   int
	spliced  bool // a read filled the buffer: the direction splices from now on
	readable bool // the source may have data or an EOF (an edge not yet drained)
	rdhup    bool // the source's peer sent its FIN
	eof      bool // the source's EOF was read
	shut     bool // the EOF was passed on to the destination
}

func newLoop() (l *loop, err error) {
	l = &loop{epfd: -1, evfd: -1, tfd: -1, done: make(chan struct{}), buf: make([]byte, loopBufSize), epoch: time.Now()}
	defer func() {
		if err != nil {
			l.closeFDs()
		}
	}()
	if l.epfd, err = unix.EpollCreate1(unix.EPOLL_CLOEXEC); err != nil {
		return nil, fmt.Errorf("epoll_create1: %w", err)
	}
	if l.evfd, err = unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC); err != nil {
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	if l.tfd, err = unix.TimerfdCreate(unix.CLOCK_MONOTONIC, unix.TFD_NONBLOCK|unix.TFD_CLOEXEC); err != nil {
		return nil, fmt.Errorf("timerfd_create: %w", err)
	}
	for _, fd := range []int{l.evfd, l.tfd} {
		if err = unix.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}); err != nil {
			return nil, fmt.Errorf("epoll_ctl add: %w", err)
		}
	}
	if err = unix.SetNonblock(l.epfd, true); err != nil {
		return nil, fmt.Errorf("set the epoll descriptor non-blocking: %w", err)
	}
	l.ep = os.NewFile(uintptr(l.epfd), "event-loop-epoll")
	if l.rc, err = l.ep.SyscallConn(); err != nil {
		return nil, fmt.Errorf("epoll descriptor: %w", err)
	}
	return l, nil
}

func (l *loop) closeFDs() {
	for _, fd := range []int{l.evfd, l.tfd} {
		if fd >= 0 {
			_ = unix.Close(fd)
		}
	}
	if l.ep != nil {
		_ = l.ep.Close()
	} else if l.epfd >= 0 {
		_ = unix.Close(l.epfd)
	}
}

// post queues fn to run on the loop's goroutine and reports whether it will run: false once the
// loop has stopped.
func (l *loop) post(fn func()) bool {
	l.mu.Lock()
	if l.stopped {
		l.mu.Unlock()
		return false
	}
	wake := len(l.posts) == 0
	l.posts = append(l.posts, fn)
	l.mu.Unlock()
	if wake {
		one := [8]byte{1}
		_, _ = unix.Write(l.evfd, one[:])
	}
	return true
}

// isStopped reports whether the loop has stopped taking work.
func (l *loop) isStopped() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.stopped
}

// stop asks the loop to end and waits for it.
func (l *loop) stop() {
	if l.post(func() { l.stopping = true }) {
		<-l.done
	}
}

// runPosts runs the queued posts.
func (l *loop) runPosts() {
	var b [8]byte
	_, _ = sys.Read(l.evfd, b[:])
	l.mu.Lock()
	posts := l.posts
	l.posts = nil
	l.mu.Unlock()
	for _, fn := range posts {
		fn()
	}
}

// withTurn runs fn on the caller's goroutine while the loop's goroutine is between batches:
// cheaper than call for short work, as it does not wake the loop. The caller must not hold a
// lock the loop takes during a batch (p.mu, runstate.State's).
func (l *loop) withTurn(fn func()) {
	l.turn.Lock()
	defer l.turn.Unlock()
	fn()
}

// run is the loop's goroutine: turns until stop, then teardown.
//
// The whole life of the loop is one RawConn.Read of its epoll descriptor: the function polls
// the epoll set (a zero timeout) and takes turns while events come, and returns false, to wait in
// the runtime's poller, once a poll has emptied the set (fewer events than the batch holds), no
// connection has work left and no listener took a connection (see below). RawConn.Read clears the descriptor's readiness once, before its
// first call; after that, readiness signalled while a turn ran (an event that came after the
// poll) is kept, and the wait ends at once. So a wake-up costs one poll, the one that finds the
// events — not, as when each turn was a RawConn.Read of its own, one more after the turn to catch
// what the clearing may have hidden.
func (l *loop) run() {
	defer close(l.done)
	var accept []*loopListener
	// An error (the epoll descriptor failed) ends the loop as a stop does: nothing can be
	// served any more.
	_ = l.rc.Read(func(fd uintptr) bool {
		for {
			n, err := sys.EpollPoll(int(fd), l.events[:])
			switch {
			case err == unix.EINTR:
				continue
			case err != nil:
				return true
			case n == 0 && len(l.again) == 0:
				return false // nothing to do: wait in the runtime's poller
			}
			accept = l.takeTurn(n, accept)
			switch {
			case l.stopping:
				return true
			case n < len(l.events) && len(l.again) == 0 && len(accept) == 0:
				// The poll emptied the set; what came since has marked the descriptor
				// ready again, so the wait ends at once if anything did. Not after an
				// accept: a listener is level-triggered and takes one connection per
				// turn, and the kernel puts it back in the set for the next one without
				// marking the descriptor ready again (TestLoopDrainsABurstOfRefusals).
				return false
			}
		}
	})
	l.turn.Lock()
	defer l.turn.Unlock()
	l.teardown()
}

// takeTurn handles a batch of n events (and the connections with work left from the last
// turn), holding the turn. accept is scratch space, returned for the next turn.
func (l *loop) takeTurn(n int, accept []*loopListener) []*loopListener {
	l.turn.Lock()
	defer l.turn.Unlock()
	l.now = time.Since(l.epoch)
	accept = accept[:0]
	for i := range l.events[:n] {
		ev := &l.events[i]
		switch fd := int(ev.Fd); fd {
		case l.evfd:
			l.runPosts()
		case l.tfd:
			l.sweep()
		default:
			s := l.slot(fd)
			switch {
			case s.gen != uint32(ev.Pad):
			case s.ln != nil:
				accept = append(accept, s.ln) // after the batch: an accepted socket may reuse a number closed in it
			case s.c != nil:
				l.event(s.c, int(s.side), ev.Events)
			}
		}
	}
	for _, ln := range accept {
		if s := l.slot(ln.fd); s.ln == ln && !ln.paused {
			l.accept(ln)
		}
	}
	l.pumpAgain()
	return accept
}

// teardown is the loop's end: no more posts; connections are reset, listeners let go. The
// epoll descriptor is closed, so a later withTurn finds every slot empty.
func (l *loop) teardown() {
	l.mu.Lock()
	l.stopped = true
	posts := l.posts
	l.posts = nil
	l.mu.Unlock()
	for _, fn := range posts {
		fn()
	}
	for fd := range l.fds {
		s := l.fds[fd]
		switch {
		case s.ln != nil:
			l.detach(s.ln)
		case s.c != nil && !s.c.closed:
			l.finish(s.c, true, nil)
		}
	}
	l.closeFDs()
}

// slot returns the slot of fd (the zero slot when it has none).
func (l *loop) slot(fd int) fdSlot {
	if fd < 0 || fd >= len(l.fds) {
		return fdSlot{}
	}
	return l.fds[fd]
}

// track records s as the owner of fd and returns its generation.
func (l *loop) track(fd int, s fdSlot) uint32 {
	if fd >= len(l.fds) {
		grown := make([]fdSlot, max(fd+1, 2*len(l.fds), 64))
		copy(grown, l.fds)
		l.fds = grown
	}
	l.gen++
	s.gen = l.gen
	l.fds[fd] = s
	return s.gen
}

// forget clears fd's slot.
func (l *loop) forget(fd int) {
	if fd >= 0 && fd < len(l.fds) {
		l.fds[fd] = fdSlot{}
	}
}

// register adds side of c to the epoll set, edge-triggered.
func (l *loop) register(c *lconn, side int) error {
	fd := int(c.fd[side])
	gen := l.track(fd, fdSlot{c: c, side: uint8(side)})
	c.gen[side] = gen
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd), Pad: int32(gen)}
	if err := sys.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		l.forget(fd)
		return fmt.Errorf("epoll_ctl add socket %d: %w", fd, err)
	}
	return nil
}

// unregister takes side of c out of the epoll set and its slot, leaving the socket open.
func (l *loop) unregister(c *lconn, side int) {
	if fd := int(c.fd[side]); fd >= 0 {
		_ = sys.EpollCtl(l.epfd, unix.EPOLL_CTL_DEL, fd, nil)
		l.forget(fd)
	}
}

// armTimer makes sure the sweep runs at least every d.
func (l *loop) armTimer(d time.Duration) {
	if l.tick != 0 && l.tick <= d {
		return
	}
	l.setTimer(d)
}

func (l *loop) setTimer(d time.Duration) {
	ts := unix.NsecToTimespec(int64(d))
	_ = sys.TimerfdSettime(l.tfd, &unix.ItimerSpec{Interval: ts, Value: ts})
	l.tick = d
}

// sweep runs every tick while needed: dial timeouts (every tick, over loop.dials), IdleTimeout
// (every idleTick, over every connection), paused listeners. It disarms the timer when nothing
// needs it any more.
func (l *loop) sweep() {
	var b [8]byte
	_, _ = sys.Read(l.tfd, b[:])
	if len(l.dials) > 0 {
		l.sweepDials()
	}
	// The timer ticks every idleTick or more often (wantTick); half a busy tick of slack keeps
	// a tick that comes a little early from putting the walk off by a whole interval.
	if l.timed > 0 && l.now >= l.idleSweepAt {
		l.idleSweepAt = l.now + l.idleTick - loopTickBusy/2
		for i := range l.fds {
			s := l.fds[i]
			if c := s.c; c != nil && s.side == 0 && !c.closed {
				l.sweepIdle(c)
			}
		}
	}
	for _, ln := range l.paused {
		if ln.paused && l.now >= ln.resumeAt {
			l.resumeListener(ln)
		}
	}
	l.paused = compactPaused(l.paused)
	if l.timed == 0 {
		l.idleTick = 0
	}
	switch want := l.wantTick(); {
	case want == 0:
		l.setTimer(0)
	case want != l.tick:
		l.setTimer(want)
	}
}

// wantTick is the sweep interval the loop's state asks for; 0: none.
func (l *loop) wantTick() time.Duration {
	if l.dialing > 0 || len(l.paused) > 0 {
		return loopTickBusy
	}
	return l.idleTick
}

func compactPaused(ls []*loopListener) []*loopListener {
	out := ls[:0]
	for _, ln := range ls {
		if ln.paused {
			out = append(out, ln)
		}
	}
	clear(ls[len(out):])
	return out
}

// sweepDials ends the dial attempts whose time is up and keeps the connections still
// connecting in loop.dials.
func (l *loop) sweepDials() {
	cur := l.dials
	l.dials = l.dialsSpare[:0]
	for i, c := range cur {
		cur[i] = nil
		c.inDials = false
		if c.closed || !c.connecting {
			continue
		}
		if l.now >= c.dl.deadline {
			l.dialFailed(c, unix.ETIMEDOUT) // the next attempt, if any, puts c back
			continue
		}
		c.inDials = true
		l.dials = append(l.dials, c)
	}
	l.dialsSpare = cur[:0]
}

// sweepIdle ends c when it has moved nothing for its proxy's IdleTimeout.
func (l *loop) sweepIdle(c *lconn) {
	if t := c.p.IdleTimeout; t > 0 && c.connected && l.now-c.last >= t {
		l.finish(c, true, errIdle)
	}
}

// dialStarted counts c's new dial attempt (c.connecting is set) and lists it for the sweep.
func (l *loop) dialStarted(c *lconn) {
	l.dialing++
	if !c.inDials {
		c.inDials = true
		l.dials = append(l.dials, c)
	}
	l.armTimer(loopTickBusy)
}

// dropDial takes c, whose dial ended off the loop's books (frozen), out of loop.dials.
func (l *loop) dropDial(c *lconn) {
	if !c.inDials {
		return
	}
	c.inDials = false
	if i := slices.Index(l.dials, c); i >= 0 {
		l.dials = slices.Delete(l.dials, i, i+1)
	}
}

// dialEnded uncounts c's dial attempt (c.connecting is cleared). With no dial left, loop.dials
// is emptied rather than left to the next sweep: the timer may be disarmed by then.
func (l *loop) dialEnded() {
	l.dialing--
	if l.dialing == 0 {
		for i, c := range l.dials {
			c.inDials = false
			l.dials[i] = nil
		}
		l.dials = l.dials[:0]
	}
}

// countTimed counts c among the connections with an IdleTimeout.
func (l *loop) countTimed(c *lconn) {
	t := c.p.IdleTimeout
	if t <= 0 || c.timed {
		return
	}
	c.timed = true
	l.timed++
	tick := min(max(t/8, loopTickIdleMin), loopTickIdleMax)
	if l.idleTick == 0 || tick < l.idleTick {
		l.idleTick = tick
	}
	l.armTimer(l.idleTick)
}

func (l *loop) uncountTimed(c *lconn) {
	if c.timed {
		c.timed = false
		l.timed--
	}
}

// attach adds a proxy's listening socket to the loop, level-triggered.
func (l *loop) attach(ln *loopListener) error {
	ln.setNoDelay = noDelayToSet(ln.fd)
	ln.gen = l.track(ln.fd, fdSlot{ln: ln})
	if err := l.watchListener(ln); err != nil {
		l.forget(ln.fd)
		return fmt.Errorf("epoll_ctl add listening socket: %w", err)
	}
	return nil
}

// watchListener adds ln to the epoll set, level-triggered. (The listener is in several loops'
// sets, see loopsPerPort. EPOLLEXCLUSIVE would not make one of them wake per connection: it
// picks among threads blocked in epoll_wait on a descriptor, and the loops' descriptors are
// waited on in Go's poller, through its own epoll — checked: both nested sets are signalled.)
func (l *loop) watchListener(ln *loopListener) error {
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(ln.fd), Pad: int32(ln.gen)}
	return unix.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, ln.fd, &ev)
}

// detach takes a listener off the loop (it stays open); the last of its proxy's listeners to go
// ends its serving.
func (l *loop) detach(ln *loopListener) {
	if s := l.slot(ln.fd); s.ln != ln {
		return
	}
	if !ln.paused {
		_ = unix.EpollCtl(l.epfd, unix.EPOLL_CTL_DEL, ln.fd, nil)
	}
	ln.paused = false
	l.forget(ln.fd)
	ln.p.listenerOff()
}

// pauseListener takes ln out of the epoll set for the next backpressure.Pause delay: a
// level-triggered listener whose accept fails for want of descriptors would be ready again at
// once.
func (l *loop) pauseListener(ln *loopListener, err error) {
	p := ln.p
	if ln.pause.Attempts == 0 {
		p.logWarn().Err(err).Msg("accept: out of file descriptors or memory; pausing new connections until some close")
	}
	d := ln.pause.Next()
	if h := p.testHookAcceptPause; h != nil {
		h(ln.pause.Attempts, d)
	}
	_ = unix.EpollCtl(l.epfd, unix.EPOLL_CTL_DEL, ln.fd, nil)
	ln.paused, ln.resumeAt = true, l.now+d
	l.paused = append(l.paused, ln)
	l.armTimer(loopTickBusy)
}

// resumeListener puts a paused listener back into the epoll set.
func (l *loop) resumeListener(ln *loopListener) {
	ln.paused = false
	if err := l.watchListener(ln); err != nil {
		ln.p.logError().Err(err).Msg("event loop: cannot watch the listening socket again; this loop accepts no more connections for the port")
		l.forget(ln.fd)
		ln.p.listenerOff()
	}
}

// accept takes one connection from ln, admits it as startConn does and starts its dial.
func (l *loop) accept(ln *loopListener) {
	p := ln.p
	var sa unix.RawSockaddrAny
	saLen := uint32(unix.SizeofSockaddrAny)
	// The system call itself: x/sys/unix's Accept4 parses the address with a getsockopt more.
	r, _, errno := unix.RawSyscall6(unix.SYS_ACCEPT4, uintptr(ln.fd), uintptr(unsafe.Pointer(&sa)),
		uintptr(unsafe.Pointer(&saLen)), syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC, 0, 0)
	if errno != 0 {
		l.acceptFailed(ln, errno)
		return
	}
	cfd := int(r)
	if ln.setNoDelay != 0 { // Go's default for every socket; otherwise inherited (noDelayToSet)
		_ = sys.SetsockoptInt(cfd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
		if ln.setNoDelay > 0 {
			ln.setNoDelay--
		}
	}
	if ln.pause.Attempts > 0 {
		p.logInfo().Int("retries", ln.pause.Attempts).Dur("paused", time.Since(ln.pause.Start)).
			Msg("accepting connections again")
		ln.pause = backpressure.Pause{}
	}
	if !p.admitLoopConn() {
		p.refused()
		sys.Reset(cfd)
		return
	}
	p.sink().ConnAccepted()
	l.served.Add(1)
	c := &lconn{p: p, l: l, fd: [2]int32{int32(cfd), -1}, clientAddr: sys.RawAddrPort(&sa), last: l.now}
	if err := l.register(c, 0); err != nil {
		l.finish(c, true, err)
		return
	}
	l.countTimed(c)
	l.dial(c)
}

// noDelayToSet returns how many of a listener's accepted sockets need TCP_NODELAY set on them
// (loopListener.setNoDelay). A socket accept(2) returns inherits TCP_NODELAY from its listener
// if the listener had it when the connection was set up (Listen sets it before listening;
// ListenerFromFile on a socket handed over, which may hold connections set up before): so
// those queued now, and -1 (all) for a listener without it or when it cannot be asked.
func noDelayToSet(fd int) int {
	if v, err := sys.GetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY); err != nil || v == 0 {
		return -1
	}
	info, err := unix.GetsockoptTCPInfo(fd, unix.IPPROTO_TCP, unix.TCP_INFO)
	if err != nil {
		return -1
	}
	return int(info.Unacked) // a listening socket's: its accept queue's length
}

// acceptFailed handles an accept4 error as acceptLoop does.
func (l *loop) acceptFailed(ln *loopListener, errno syscall.Errno) {
	p := ln.p
	switch {
	case errno == syscall.EAGAIN || errno == syscall.EINTR:
	case backpressure.IsResourceExhausted(errno):
		l.pauseListener(ln, errno)
	case isPendingConnError(errno):
		p.logDebug().Err(errno).Msg("accept: connection failed before it was accepted")
	default:
		// Every loop's listener meets the error: the first reports it, for Serve too.
		err := fmt.Errorf("accept on %s: %w", p.Listener.Addr(), errno)
		p.mu.Lock()
		first := p.onLoop.err == nil
		if first {
			p.onLoop.err = err
		}
		p.mu.Unlock()
		if first {
			p.logError().Err(err).Msg("TCP proxy stopped")
		}
		l.detach(ln)
	}
}

// originalDst returns c's original destination (see tcpOriginalDst), asked once.
func (c *lconn) originalDst() netip.AddrPort {
	d := c.dl
	if !d.dstAsked {
		d.dst, d.dstAsked = fdOriginalDst(int(c.fd[0])), true
	}
	return d.dst
}

// dial asks the Chooser for an endpoint and starts connecting to it, trying the next endpoint
// at once when a socket cannot even start connecting; the connect's end comes as EPOLLOUT
// (connectDone) or as the sweep's timeout (dialFailed).
func (l *loop) dial(c *lconn) {
	p := c.p
	if c.dl == nil {
		c.dl = &ldial{}
	}
	dl := c.dl
	dst := netip.AddrPort{}
	if p.wantsOriginalDst() {
		dst = c.originalDst()
	}
	for {
		timeout, ok := dl.plan.next(p)
		if !ok {
			break
		}
		target, err := p.choose(&dl.plan, c.clientAddr, dst)
		if err != nil {
			l.finish(c, true, err)
			return
		}
		c.endpoint, dl.proxyProto = target.Endpoint, target.ProxyProtocol
		fd, err := l.connect(c, target)
		if err == nil {
			c.fd[1] = int32(fd)
			if err = l.register(c, 1); err != nil {
				_ = sys.Close(fd)
				c.fd[1] = -1
			}
		}
		if err == nil {
			c.connecting, dl.deadline = true, l.now+timeout
			l.dialStarted(c)
			return
		}
		if backpressure.IsResourceExhausted(err) {
			p.socketFailed(c.clientAddr, target.Endpoint, err)
			l.finish(c, true, err)
			return
		}
		p.attemptFailed(&dl.plan, c.clientAddr, target.Endpoint, err)
	}
	l.finish(c, true, p.unreachable(&dl.plan, c.clientAddr, dst))
}

// connect opens a non-blocking socket to target's endpoint, with the endpoint options of
// today's dial (TCP_NODELAY, keepalive), transparent when asked and possible, and starts its
// connect.
func (l *loop) connect(c *lconn, target forward.Target) (int, error) {
	ep := target.Endpoint
	family := unix.AF_INET6
	if ep.Addr().Unmap().Is4() {
		family = unix.AF_INET
	}
	fd, err := sys.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("socket: %w", err)
	}
	_ = sys.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	_ = sys.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1)
	_ = sys.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, int(keepAliveIdle/time.Second))
	if target.Transparent && sys.CanDialFrom(c.clientAddr.Addr(), ep) {
		if terr := bindTransparent(fd, c.clientAddr.Addr()); terr != nil {
			_ = sys.Close(fd)
			logscope.TransparentFallback(logscope.Logger(c.p.Log), c.p.LogScope, &c.p.transparentWarned, terr, c.clientAddr, ep)
			target.Transparent = false
			return l.connect(c, target)
		}
	}
	if err := sys.Connect(fd, sys.EncodeSockaddr(netip.AddrPortFrom(ep.Addr().Unmap(), ep.Port()))); err != nil && err != unix.EINPROGRESS {
		_ = sys.Close(fd)
		return -1, fmt.Errorf("connect to %s: %w", ep, err)
	}
	return fd, nil
}

// bindTransparent makes fd send from client's address (any port): IP_TRANSPARENT and bind.
func bindTransparent(fd int, client netip.Addr) error {
	client = client.Unmap()
	var sa unix.Sockaddr
	var err error
	if client.Is4() {
		err = unix.SetsockoptInt(fd, unix.SOL_IP, unix.IP_TRANSPARENT, 1)
		sa = &unix.SockaddrInet4{Addr: client.As4()}
	} else {
		err = unix.SetsockoptInt(fd, unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
		sa = &unix.SockaddrInet6{Addr: client.As16()}
	}
	if err != nil {
		return fmt.Errorf("%w: set IP_TRANSPARENT: %w", sys.ErrTransparentSetup, err)
	}
	if err := unix.Bind(fd, sa); err != nil {
		return fmt.Errorf("%w: bind to %s: %w", sys.ErrTransparentSetup, client, err)
	}
	return nil
}

// connectDone finishes the connect of c's endpoint socket on its first events: relays on
// success, else tries the next endpoint. A connecting socket reports EPOLLOUT alone only once
// connected; the connect's error is asked for only with EPOLLERR or EPOLLHUP.
func (l *loop) connectDone(c *lconn, events uint32) {
	if events&(unix.EPOLLERR|unix.EPOLLHUP) != 0 {
		serr, err := sys.GetsockoptInt(int(c.fd[1]), unix.SOL_SOCKET, unix.SO_ERROR)
		if err == nil && serr != 0 {
			err = syscall.Errno(serr)
		}
		if err != nil {
			l.dialFailed(c, err)
			return
		}
	}
	c.connecting, c.connected, c.last = false, true, l.now
	l.dialEnded()
	if c.dl.proxyProto != proxyproto.None && !l.queueProxyHeader(c) {
		return
	}
	c.dl = nil
	if c.freezing {
		l.freeze(c)
		return
	}
	l.pump(c)
}

// dialFailed ends the dial attempt in progress and tries the next endpoint.
func (l *loop) dialFailed(c *lconn, err error) {
	p := c.p
	l.unregister(c, 1)
	_ = sys.Close(int(c.fd[1]))
	c.fd[1], c.connecting = -1, false
	l.dialEnded()
	p.attemptFailed(&c.dl.plan, c.clientAddr, c.endpoint, err)
	l.dial(c)
}

// queueProxyHeader puts the PROXY protocol header before anything the client sends; false when
// it could not be made (the connection is reset).
func (l *loop) queueProxyHeader(c *lconn) bool {
	dst := c.originalDst()
	local := netip.AddrPort{}
	if !dst.IsValid() {
		local = sys.LocalAddr(int(c.fd[0]))
	}
	hdr, err := c.p.proxyHeader(c.dl.proxyProto, c.clientAddr, c.endpoint, dst, local)
	if err != nil {
		l.finish(c, true, err)
		return false
	}
	c.dir[0].pending = append(hdr, c.dir[0].pending...)
	return true
}

// event handles the readiness of side of c.
func (l *loop) event(c *lconn, side int, events uint32) {
	if c.closed {
		return
	}
	if events&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		c.dir[side].readable = true
		if events&unix.EPOLLRDHUP != 0 {
			c.dir[side].rdhup = true
		}
	}
	if c.connecting {
		if side == 1 && events&(unix.EPOLLOUT|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
			l.connectDone(c, events)
		}
		return // the client's data waits for the endpoint
	}
	if c.connected {
		l.pump(c)
	}
}

// pump moves what it can both ways: a direction with nothing to do costs no system call.
func (l *loop) pump(c *lconn) {
	for d := range 2 {
		if !l.pumpDir(c, d) {
			return
		}
	}
}

// pumpAgain gives the connections that read their share last turn another turn.
func (l *loop) pumpAgain() {
	if len(l.again) == 0 {
		return
	}
	again := l.again
	l.again = nil
	for _, c := range again {
		c.queued = false
		if !c.closed && c.connected {
			l.pump(c)
		}
	}
	clear(again)
	if l.again == nil {
		l.again = again[:0]
	}
}

// pumpDir moves direction d of c: pending bytes first, then reads and writes until the source
// is drained, the destination is full, or the turn's share is read. False when c ended.
func (l *loop) pumpDir(c *lconn, d int) bool {
	dd := &c.dir[d]
	if dd.spliced {
		return l.spliceDir(c, d)
	}
	src, dst := int(c.fd[d]), int(c.fd[1-d])
	for reads := 0; ; {
		if flushed, alive := l.flushPending(c, d); !flushed {
			return alive
		}
		if dd.eof {
			return l.passEOF(c, d)
		}
		if !dd.readable {
			return true
		}
		if reads == loopReadsPerTurn {
			l.queueAgain(c)
			return true
		}
		reads++
		n, err := sys.Read(src, l.buf)
		switch {
		case err == unix.EAGAIN:
			dd.readable = false
			return true
		case err == unix.EINTR:
			continue
		case err != nil:
			l.fail(c, d, err)
			return false
		case n == 0:
			dd.eof = true
			continue
		}
		c.last = l.now
		if n < len(l.buf) && !dd.rdhup {
			dd.readable = false // drained: more data queues a new edge
		}
		w, err := sys.Write(dst, l.buf[:n])
		switch {
		case err == unix.EAGAIN || err == unix.EINTR:
			w = 0
		case err != nil:
			l.fail(c, d, err)
			return false
		}
		copiedHook(w)
		c.n[d] += int64(w)
		if w < n {
			dd.pending = append([]byte(nil), l.buf[w:n]...)
		}
		if n == len(l.buf) && spliceOK {
			dd.spliced = true // bulk: spliceDir writes what is pending first
			return l.spliceDir(c, d)
		}
	}
}

// flushPending writes direction d's pending bytes to its destination. flushed: nothing is
// pending any more; otherwise alive says whether c goes on (the destination is full: EPOLLOUT
// on it pumps again) or ended (the write failed: both sides were reset).
func (l *loop) flushPending(c *lconn, d int) (flushed, alive bool) {
	dd := &c.dir[d]
	dst := int(c.fd[1-d])
	for len(dd.pending) > 0 {
		n, err := sys.Write(dst, dd.pending)
		if err == unix.EAGAIN || err == unix.EINTR {
			return false, true
		}
		if err != nil {
			l.fail(c, d, err)
			return false, false
		}
		copiedHook(n)
		c.n[d] += int64(n)
		c.last = l.now
		dd.pending = dd.pending[n:]
	}
	dd.pending = nil // a direction's buffer lives only while something is pending
	return true, true
}

// copiedHook reports n bytes written from a user-space buffer to testHookCopied, if set.
func copiedHook(n int) {
	if h := testHookCopied; h != nil && n > 0 {
		h(int64(n))
	}
}

// spliceOK: the loops splice bulk traffic (tests turn it off to compare).
var spliceOK = true

// spliceDir is pumpDir for a spliced direction: the pipe is emptied into the destination
// first, then the source is spliced into it until EAGAIN; the pipe goes back to the pool as
// soon as it is empty and the source drained. Without a pipe (the Budget is spent), the
// direction goes back to copying.
func (l *loop) spliceDir(c *lconn, d int) bool {
	dd := &c.dir[d]
	src, dst := int(c.fd[d]), int(c.fd[1-d])
	for reads := 0; ; {
		if flushed, alive := l.flushPending(c, d); !flushed { // what the switch to splicing left
			return alive
		}
		if dd.inPipe > 0 {
			n, err := sys.Splice(dd.pipe.r, dst, dd.inPipe, spliceMove|spliceNonblock)
			if err == unix.EAGAIN || err == unix.EINTR {
				return true // EPOLLOUT on dst calls again
			}
			if err != nil {
				l.fail(c, d, err)
				return false
			}
			if h := testHookSpliced; h != nil {
				h(n)
			}
			dd.inPipe -= int(n)
			c.n[d] += n
			c.last = l.now
			if dd.inPipe > 0 {
				continue
			}
		}
		if dd.eof {
			l.putPipe(c, dd)
			return l.passEOF(c, d)
		}
		if !dd.readable {
			l.putPipe(c, dd)
			return true
		}
		if reads == loopReadsPerTurn {
			l.queueAgain(c)
			return true
		}
		reads++
		if dd.pipe == nil {
			p, err := c.p.pipePool().get()
			if err != nil { // out of pipes: copy instead
				dd.spliced = false
				return l.pumpDir(c, d)
			}
			dd.pipe = p
		}
		n, err := sys.Splice(src, dd.pipe.w, spliceChunk, spliceMove|spliceNonblock)
		switch {
		case err == unix.EAGAIN:
			dd.readable = false
			continue
		case err == unix.EINTR:
			continue
		case err != nil:
			l.fail(c, d, err)
			return false
		case n == 0:
			dd.eof = true
			continue
		}
		dd.inPipe += int(n)
		c.last = l.now
	}
}

// putPipe returns a direction's empty pipe to the pool.
func (l *loop) putPipe(c *lconn, dd *ldir) {
	if dd.pipe != nil && dd.inPipe == 0 {
		c.p.pipePool().put(dd.pipe)
		dd.pipe = nil
	}
}

// dropPipes lets c's pipes go: empty ones back to the pool, others closed.
func (l *loop) dropPipes(c *lconn) {
	for d := range 2 {
		dd := &c.dir[d]
		if dd.pipe == nil {
			continue
		}
		if dd.inPipe == 0 {
			c.p.pipePool().put(dd.pipe)
		} else {
			c.p.pipePool().discard(dd.pipe)
		}
		dd.pipe, dd.inPipe = nil, 0
	}
}

// unsplice moves what a direction's pipe holds into its pending bytes (a freeze exports them)
// and lets the pipe go; the direction copies from then on. False if the pipe could not be read.
func (l *loop) unsplice(c *lconn, d int) error {
	dd := &c.dir[d]
	dd.spliced = false
	if dd.pipe == nil {
		return nil
	}
	for dd.inPipe > 0 {
		buf := make([]byte, dd.inPipe)
		n, err := unix.Read(dd.pipe.r, buf)
		if err != nil {
			return fmt.Errorf("read the splice pipe: %w", err)
		}
		dd.pending = append(dd.pending, buf[:n]...)
		dd.inPipe -= n
	}
	l.putPipe(c, dd)
	return nil
}

// queueAgain has c pumped next turn.
func (l *loop) queueAgain(c *lconn) {
	if !c.queued {
		c.queued = true
		l.again = append(l.again, c)
	}
}

// passEOF passes direction d's EOF on: shutdown(SHUT_WR) of the destination, or, for the
// connection's second EOF, the close of both sockets. False when c ended.
func (l *loop) passEOF(c *lconn, d int) bool {
	dd := &c.dir[d]
	if dd.shut {
		return true
	}
	dd.shut = true
	if c.dir[1-d].shut {
		if h := testHookCloseWriteSkipped; h != nil {
			h()
		}
		l.finish(c, false, nil)
		return false
	}
	if err := sys.Shutdown(int(c.fd[1-d]), unix.SHUT_WR); err != nil {
		l.fail(c, d, err)
		return false
	}
	return true
}

// fail ends c after an error in direction d: both sides are reset.
func (l *loop) fail(c *lconn, d int, err error) {
	what := "toEndpointErr"
	if d == 1 {
		what = "fromEndpointErr"
	}
	if e := c.p.logDebug(); e.Enabled() {
		e.AnErr(what, err).Stringer("client", c.clientAddr).Msg("relay failed; resetting both sides")
	}
	l.finish(c, true, err)
}

// finish ends c: closes its sockets (with an RST when reset), reports it (closed with its bytes
// once connected, failed before), and lets the proxy know.
func (l *loop) finish(c *lconn, reset bool, err error) {
	if c.closed {
		return
	}
	if c.freezing && !c.connected && err != errCut {
		l.freeze(c) // a dial that failed while frozen: the adopter tries again (parkUndialled)
		return
	}
	c.closed = true
	p := c.p
	for side := range 2 {
		fd := int(c.fd[side])
		if fd < 0 {
			continue
		}
		l.forget(fd)
		if reset {
			sys.Reset(fd)
		} else {
			_ = sys.Close(fd)
		}
		c.fd[side] = -1
	}
	if c.connecting {
		c.connecting = false
		l.dialEnded()
	}
	l.uncountTimed(c)
	l.dropPipes(c)
	p.connEnded(c.connected, c.clientAddr, c.endpoint, c.n[0], c.n[1], err)
	p.loopConnEnded()
}

// osPendingConnErrnos are the accept errors of a failed pending connection that only Linux has
// (see isPendingConnError).
var osPendingConnErrnos = []syscall.Errno{syscall.ENONET}
