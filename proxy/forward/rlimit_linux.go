package forward

import (
	"errors"
	"fmt"
	"syscall"
)

// MinFileLimit is the RLIMIT_NOFILE that RaiseFileLimit aims for when the hard limit is lower,
// as kube-proxy's userspace mode did. Each proxied TCP connection holds up to six descriptors
// (two sockets, and a splice pipe per direction while data moves), so 64000 serves at least
// ten thousand concurrent connections.
const MinFileLimit = 64000

// RaiseFileLimit raises the soft RLIMIT_NOFILE of the process to its hard limit, and both to
// MinFileLimit when the hard limit is lower and the process may raise it (CAP_SYS_RESOURCE). It
// never lowers a limit and returns the soft limit in force afterwards.
//
// The Go runtime already raises the soft limit to the hard limit at start-up (since Go 1.19);
// calling this makes the intent explicit, covers the hard limit, and reports the result for the
// log.
func RaiseFileLimit() (uint64, error) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 0, fmt.Errorf("get RLIMIT_NOFILE: %w", err)
	}
	if lim.Max < MinFileLimit {
		want := syscall.Rlimit{Cur: MinFileLimit, Max: MinFileLimit}
		err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &want)
		if err == nil {
			return want.Cur, nil
		}
		if !errors.Is(err, syscall.EPERM) {
			return lim.Cur, fmt.Errorf("set RLIMIT_NOFILE to %d: %w", MinFileLimit, err)
		}
		// Not allowed to raise the hard limit: settle for it.
	}
	if lim.Cur >= lim.Max {
		return lim.Cur, nil
	}
	want := syscall.Rlimit{Cur: lim.Max, Max: lim.Max}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &want); err != nil {
		return lim.Cur, fmt.Errorf("set RLIMIT_NOFILE soft limit to %d: %w", lim.Max, err)
	}
	return want.Cur, nil
}
