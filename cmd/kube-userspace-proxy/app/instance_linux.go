package app

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// lockInstance takes the lock of this network namespace's proxy in dir, for the life of the
// process, and returns the function that releases it. A proxy that programs portals takes it
// before it touches any rule: a second proxy on the node (a DaemonSet pod started before the old
// one is gone, an operator's mistake) fails here, naming the holder's pid, and the running one
// keeps serving, its rules untouched. Proxies in other network namespaces (tests, several nodes
// on one machine) use other locks.
func lockInstance(dir string) (release func(), err error) {
	st, err := os.Stat("/proc/self/ns/net")
	if err != nil {
		return nil, fmt.Errorf("instance lock: this network namespace: %w", err)
	}
	ino := st.Sys().(*syscall.Stat_t).Ino
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("instance lock: %w", err)
	}
	path := filepath.Join(dir, "netns-"+strconv.FormatUint(ino, 10)+".lock")
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("instance lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		holder, _ := os.ReadFile(path)
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w (pid %s, lock %s); this one exits and leaves it serving",
				errInstanceRunning, strings.TrimSpace(string(holder)), path)
		}
		return nil, fmt.Errorf("instance lock %s: %w", path, err)
	}
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return func() { f.Close() }, nil
}
