package handover

import (
	"fmt"
	"os"
	"syscall"

	"golang.org/x/sys/unix"
)

// supported reports whether hand-overs work here: on Linux they do.
func supported() error { return nil }

// Dup returns a duplicate of f's descriptor (close-on-exec), for a record's Files: the giver
// keeps its own until Release. It reads the descriptor through SyscallConn, not f.Fd(), which
// would put a shared socket in blocking mode (see rawFD).
func Dup(f *os.File) (*os.File, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("duplicate %s: %w", f.Name(), err)
	}
	nfd, derr := -1, error(nil)
	if err := rc.Control(func(fd uintptr) { nfd, derr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return nil, fmt.Errorf("duplicate %s: %w", f.Name(), err)
	}
	if derr != nil {
		return nil, fmt.Errorf("duplicate %s: %w", f.Name(), os.NewSyscallError("fcntl F_DUPFD_CLOEXEC", derr))
	}
	return os.NewFile(uintptr(nfd), f.Name()), nil
}

// unixRights encodes fds as an SCM_RIGHTS control message.
func unixRights(fds []int) []byte { return syscall.UnixRights(fds...) }

// rightsSpace is the control-message buffer that n descriptors need.
func rightsSpace(n int) int { return syscall.CmsgSpace(4 * n) }

// truncated reports whether recvmsg's flags say control data was cut off.
func truncated(flags int) bool { return flags&syscall.MSG_CTRUNC != 0 }

// parseRights turns the SCM_RIGHTS messages of oob into files.
func parseRights(oob []byte) ([]*os.File, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := syscall.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, fmt.Errorf("hand-over: control message: %w", err)
	}
	var files []*os.File
	for i := range msgs {
		fds, err := syscall.ParseUnixRights(&msgs[i])
		if err != nil {
			continue // not SCM_RIGHTS (credentials): nothing to own
		}
		for _, fd := range fds {
			syscall.CloseOnExec(fd)
			files = append(files, os.NewFile(uintptr(fd), "handed over"))
		}
	}
	return files, nil
}

// inode returns the inode number of a file's FileInfo (0 when it has none).
func inode(st os.FileInfo) uint64 {
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		return sys.Ino
	}
	return 0
}
