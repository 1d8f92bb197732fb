package forward

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
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
// closeAll it still hands out new pipes but keeps none.
type pipePool struct {
	// testHookNewPipe, if set, replaces newPipe.
	testHookNewPipe func() (*pipe, error)

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
	if h := pp.testHookNewPipe; h != nil {
		return h()
	}
	return newPipe()
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
		p.close()
	}
}

// closeAll closes the idle pipes; pipes returned later are closed too.
func (pp *pipePool) closeAll() {
	pp.mu.Lock()
	free := pp.free
	pp.free, pp.closed = nil, true
	pp.mu.Unlock()
	for _, p := range free {
		p.close()
	}
}

// spliceCopy moves everything src sends to dst with splice(2) until src's EOF (nil error) or a
// failure of either socket, and returns the bytes moved. A pipe is held only between src
// becoming readable and it running dry.
func spliceCopy(pool *pipePool, dst, src *net.TCPConn) (int64, error) {
	srcRC, err := src.SyscallConn()
	if err != nil {
		return 0, fmt.Errorf("splice: %w", err)
	}
	dstRC, err := dst.SyscallConn()
	if err != nil {
		return 0, fmt.Errorf("splice: %w", err)
	}
	var (
		total int64
		p     *pipe
	)
	defer func() {
		if p != nil {
			pool.put(p) // only ever left set while empty
		}
	}()
	for {
		// Fill the pipe from src. The splice runs inside RawConn.Read, so a readiness event
		// that comes after its EAGAIN wakes the wait; while waiting, no pipe is held.
		var n int64
		var rerr error
		noPipe := false
		err := srcRC.Read(func(fd uintptr) bool {
			if p == nil {
				var perr error
				if p, perr = pool.get(); perr != nil {
					noPipe = true // out of descriptors: copy this chunk through user space
					return true
				}
			}
			for {
				n, rerr = syscall.Splice(int(fd), nil, p.w, nil, spliceChunk, spliceMove|spliceNonblock)
				switch rerr {
				case syscall.EINTR:
					continue
				case syscall.EAGAIN:
					pool.put(p)
					p = nil
					return false
				}
				return true
			}
		})
		if err == nil && rerr != nil {
			err = os.NewSyscallError("splice", rerr)
		}
		if err != nil {
			return total, err
		}
		if noPipe {
			m, eof, err := copyChunk(dst, src)
			total += m
			if err != nil || eof {
				return total, err
			}
			continue
		}
		if n == 0 {
			return total, nil // EOF
		}
		// Drain the pipe into dst, waiting for dst to be writable as needed.
		left := n
		var werr error
		err = dstRC.Write(func(fd uintptr) bool {
			for left > 0 {
				m, e := syscall.Splice(p.r, nil, int(fd), nil, int(left), spliceMove|spliceNonblock)
				switch e {
				case nil:
					left -= m
					total += m
				case syscall.EINTR:
				case syscall.EAGAIN:
					return false
				default:
					werr = e
					return true
				}
			}
			return true
		})
		if err == nil && werr != nil {
			err = os.NewSyscallError("splice", werr)
		}
		if err != nil {
			p.close() // it may still hold data
			p = nil
			return total, err
		}
	}
}

// copyChunkSize is the buffer of copyChunk, used only when no pipe can be had.
const copyChunkSize = 32 << 10

// copyChunk copies what src has ready to dst through a buffer (src is readable), and reports
// src's EOF.
func copyChunk(dst, src *net.TCPConn) (n int64, eof bool, err error) {
	buf := make([]byte, copyChunkSize)
	r, err := src.Read(buf)
	if r > 0 {
		w, werr := dst.Write(buf[:r])
		n = int64(w)
		if werr != nil {
			return n, false, werr
		}
	}
	if errors.Is(err, io.EOF) {
		return n, true, nil
	}
	return n, false, err
}
