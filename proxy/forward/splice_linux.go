package forward

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Copying: a direction of a TCP connection copies through a small user-space buffer (read and
// write) until a read fills the buffer, then moves its bytes socket → pipe → socket inside the
// kernel with splice(2) for the rest of its life ("splice-auto", as HAProxy has it): request and
// response traffic costs a read and a write per message instead of two splices, and takes no
// pipe; bulk traffic is spliced. (Either way the source is read once more, to EAGAIN, before the
// copier waits: the netpoller is edge-triggered, and an EOF that came with the data would not
// wake it again.)
// The buffer comes from a process-wide pool, taken inside the read's readiness callback only
// once data has arrived and given back as soon as it is written: an idle connection holds none.
// Unlike net.TCPConn.ReadFrom, which holds a pipe (two descriptors and its buffer) for the whole
// life of the connection, a splicing direction takes a pipe from the proxy's pool only while data
// is flowing and returns it, empty, as soon as the source has nothing more to read. An idle
// connection therefore costs its two sockets and nothing else, which is what lets a proxy hold
// many idle connections within a file-descriptor limit.

const (
	// pipeSize is the capacity asked for each pipe (F_SETPIPE_SZ), and spliceChunk the most one
	// splice call moves into it: 1 MiB, /proc/sys/fs/pipe-max-size's default, as Go uses.
	pipeSize    = 1 << 20
	spliceChunk = pipeSize
	// pipePoolMax bounds the idle pipes a proxy keeps; more are closed when returned.
	pipePoolMax = 32

	fSetPipeSz     = 1031 // F_SETPIPE_SZ (fcntl.h); not in package syscall
	spliceMove     = 0x1  // SPLICE_F_MOVE
	spliceNonblock = 0x2  // SPLICE_F_NONBLOCK
)

// pipe is a kernel pipe used as the splice buffer of one direction while data flows.
type pipe struct{ r, w int }

func newPipe() (*pipe, error) {
	var fds [2]int
	if err := syscall.Pipe2(fds[:], syscall.O_CLOEXEC|syscall.O_NONBLOCK); err != nil {
		return nil, os.NewSyscallError("pipe2", err)
	}
	// A smaller pipe still works, with more system calls: ignore a refusal.
	_, _, _ = syscall.Syscall(syscall.SYS_FCNTL, uintptr(fds[1]), fSetPipeSz, pipeSize)
	return &pipe{r: fds[0], w: fds[1]}, nil
}

// buffered returns the bytes the pipe holds.
func (p *pipe) buffered() (int, error) { return fionread(p.r) }

// fionread returns the bytes ready to read on fd (FIONREAD): a socket's receive queue, a
// pipe's content.
func fionread(fd int) (int, error) {
	n, err := unix.IoctlGetInt(fd, unix.TIOCINQ) // FIONREAD
	if err != nil {
		return 0, os.NewSyscallError("ioctl FIONREAD", err)
	}
	return n, nil
}

func (p *pipe) close() {
	_ = syscall.Close(p.r)
	_ = syscall.Close(p.w)
}

// pipePool keeps up to pipePoolMax empty pipes for reuse. Its zero value is ready; after
// closeAll it still hands out new pipes but keeps none. Every pipe it creates is taken from
// budget (nil: unlimited) until it is closed.
type pipePool struct {
	// testHookNewPipe, if set, replaces newPipe.
	testHookNewPipe func() (*pipe, error)
	budget          *Budget

	mu     sync.Mutex
	free   []*pipe
	closed bool
}

func (pp *pipePool) get() (*pipe, error) {
	pp.mu.Lock()
	if n := len(pp.free); n > 0 {
		p := pp.free[n-1]
		pp.free = pp.free[:n-1]
		pp.mu.Unlock()
		return p, nil
	}
	pp.mu.Unlock()
	if !pp.budget.take(pipeFDs) {
		return nil, errBudgetSpent
	}
	newPipe := newPipe
	if h := pp.testHookNewPipe; h != nil {
		newPipe = h
	}
	p, err := newPipe()
	if err != nil {
		pp.budget.give(pipeFDs)
	}
	return p, err
}

// discard closes a pipe of the pool's and returns its descriptors to the budget.
func (pp *pipePool) discard(p *pipe) {
	p.close()
	pp.budget.give(pipeFDs)
}

// put returns an empty pipe to the pool (or closes it). A pipe that still holds bytes, or whose
// content cannot be told, is closed: the pool is every service port's, and a pipe handed out
// is written to a socket from its first byte, so a stale byte would reach another connection.
func (pp *pipePool) put(p *pipe) {
	if n, err := p.buffered(); n != 0 || err != nil {
		pp.discard(p)
		return
	}
	pp.mu.Lock()
	if !pp.closed && len(pp.free) < pipePoolMax {
		pp.free = append(pp.free, p)
		p = nil
	}
	pp.mu.Unlock()
	if p != nil {
		pp.discard(p)
	}
}

// dropIdle closes the idle pipes and returns how many it closed; the pool goes on.
func (pp *pipePool) dropIdle() int {
	pp.mu.Lock()
	free := pp.free
	pp.free = nil
	pp.mu.Unlock()
	for _, p := range free {
		pp.discard(p)
	}
	return len(free)
}

// closeAll closes the idle pipes; pipes returned later are closed too.
func (pp *pipePool) closeAll() {
	pp.mu.Lock()
	pp.closed = true
	pp.mu.Unlock()
	pp.dropIdle()
}

// spliceCopy moves everything src sends to dst until src's EOF (nil error) or a failure of
// either socket, and returns the bytes moved: through a pooled buffer until a read fills it,
// then with splice(2) (see the top of this file). A buffer or pipe is held only between src
// becoming readable and its data being written to dst. With a non-nil idle, it fails with
// errIdle once the connection has moved no byte either way for idle's timeout.
//
// Once frozen is set and a deadline in the past is set on src (read) and dst (write), it stops
// at the next wakeup with errFrozen and returns the bytes it had read from src but not yet
// written to dst (the buffer's or the pipe's content, copied out): nothing is lost. frozen is
// read only on wakeups and errors, never per chunk.
func spliceCopy(pool *pipePool, dst, src *net.TCPConn, idle *idleClock, frozen *atomic.Bool) (int64, []byte, error) {
	s, err := newSplicer(pool, dst, src)
	if err != nil {
		return 0, nil, err
	}
	s.idle, s.frozen = idle, frozen
	if err := s.armIdle(); err != nil {
		return 0, nil, err
	}
	n, err := s.run()
	return n, s.pending, err
}

// errWouldBlock: a direction that may park found nothing to read (see splicer.parkAfter).
var errWouldBlock = errors.New("nothing to read: park")

// errFrozen: a copy stopped because its connection is being frozen for a hand-over.
var errFrozen = errors.New("connection frozen for a hand-over")

// copyBufSize is the user-space buffer a direction copies through before it splices (HAProxy's
// default bufsize); a read that fills it switches the direction to splice. It is also the
// buffer of a splicing direction that cannot have a pipe (out of descriptors).
const copyBufSize = 16 << 10

// copyBufs pools the copy buffers of every connection.
var copyBufs = sync.Pool{New: func() any { b := make([]byte, copyBufSize); return &b }}

// testHookCopied, if set, is called with the bytes of each chunk a direction moved through a
// user-space buffer, and testHookSpliced with those of each chunk it spliced. Package
// variables, set by tests before their proxy starts and cleared after it ends.
var testHookCopied, testHookSpliced func(n int64)

// splicer is the state of one spliceCopy. It lives on the heap so that the goroutine waiting in
// run for src to become readable parks with a shallow stack: an idle connection's goroutines
// then shrink to the runtime's smallest stacks at the next garbage collection (a stack is halved
// only while less than a quarter of it is in use), which is most of the proxy's memory per idle
// connection.
type splicer struct {
	pool         *pipePool
	dst, src     *net.TCPConn
	srcRC, dstRC syscall.RawConn
	fillFn       func(fd uintptr) bool // s.fill, bound once
	drainFn      func(fd uintptr) bool // s.drain, bound once

	spliced bool    // a read filled the buffer: the direction splices from now on
	buf     *[]byte // the copy buffer, held only while it has data not yet written
	off     int     // where in buf the unwritten bytes start
	p       *pipe   // held only while data flows; always empty when returned to the pool
	total   int64   // bytes moved to dst
	filled  int64   // bytes read and not yet written (in buf from off, or in the pipe)
	err     error   // the last fill's or drain's system call error
	errOp   string  // its system call
	idle    *idleClock
	frozen  *atomic.Bool // set when the connection is being frozen; nil: never
	pending []byte       // read from src, not written to dst, when run stopped with errFrozen

	// parkAfter says when run gives its goroutine up (returns errWouldBlock) instead of
	// waiting for src on it: negative never; 0 at every wait; else once the direction has
	// moved nothing for parkAfter to twice that (see waitExpired), so that a busy connection
	// keeps its goroutine. The caller parks the direction on a Poller and calls run again, on
	// another goroutine, when src is readable (see park.go).
	parkAfter time.Duration
	parkNow   bool      // the next wait parks
	blocked   bool      // fill found nothing to read and parkNow was set
	active    bool      // parkAfter > 0: data moved since the last park deadline
	waitUntil time.Time // parkAfter > 0: the park deadline (src's read deadline unless the idle clock's comes first)
}

func newSplicer(pool *pipePool, dst, src *net.TCPConn) (*splicer, error) {
	srcRC, err := src.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("splice: %w", err)
	}
	dstRC, err := dst.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("splice: %w", err)
	}
	s := &splicer{pool: pool, dst: dst, src: src, srcRC: srcRC, dstRC: dstRC, parkAfter: -1}
	s.fillFn, s.drainFn = s.fill, s.drain
	return s, nil
}

// isFrozen reports whether the connection is being frozen.
func (s *splicer) isFrozen() bool { return s.frozen != nil && s.frozen.Load() }

// frozenBy reports whether err is the deadline a freeze set.
func (s *splicer) frozenBy(err error) bool {
	return errors.Is(err, os.ErrDeadlineExceeded) && s.isFrozen()
}

// run is spliceCopy's loop; it returns errWouldBlock when the direction is to park (see
// parkAfter), and may then be called again. Its frame is small on purpose: see splicer.
func (s *splicer) run() (int64, error) {
	defer s.release()
	for {
		// The read or splice runs inside RawConn.Read, so a readiness event that comes after
		// its EAGAIN wakes the wait; while waiting, no buffer or pipe is held.
		s.filled, s.err, s.blocked = 0, nil, false
		if err := s.srcRC.Read(s.fillFn); err != nil {
			if s.frozenBy(err) {
				return s.total, errFrozen
			}
			if err = s.waitExpired(err); err == nil {
				continue // the other direction moved data, or the wait is to park: wait again
			}
			return s.total, err
		}
		if s.blocked {
			return s.total, errWouldBlock
		}
		if s.err != nil {
			return s.total, os.NewSyscallError(s.errOp, s.err)
		}
		if s.filled == 0 {
			return s.total, nil // EOF
		}
		if err := s.moved(); err != nil { // a freeze, or src closed: the chunk is not written
			return s.total, s.stopFilled(errors.Is(err, errFrozen), err)
		}
		s.idle.touch()
		if h := s.chunkHook(); h != nil {
			h(s.filled)
		}
		if err := s.dstRC.Write(s.drainFn); err != nil || s.err != nil {
			return s.total, s.drainFailed(err)
		}
		s.releaseBuf()
	}
}

// moved notes a chunk read, for parking: with parkAfter > 0, a direction that parked starts
// its delay again (the park deadline is set anew), and a running one is marked active, which
// costs no clock reading per chunk.
func (s *splicer) moved() error {
	switch {
	case s.parkAfter <= 0:
	case s.parkNow:
		s.parkNow, s.active = false, false
		if err := s.setWaitDeadline(); err != nil {
			return err
		}
		return s.checkFrozen()
	default:
		s.active = true
	}
	return nil
}

// waitExpired interprets err from a wait on src: errIdle when the connection has been idle for
// the idle timeout; nil when it was a deadline of the idle clock or of parking and the wait is
// to go on (or park: parkNow is set), with the next deadline set; err itself otherwise. The
// park deadline comes every parkAfter: the direction parks at the first one that finds it was
// not active since the one before.
func (s *splicer) waitExpired(err error) error {
	if !errors.Is(err, os.ErrDeadlineExceeded) || (s.idle == nil && s.parkAfter <= 0) {
		return err
	}
	if s.idle.isExpired() {
		return errIdle
	}
	if s.parkAfter > 0 && !s.parkNow && !time.Now().Before(s.waitUntil) {
		s.parkNow = !s.active
		s.active = false
	}
	if err := s.setWaitDeadline(); err != nil {
		return err
	}
	return s.checkFrozen() // the deadline may have replaced the freeze's
}

// setWaitDeadline sets src's read deadline for the next waits: the idle clock's expiry or,
// while delayed parking is not due, the next park deadline (now plus parkAfter), whichever
// comes first (none: no deadline).
func (s *splicer) setWaitDeadline() error {
	d := s.idle.expiry()
	if s.parkAfter > 0 && !s.parkNow {
		s.waitUntil = time.Now().Add(s.parkAfter)
		if d.IsZero() || s.waitUntil.Before(d) {
			d = s.waitUntil
		}
	}
	return s.src.SetReadDeadline(d)
}

// neverPark turns parking off for good: the direction waits on its goroutine from now on, with
// the idle clock's deadline only. (An error setting it is the closed socket's, which the next
// read reports.)
func (s *splicer) neverPark() {
	s.parkAfter, s.parkNow = -1, false
	_ = s.setWaitDeadline()
}

// wouldBlock is fill's answer to EAGAIN: wait for src (false), or, when the direction is to
// park, return at once with blocked set (true).
func (s *splicer) wouldBlock() bool {
	if s.parkNow {
		s.blocked = true
		return true
	}
	return false
}

// chunkHook returns the test hook of the chunk just read: testHookCopied or testHookSpliced.
func (s *splicer) chunkHook() func(int64) {
	if s.buf != nil {
		return testHookCopied
	}
	return testHookSpliced
}

// armIdle sets src's idle deadline (and park deadline), then checks for a freeze: a freeze that set its deadline
// before armIdle replaced it is seen here, one that comes after wakes the wait. Call it once,
// before the first run.
func (s *splicer) armIdle() error {
	s.parkNow = s.parkAfter == 0
	var err error
	if s.parkAfter > 0 {
		err = s.setWaitDeadline()
	} else {
		err = s.idle.arm(s.src)
	}
	if err != nil {
		return err
	}
	return s.checkFrozen()
}

func (s *splicer) checkFrozen() error {
	if s.isFrozen() {
		return errFrozen
	}
	return nil
}

// drainFailed handles a failed write to dst (err from RawConn.Write, or s.err): see stopFilled.
func (s *splicer) drainFailed(err error) error {
	if err != nil && s.frozenBy(err) {
		return s.stopFilled(true, err)
	}
	if err == nil {
		err = os.NewSyscallError(s.errOp, s.err)
	}
	return s.stopFilled(false, err)
}

// stopFilled ends run with the s.filled bytes read from src and not written to dst (the
// buffer's, or the pipe's): on a freeze (frozen) they become s.pending and it returns errFrozen;
// otherwise, or if the pipe cannot be read, they are dropped with the pipe, which is closed, never
// pooled, and it returns the error.
func (s *splicer) stopFilled(frozen bool, err error) error {
	if frozen {
		if s.buf != nil {
			s.pending = bytes.Clone((*s.buf)[s.off : s.off+int(s.filled)])
			s.releaseBuf()
			return errFrozen
		}
		pending, rerr := s.p.readAll(int(s.filled))
		if rerr == nil {
			s.pending = pending
			return errFrozen // the pipe is empty again: release returns it to the pool
		}
		err = rerr
	}
	s.releaseBuf()
	if s.p != nil {
		s.pool.discard(s.p)
		s.p = nil
	}
	return err
}

// fill reads what src has ready: into a pipe with splice once the direction splices (taking a
// pipe from the pool first), else, or when no pipe can be had, into a copy buffer from the pool.
// A read that fills the buffer switches the direction to splice from the next chunk on. On
// EAGAIN it gives the pipe or buffer back and asks RawConn.Read to wait; on EOF s.filled is 0.
func (s *splicer) fill(fd uintptr) bool {
	if s.spliced && s.p == nil {
		if p, err := s.pool.get(); err == nil {
			s.p = p
		} // else out of descriptors: copy this chunk through the buffer
	}
	if s.p != nil {
		for {
			n, err := syscall.Splice(int(fd), nil, s.p.w, nil, spliceChunk, spliceMove|spliceNonblock)
			switch err {
			case syscall.EINTR:
				continue
			case syscall.EAGAIN:
				s.releasePipe()
				return s.wouldBlock()
			}
			s.filled, s.err, s.errOp = n, err, "splice"
			return true
		}
	}
	b := copyBufs.Get().(*[]byte)
	for {
		n, err := syscall.Read(int(fd), *b)
		switch err {
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			copyBufs.Put(b)
			return s.wouldBlock()
		}
		if err != nil || n <= 0 {
			copyBufs.Put(b)
			s.err, s.errOp = err, "read"
			return true // an error, or EOF
		}
		s.buf, s.off, s.filled = b, 0, int64(n)
		if n == len(*b) {
			s.spliced = true
		}
		return true
	}
}

// drain writes the s.filled bytes read (the buffer's or the pipe's) to dst, asking
// RawConn.Write to wait while dst's buffer is full.
func (s *splicer) drain(fd uintptr) bool {
	for s.filled > 0 {
		var m int64
		var err error
		if s.buf != nil {
			var w int
			w, err = syscall.Write(int(fd), (*s.buf)[s.off:s.off+int(s.filled)])
			m, s.errOp = int64(max(w, 0)), "write"
		} else {
			m, err = syscall.Splice(s.p.r, nil, int(fd), nil, int(s.filled), spliceMove|spliceNonblock)
			s.errOp = "splice"
		}
		switch err {
		case nil:
			s.filled -= m
			s.total += m
			s.off += int(m)
		case syscall.EINTR:
		case syscall.EAGAIN:
			return false
		default:
			s.err = err
			return true
		}
	}
	return true
}

// release gives back the buffer and returns the pipe, both empty (run's end).
func (s *splicer) release() {
	s.releaseBuf()
	s.releasePipe()
}

// releaseBuf returns the copy buffer to the pool.
func (s *splicer) releaseBuf() {
	if s.buf != nil {
		copyBufs.Put(s.buf)
		s.buf = nil
	}
}

// releasePipe returns the pipe, which is empty, to the pool.
func (s *splicer) releasePipe() {
	if s.p != nil {
		s.pool.put(s.p)
		s.p = nil
	}
}

// readAll reads the n bytes the pipe holds.
func (p *pipe) readAll(n int) ([]byte, error) {
	buf := make([]byte, n)
	for got := 0; got < n; {
		m, err := syscall.Read(p.r, buf[got:])
		switch {
		case err == syscall.EINTR:
			continue
		case err != nil:
			return nil, os.NewSyscallError("read pipe", err)
		case m == 0:
			return nil, fmt.Errorf("read pipe: %d of %d bytes", got, n)
		}
		got += m
	}
	return buf, nil
}
