package forward

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
)

// Splicing: every byte a TCP connection carries moves socket → pipe → socket inside the kernel
// with splice(2). Unlike net.TCPConn.ReadFrom, which holds a pipe (two descriptors and its
// buffer) for the whole life of the connection, spliceCopy takes a pipe from the proxy's pool
// only while data is flowing and returns it, empty, as soon as the source has nothing more to
// read. An idle connection therefore costs its two sockets and nothing else, which is what lets a
// proxy hold many idle connections within a file-descriptor limit.

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

// put returns an empty pipe to the pool (or closes it).
func (pp *pipePool) put(p *pipe) {
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

// spliceCopy moves everything src sends to dst with splice(2) until src's EOF (nil error) or a
// failure of either socket, and returns the bytes moved. A pipe is held only between src
// becoming readable and it running dry. With a non-nil idle, it fails with errIdle once the
// connection has moved no byte either way for idle's timeout.
//
// Once frozen is set and a deadline in the past is set on src (read) and dst (write), it stops
// at the next wakeup with errFrozen and returns the bytes it had read from src but not yet
// written to dst (the pipe's content, copied out): nothing is lost. frozen is read only on
// wakeups and errors, never per chunk.
func spliceCopy(pool *pipePool, dst, src *net.TCPConn, idle *idleClock, frozen *atomic.Bool) (int64, []byte, error) {
	s, err := newSplicer(pool, dst, src)
	if err != nil {
		return 0, nil, err
	}
	s.idle, s.frozen = idle, frozen
	n, err := s.run()
	return n, s.pending, err
}

// errFrozen: a copy stopped because its connection is being frozen for a hand-over.
var errFrozen = errors.New("connection frozen for a hand-over")

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

	p       *pipe // held only while data flows; always empty when returned to the pool
	total   int64 // bytes moved to dst
	filled  int64 // bytes in the pipe after the last fill
	noPipe  bool  // the last fill found no pipe to be had: copy the chunk through user space
	err     error // the last fill's or drain's splice error
	idle    *idleClock
	frozen  *atomic.Bool // set when the connection is being frozen; nil: never
	pending []byte       // read from src, not written to dst, when run stopped with errFrozen
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
	s := &splicer{pool: pool, dst: dst, src: src, srcRC: srcRC, dstRC: dstRC}
	s.fillFn, s.drainFn = s.fill, s.drain
	return s, nil
}

// isFrozen reports whether the connection is being frozen.
func (s *splicer) isFrozen() bool { return s.frozen != nil && s.frozen.Load() }

// frozenBy reports whether err is the deadline a freeze set.
func (s *splicer) frozenBy(err error) bool {
	return errors.Is(err, os.ErrDeadlineExceeded) && s.isFrozen()
}

// run is spliceCopy's loop. Its frame is small on purpose: see splicer.
func (s *splicer) run() (int64, error) {
	defer s.releasePipe()
	if err := s.armIdle(); err != nil {
		return 0, err
	}
	for {
		// The splice runs inside RawConn.Read, so a readiness event that comes after its
		// EAGAIN wakes the wait; while waiting, no pipe is held.
		s.filled, s.noPipe, s.err = 0, false, nil
		if err := s.srcRC.Read(s.fillFn); err != nil {
			if s.frozenBy(err) {
				return s.total, errFrozen
			}
			if err = s.idle.expired(s.src, err); err == nil {
				err = s.checkFrozen() // the re-armed deadline may have replaced the freeze's
			}
			if err == nil {
				continue // the other direction moved data: wait again
			}
			return s.total, err
		}
		if s.err != nil {
			return s.total, os.NewSyscallError("splice", s.err)
		}
		if s.noPipe {
			if eof, err := s.copyChunk(); err != nil || eof {
				return s.total, err
			}
			continue
		}
		if s.filled == 0 {
			return s.total, nil // EOF
		}
		s.idle.touch()
		if err := s.dstRC.Write(s.drainFn); err != nil || s.err != nil {
			return s.total, s.drainFailed(err)
		}
	}
}

// armIdle sets src's idle deadline, then checks for a freeze: a freeze that set its deadline
// before armIdle replaced it is seen here, one that comes after wakes the wait.
func (s *splicer) armIdle() error {
	if err := s.idle.arm(s.src); err != nil {
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

// drainFailed handles a failed write of the pipe to dst (err from RawConn.Write, or s.err): on
// a freeze's deadline the pipe's content becomes s.pending; otherwise the pipe, which may
// still hold data, is discarded.
func (s *splicer) drainFailed(err error) error {
	if err != nil && s.frozenBy(err) {
		pending, rerr := s.p.readAll(int(s.filled))
		if rerr == nil {
			s.pending = pending
			return errFrozen // the pipe is empty again: releasePipe returns it to the pool
		}
		err = rerr
	}
	s.pool.discard(s.p)
	s.p = nil
	if err == nil {
		err = os.NewSyscallError("splice", s.err)
	}
	return err
}

// fill splices what src has ready into the pipe, taking one from the pool first. On EAGAIN it
// returns the pipe and asks RawConn.Read to wait.
func (s *splicer) fill(fd uintptr) bool {
	if s.p == nil {
		p, err := s.pool.get()
		if err != nil {
			s.noPipe = true // out of descriptors: copy this chunk through user space
			return true
		}
		s.p = p
	}
	for {
		n, err := syscall.Splice(int(fd), nil, s.p.w, nil, spliceChunk, spliceMove|spliceNonblock)
		switch err {
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			s.releasePipe()
			return false
		}
		s.filled, s.err = n, err
		return true
	}
}

// drain splices the pipe's s.filled bytes into dst, asking RawConn.Write to wait while dst's
// buffer is full.
func (s *splicer) drain(fd uintptr) bool {
	for s.filled > 0 {
		m, err := syscall.Splice(s.p.r, nil, int(fd), nil, int(s.filled), spliceMove|spliceNonblock)
		switch err {
		case nil:
			s.filled -= m
			s.total += m
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

// releasePipe returns the pipe, which is empty, to the pool.
func (s *splicer) releasePipe() {
	if s.p != nil {
		s.pool.put(s.p)
		s.p = nil
	}
}

// copyChunkSize is the buffer of copyChunk, used only when no pipe can be had.
const copyChunkSize = 32 << 10

// copyChunk copies what src has ready to dst through a buffer (src is readable), and reports
// src's EOF. On a freeze's deadline it keeps what it read but did not write in s.pending.
func (s *splicer) copyChunk() (eof bool, err error) {
	buf := make([]byte, copyChunkSize)
	r, err := s.src.Read(buf)
	if r > 0 {
		s.idle.touch()
		w, werr := s.dst.Write(buf[:r])
		s.total += int64(w)
		if werr != nil {
			if s.frozenBy(werr) {
				s.pending = buf[w:r]
				return false, errFrozen
			}
			return false, werr
		}
	}
	switch {
	case errors.Is(err, io.EOF):
		return true, nil
	case err != nil && s.frozenBy(err):
		return false, errFrozen
	}
	return false, err
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
