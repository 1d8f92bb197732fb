package handover

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

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
