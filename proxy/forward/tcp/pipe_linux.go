package tcp

import (
	"os"
	"sync"
	"syscall"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/forward"
	"golang.org/x/sys/unix"
)

// Splice pipes: a direction of a TCP connection that splices (its reads fill the loop's buffer:
// bulk traffic, see loop_linux.go) moves its bytes socket → pipe → socket inside the kernel with
// splice(2). It takes a pipe from a pool only while data flows and returns it, empty, as soon as
// its source has nothing more to read, so an idle connection holds no pipe: its two sockets are
// all it costs in descriptors. The pool is the Budget's (every service port's) or, without one,
// the proxy's own, and never hands out a pipe that holds a byte (pipePool.put).

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
	budget          *forward.Budget

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
	if !pp.budget.Take(pipeFDs) {
		return nil, errBudgetSpent
	}
	newPipe := newPipe
	if h := pp.testHookNewPipe; h != nil {
		newPipe = h
	}
	p, err := newPipe()
	if err != nil {
		pp.budget.Give(pipeFDs)
	}
	return p, err
}

// discard closes a pipe of the pool's and returns its descriptors to the budget.
func (pp *pipePool) discard(p *pipe) {
	p.close()
	pp.budget.Give(pipeFDs)
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
func (pp *pipePool) DropIdle() int {
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
	pp.DropIdle()
}

// testHookCopied, if set, is called with the bytes of each chunk a connection moved through a
// user-space buffer, and testHookSpliced with those of each chunk it spliced. Package
// variables, set by tests before their proxy starts and cleared after it ends.
var testHookCopied, testHookSpliced func(n int64)
