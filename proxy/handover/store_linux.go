package handover

import (
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// peerCred returns the uid and pid of the process at the other end of uc (SO_PEERCRED).
func peerCred(uc *net.UnixConn) (uid, pid int, err error) {
	rc, err := uc.SyscallConn()
	if err != nil {
		return 0, 0, fmt.Errorf("peer credentials: %w", err)
	}
	var cred *unix.Ucred
	var gerr error
	if err := rc.Control(func(fd uintptr) { cred, gerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) }); err != nil {
		return 0, 0, fmt.Errorf("peer credentials: %w", err)
	}
	if gerr != nil {
		return 0, 0, fmt.Errorf("peer credentials: %w", os.NewSyscallError("getsockopt SO_PEERCRED", gerr))
	}
	return int(cred.Uid), int(cred.Pid), nil
}

// selfNetNS returns the inode of this process's network namespace (0 when unknown).
func selfNetNS() uint64 {
	st, err := os.Stat("/proc/self/ns/net")
	if err != nil {
		return 0
	}
	return inode(st)
}

// lockFile opens path (mode 0600) and takes an exclusive flock on it without waiting.
func lockFile(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, errors.New("another holder keeps this socket")
		}
		return nil, os.NewSyscallError("flock", err)
	}
	return f, nil
}

// detachSocket returns a plain descriptor (close-on-exec) of the socket f and closes f: the
// holder keeps it without Go's network poller watching it. It fails for anything that is not
// a socket.
func detachSocket(f *os.File) (int, error) {
	defer f.Close()
	rc, err := f.SyscallConn()
	if err != nil {
		return -1, fmt.Errorf("received descriptor: %w", err)
	}
	nfd, cerr := -1, error(nil)
	if err := rc.Control(func(fd uintptr) {
		var st unix.Stat_t
		if cerr = unix.Fstat(int(fd), &st); cerr != nil {
			cerr = os.NewSyscallError("fstat", cerr)
			return
		}
		if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
			cerr = fmt.Errorf("received descriptor is not a socket (mode %#o)", st.Mode)
			return
		}
		if nfd, cerr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0); cerr != nil {
			cerr = os.NewSyscallError("fcntl F_DUPFD_CLOEXEC", cerr)
		}
	}); err != nil {
		return -1, fmt.Errorf("received descriptor: %w", err)
	}
	return nfd, cerr
}

// dupConn returns a plain duplicate (close-on-exec) of c's descriptor; it fails once c is
// closed (SyscallConn's Control never sees a descriptor reused after a close).
func dupConn(c syscall.Conn) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return -1, err
	}
	nfd, derr := -1, error(nil)
	if err := rc.Control(func(fd uintptr) { nfd, derr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return -1, err
	}
	if derr != nil {
		return -1, os.NewSyscallError("fcntl F_DUPFD_CLOEXEC", derr)
	}
	return nfd, nil
}

func closeFD(fd int) { _ = unix.Close(fd) }
