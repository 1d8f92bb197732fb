package forward

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// evLoop is a benchmark reference, not a data path: a minimal event-loop TCP relay on raw
// descriptors (HAProxy's model), to measure what such a relay, written in Go, would gain over
// the net.TCPConn relay of tcp.go. One goroutine runs one epoll set; a proxied connection is a
// small evConn in a slice indexed by descriptor, with no goroutine, net.TCPConn or runtime
// pollDesc of its own.
//
// Triggering: the listener is level-triggered and accepts one connection per readiness (no
// accept4 that ends in EAGAIN; a backlog keeps it ready, so the next epoll_wait reports it
// again). The connections' sockets are edge-triggered for EPOLLIN|EPOLLOUT|EPOLLRDHUP, added
// once and never modified: the loop remembers per direction whether its source may still be
// readable, and a read shorter than the buffer counts as having drained it (the kernel queues
// a new edge for any data that comes after), so a read ending in EAGAIN is rare. EPOLLRDHUP
// together with a short read is the peer's EOF, without a read returning 0. EPOLLOUT edges
// come only after a write found the send buffer full (SOCK_NOSPACE), so they cost nothing
// while data flows.
//
// Relay: a direction reads into the loop's shared buffer and writes it at once; only what the
// destination does not take is copied into a buffer of the direction's own, kept until
// written (the source is not read meanwhile). An EOF is passed on with shutdown(SHUT_WR); the
// second EOF of a connection is passed on by closing both sockets. A read or write error closes
// both. Socket options match the proxy's: TCP_NODELAY (and, as ListenTCP does, the keepalive
// settings) set on the listener, which accept4 copies to every accepted socket; TCP_NODELAY,
// SO_KEEPALIVE and TCP_KEEPIDLE per endpoint socket.
//
// Waiting: with block set, the goroutine blocks in epoll_wait (it holds a thread while it
// waits; an eventfd wakes it for Close); otherwise it waits, as the Poller does, for the epoll
// descriptor to be readable in the runtime's poller and collects the events with epoll_wait(0).
// The latter costs an epoll_wait(0) that finds nothing before every wait: RawConn.Read resets the
// descriptor's readiness before it calls its function, so that call cannot be skipped. The
// former keeps a P in a system call, which has sysmon polling (nanosleep) and every wake-up
// hand processors between threads: twice the cost per request/response message.
//
// Measured (2 cores, shared; medians of 6 interleaved runs; proxy's share = mode minus Direct):
// short connections 62 µs and 78 CPU-µs per connection for EventLoopNetpoll against 101 and
// 123 for ProxyStarted; request/response the same as ProxyStarted (14 against 13 µs);
// per idle connection ~110 B of heap and no pollDesc (OtherSys) against ~3.8 KiB of heap and
// stacks and ~1.1 KiB of pollDescs; per short connection 17.7 system calls besides
// epoll_pwait (ProxyStarted 31, or 27 with the keepalive of ListenTCP inherited).
//
// Not done (a rewrite would need them): splice for bulk, several loops (one per core with
// SO_REUSEPORT or a shared listener), a Chooser and dial retries, connect and idle timeouts,
// transparent dial and original destinations, PROXY protocol, handover of live connections,
// metrics, graceful shutdown, RST propagation (a reset is passed on as a FIN), and handling
// EMFILE (a level-triggered listener would spin).
type evLoop struct {
	epfd    int
	lfd     int                  // listening socket
	wakefd  int                  // eventfd that wakes a blocked epoll_wait for Close (block only)
	ep      *os.File             // epfd in the runtime's poller (not block)
	rc      syscall.RawConn      // ep's
	backend unix.SockaddrInet4   // where every connection goes
	addr    netip.AddrPort       // where the listener listens
	block   bool                 // wait in epoll_wait rather than in the runtime's poller
	conns   []*evConn            // by descriptor: both sockets of a connection point to it
	buf     []byte               // the loop's read buffer
	events  [128]unix.EpollEvent // one batch
	sa      unix.RawSockaddrAny  // accept4's client address
	saLen   uint32               // its length
	live    int                  // connections open
	pended  int                  // writes that left data pending (tests)
	stop    bool                 // set by the loop when woken for Close
	done    chan struct{}        // closed when the loop has returned
	close   sync.Once
	testErr func(error) // reports unexpected errors (tests)

	liveMu  sync.Mutex // guards liveOut
	liveOut int        // live, published for tests after each batch of events
}

// evConn is one proxied connection: sockets 0 (client) and 1 (endpoint) and the two directions
// of the relay, dir[i] from fd[i] to fd[1-i].
type evConn struct {
	fd         [2]int32
	connecting bool // the endpoint socket's connect is in progress
	dir        [2]evDir
}

type evDir struct {
	pending  []byte // read from the source, not yet taken by the destination
	readable bool   // the source may have data or an EOF to read (an edge not yet drained)
	rdhup    bool   // the source's peer has sent its FIN
	eof      bool   // the source's EOF has been read (or inferred)
	shut     bool   // the EOF has been passed on to the destination
}

// evBufSize is the loop's read buffer.
const evBufSize = 16 << 10

// startEvLoop starts an evLoop listening on 127.0.0.1 in front of backend; it is closed when the
// test ends.
func startEvLoop(t testing.TB, backend netip.AddrPort, block bool) *evLoop {
	t.Helper()
	l, err := newEvLoop(backend, block)
	if err != nil {
		t.Fatal(err)
	}
	l.testErr = func(err error) { t.Errorf("event loop: %v", err) }
	go l.run()
	t.Cleanup(l.Close)
	return l
}

func newEvLoop(backend netip.AddrPort, block bool) (l *evLoop, err error) {
	l = &evLoop{epfd: -1, lfd: -1, wakefd: -1, block: block, buf: make([]byte, evBufSize), done: make(chan struct{})}
	l.backend = unix.SockaddrInet4{Port: int(backend.Port()), Addr: backend.Addr().As4()}
	defer func() {
		if err != nil {
			l.closeFDs()
		}
	}()
	if l.epfd, err = unix.EpollCreate1(unix.EPOLL_CLOEXEC); err != nil {
		return nil, fmt.Errorf("epoll_create1: %w", err)
	}
	if l.lfd, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0); err != nil {
		return nil, fmt.Errorf("socket: %w", err)
	}
	for _, o := range []struct{ level, opt, value int }{
		{unix.SOL_SOCKET, unix.SO_REUSEADDR, 1},
		{unix.IPPROTO_TCP, unix.TCP_NODELAY, 1},
		{unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
		{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, int(keepAliveIdle.Seconds())},
		{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, int(keepAliveInterval.Seconds())},
		{unix.IPPROTO_TCP, unix.TCP_KEEPCNT, keepAliveCount},
	} {
		if err = unix.SetsockoptInt(l.lfd, o.level, o.opt, o.value); err != nil {
			return nil, fmt.Errorf("setsockopt: %w", err)
		}
	}
	if err = unix.Bind(l.lfd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		return nil, fmt.Errorf("bind: %w", err)
	}
	if err = unix.Listen(l.lfd, 4096); err != nil {
		return nil, fmt.Errorf("listen: %w", err)
	}
	sa, err := unix.Getsockname(l.lfd)
	if err != nil {
		return nil, fmt.Errorf("getsockname: %w", err)
	}
	l.addr = netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, 1}), uint16(sa.(*unix.SockaddrInet4).Port))
	if err = unix.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, l.lfd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(l.lfd)}); err != nil {
		return nil, fmt.Errorf("epoll_ctl: %w", err)
	}
	if block {
		if l.wakefd, err = unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC); err != nil {
			return nil, fmt.Errorf("eventfd: %w", err)
		}
		if err = unix.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, l.wakefd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(l.wakefd)}); err != nil {
			return nil, fmt.Errorf("epoll_ctl: %w", err)
		}
		return l, nil
	}
	if err = unix.SetNonblock(l.epfd, true); err != nil {
		return nil, err
	}
	l.ep = os.NewFile(uintptr(l.epfd), "epoll")
	if l.rc, err = l.ep.SyscallConn(); err != nil {
		return nil, err
	}
	return l, nil
}

// Close stops the loop, waits for it and closes every descriptor.
func (l *evLoop) Close() {
	l.close.Do(func() {
		if l.block {
			_, _ = unix.Write(l.wakefd, []byte{1, 0, 0, 0, 0, 0, 0, 0})
		} else {
			_ = l.ep.Close() // ends the wait in the runtime's poller
		}
		<-l.done
		for _, c := range l.conns {
			if c != nil {
				l.closeConn(c)
			}
		}
		l.closeFDs()
	})
}

func (l *evLoop) closeFDs() {
	for _, fd := range []int{l.lfd, l.wakefd} {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
	if l.ep != nil {
		l.ep.Close() // closes epfd; a second Close does nothing
	} else if l.epfd >= 0 {
		unix.Close(l.epfd)
	}
}

// liveConns returns how many connections the loop had open after its last batch of events.
func (l *evLoop) liveConns() int {
	l.liveMu.Lock()
	defer l.liveMu.Unlock()
	return l.liveOut
}

// wait fills l.events with the next batch and returns its length; 0 with stop set ends the loop.
func (l *evLoop) wait() int {
	if l.block {
		for {
			n, err := unix.EpollWait(l.epfd, l.events[:], -1)
			if err == nil {
				return n
			}
			if err != unix.EINTR {
				l.stop = true
				return 0
			}
		}
	}
	var n int
	var werr error
	err := l.rc.Read(func(fd uintptr) bool {
		n, werr = unix.EpollWait(int(fd), l.events[:], 0)
		return n > 0 || (werr != nil && werr != unix.EINTR)
	})
	if err != nil || werr != nil {
		l.stop = true // closed
		return 0
	}
	return n
}

func (l *evLoop) run() {
	defer close(l.done)
	for !l.stop {
		n := l.wait()
		accept := false
		for _, ev := range l.events[:n] {
			switch fd := int(ev.Fd); {
			case fd == l.lfd:
				accept = true // after the batch: an accepted socket may reuse the number of one this batch closes
			case fd == l.wakefd:
				l.stop = true
			default:
				if c := l.conns[fd]; c != nil {
					l.event(c, fd, ev.Events)
				}
			}
		}
		if accept && !l.stop {
			l.accept()
		}
		l.liveMu.Lock()
		l.liveOut = l.live
		l.liveMu.Unlock()
	}
}

// accept accepts one connection and starts its endpoint socket's connect.
func (l *evLoop) accept() {
	// Not unix.Accept4: its parsing of the client's address costs a getsockopt(SO_PROTOCOL) per
	// call (to tell L2TP from TCP). The address would be in l.sa, for a Chooser.
	l.saLen = unix.SizeofSockaddrAny
	r, _, errno := unix.Syscall6(unix.SYS_ACCEPT4, uintptr(l.lfd), uintptr(unsafe.Pointer(&l.sa)), uintptr(unsafe.Pointer(&l.saLen)), unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0, 0)
	cfd := int(r)
	if errno != 0 {
		err := error(errno)
		if err != unix.EAGAIN && err != unix.ECONNABORTED {
			l.report(fmt.Errorf("accept4: %w", err))
		}
		return
	}
	efd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		unix.Close(cfd)
		l.report(fmt.Errorf("socket: %w", err))
		return
	}
	c := &evConn{fd: [2]int32{int32(cfd), int32(efd)}, connecting: true}
	l.live++
	for _, o := range []struct{ level, opt, value int }{
		{unix.IPPROTO_TCP, unix.TCP_NODELAY, 1},
		{unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
		{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, int(keepAliveIdle.Seconds())},
	} {
		if err := unix.SetsockoptInt(efd, o.level, o.opt, o.value); err != nil {
			l.report(fmt.Errorf("setsockopt: %w", err))
		}
	}
	switch err := unix.Connect(efd, &l.backend); err {
	case unix.EINPROGRESS:
	case nil:
		c.connecting = false
	default: // refused at once: the client gets a FIN
		l.closeConn(c)
		return
	}
	for _, fd := range []int{cfd, efd} {
		l.track(fd, c)
		ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd)}
		if err := unix.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
			l.report(fmt.Errorf("epoll_ctl: %w", err))
			l.closeConn(c)
			return
		}
	}
}

// track records c as the connection of descriptor fd.
func (l *evLoop) track(fd int, c *evConn) {
	for fd >= len(l.conns) {
		l.conns = append(l.conns[:cap(l.conns)], nil)
	}
	l.conns[fd] = c
}

// event handles the readiness events of socket fd of c.
func (l *evLoop) event(c *evConn, fd int, events uint32) {
	side := 0
	if int(c.fd[1]) == fd {
		side = 1
	}
	if events&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		c.dir[side].readable = true
		if events&unix.EPOLLRDHUP != 0 {
			c.dir[side].rdhup = true
		}
	}
	if side == 1 && c.connecting {
		if events&(unix.EPOLLOUT|unix.EPOLLHUP|unix.EPOLLERR) == 0 {
			return
		}
		if serr, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR); err != nil || serr != 0 {
			l.closeConn(c) // connect failed (refused): the client gets a FIN
			return
		}
		c.connecting = false
	}
	if c.connecting {
		return // the client's data waits for the endpoint
	}
	// A direction that had to wait for its destination is flushed when that becomes writable,
	// and any direction whose source is readable is pumped: both cases are covered by pumping
	// both (a direction with nothing to do costs no system call).
	for d := range 2 {
		if !l.pump(c, d) {
			return // closed
		}
	}
}

// pump moves what it can in direction d of c; false when it closed the connection.
func (l *evLoop) pump(c *evConn, d int) bool {
	dd := &c.dir[d]
	src, dst := int(c.fd[d]), int(c.fd[1-d])
	for {
		if len(dd.pending) > 0 {
			n, err := unix.Write(dst, dd.pending)
			if err == unix.EAGAIN {
				return true // EPOLLOUT on dst calls again
			}
			if err != nil {
				l.closeConn(c)
				return false
			}
			if dd.pending = dd.pending[n:]; len(dd.pending) > 0 {
				continue
			}
			dd.pending = nil // the buffer lives only while data is pending
		}
		if dd.eof {
			if dd.shut {
				return true
			}
			dd.shut = true
			if c.dir[1-d].shut { // the second EOF: closing both passes it on
				l.closeConn(c)
				return false
			}
			if err := unix.Shutdown(dst, unix.SHUT_WR); err != nil {
				l.closeConn(c)
				return false
			}
			return true
		}
		if !dd.readable {
			return true
		}
		n, err := unix.Read(src, l.buf)
		switch {
		case err == unix.EAGAIN:
			dd.readable = false
			return true
		case err != nil:
			l.closeConn(c)
			return false
		case n == 0:
			dd.eof = true
			continue
		case n < len(l.buf): // drained: the EOF, if its FIN came, or a new edge for more data
			if dd.rdhup {
				dd.eof = true
			} else {
				dd.readable = false
			}
		}
		w, err := unix.Write(dst, l.buf[:n])
		if err == unix.EAGAIN {
			w, err = 0, nil
		}
		if err != nil {
			l.closeConn(c)
			return false
		}
		if w < n {
			dd.pending = append([]byte(nil), l.buf[w:n]...)
			l.pended++
		}
	}
}

// closeConn closes both sockets of c (which leaves the epoll set).
func (l *evLoop) closeConn(c *evConn) {
	for _, fd := range c.fd {
		if int(fd) < len(l.conns) && l.conns[fd] == c {
			l.conns[fd] = nil
		}
		unix.Close(int(fd))
	}
	l.live--
}

func (l *evLoop) report(err error) {
	if l.testErr != nil && !errors.Is(err, unix.EMFILE) {
		l.testErr(err)
	}
}
