package sys

import (
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Raw system calls for the event loops.
//
// Every descriptor a loop works on is non-blocking, so its system calls return at once. Made
// through RawSyscall, they skip the runtime's entersyscall/exitsyscall — and with it the wake-up
// of the runtime's monitor thread: when every processor has been idle, sysmon sleeps until the
// next entersyscall wakes it (a futex wake-up and a context switch of a second thread) and then
// polls every 20 µs until the processors are idle again. On a keep-alive connection that is one
// such wake-up per message (measured in the bench topology: 4.5–4.9 context switches per
// request/response through the loop, 2.2 through HAProxy; see bench/README). A raw system call
// keeps the goroutine's processor for its duration, which is what a non-blocking call needs.
//
// Only calls on non-blocking descriptors, or that never wait (socket, setsockopt, close of a
// socket without SO_LINGER > 0), belong here.

// errnoErr returns e as an error, nil for 0.
func errnoErr(e syscall.Errno) error {
	if e == 0 {
		return nil
	}
	return e
}

// Read is read(2).
func Read(fd int, p []byte) (int, error) { return rawIO(unix.SYS_READ, fd, p) }

// Write is write(2).
func Write(fd int, p []byte) (int, error) { return rawIO(unix.SYS_WRITE, fd, p) }

// rawIO is read(2) or write(2) (trap) of p.
func rawIO(trap uintptr, fd int, p []byte) (int, error) {
	var ptr unsafe.Pointer
	if len(p) > 0 {
		ptr = unsafe.Pointer(&p[0])
	}
	n, _, e := unix.RawSyscall(trap, uintptr(fd), uintptr(ptr), uintptr(len(p)))
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}

// Close is close(2).
func Close(fd int) error {
	_, _, e := unix.RawSyscall(unix.SYS_CLOSE, uintptr(fd), 0, 0)
	return errnoErr(e)
}

// EpollPoll is epoll_pwait(2) with a zero timeout: the events ready now.
func EpollPoll(epfd int, events []unix.EpollEvent) (int, error) {
	n, _, e := unix.RawSyscall6(unix.SYS_EPOLL_PWAIT, uintptr(epfd), uintptr(unsafe.Pointer(&events[0])),
		uintptr(len(events)), 0, 0, 0)
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}

// EpollCtl is epoll_ctl(2).
func EpollCtl(epfd, op, fd int, ev *unix.EpollEvent) error {
	_, _, e := unix.RawSyscall6(unix.SYS_EPOLL_CTL, uintptr(epfd), uintptr(op), uintptr(fd), uintptr(unsafe.Pointer(ev)), 0, 0)
	return errnoErr(e)
}

// TimerfdSettime is timerfd_settime(2) with a relative time.
func TimerfdSettime(fd int, spec *unix.ItimerSpec) error {
	_, _, e := unix.RawSyscall6(unix.SYS_TIMERFD_SETTIME, uintptr(fd), 0, uintptr(unsafe.Pointer(spec)), 0, 0, 0)
	return errnoErr(e)
}

// SetsockoptInt is setsockopt(2) with an int value.
func SetsockoptInt(fd, level, opt, value int) error {
	v := int32(value)
	_, _, e := unix.RawSyscall6(unix.SYS_SETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt),
		uintptr(unsafe.Pointer(&v)), unsafe.Sizeof(v), 0)
	return errnoErr(e)
}

// GetsockoptInt is getsockopt(2) with an int value.
func GetsockoptInt(fd, level, opt int) (int, error) {
	var v int32
	size := uint32(unsafe.Sizeof(v))
	_, _, e := unix.RawSyscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt),
		uintptr(unsafe.Pointer(&v)), uintptr(unsafe.Pointer(&size)), 0)
	return int(v), errnoErr(e)
}

// Reset closes a socket with an RST (SO_LINGER 0: close does not wait).
func Reset(fd int) {
	l := unix.Linger{Onoff: 1, Linger: 0}
	_, _, _ = unix.RawSyscall6(unix.SYS_SETSOCKOPT, uintptr(fd), unix.SOL_SOCKET, unix.SO_LINGER,
		uintptr(unsafe.Pointer(&l)), unsafe.Sizeof(l), 0)
	_ = Close(fd)
}

// Shutdown is shutdown(2).
func Shutdown(fd, how int) error {
	_, _, e := unix.RawSyscall(unix.SYS_SHUTDOWN, uintptr(fd), uintptr(how), 0)
	return errnoErr(e)
}

// Splice is splice(2) without offsets.
func Splice(rfd, wfd, n, flags int) (int64, error) {
	r, _, e := unix.RawSyscall6(unix.SYS_SPLICE, uintptr(rfd), 0, uintptr(wfd), 0, uintptr(n), uintptr(flags))
	if e != 0 {
		return 0, e
	}
	return int64(r), nil
}

// Socket is socket(2).
func Socket(family, typ, proto int) (int, error) {
	fd, _, e := unix.RawSyscall(unix.SYS_SOCKET, uintptr(family), uintptr(typ), uintptr(proto))
	if e != 0 {
		return -1, e
	}
	return int(fd), nil
}

// Connect is connect(2) to a socket address encoded by EncodeSockaddr.
func Connect(fd int, sa []byte) error {
	if len(sa) == 0 {
		return unix.EAFNOSUPPORT
	}
	_, _, e := unix.RawSyscall(unix.SYS_CONNECT, uintptr(fd), uintptr(unsafe.Pointer(&sa[0])), uintptr(len(sa)))
	return errnoErr(e)
}
