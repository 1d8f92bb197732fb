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
// process (or until a hand-over passes it on). A proxy that programs portals takes it
// before it touches any rule: a second proxy on the node (a DaemonSet pod started before the old
// one is gone, an operator's mistake) fails here, naming the holder's pid, and the running one
// keeps serving, its rules untouched. Proxies in other network namespaces (tests, several nodes
// on one machine) use other locks.
func lockInstance(dir string) (*instanceLock, error) {
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
	writePid(f)
	return &instanceLock{f: f}, nil
}

// adoptInstanceLock takes the lock a predecessor passed on with its hand-over: f is its lock
// file's descriptor, the lock held by the open file they share. It checks that it holds the
// lock (a flock on the file it already holds succeeds at once) and names this process in it.
func adoptInstanceLock(f *os.File) (*instanceLock, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("instance lock from the predecessor: %w", err)
	}
	var ferr error
	err = rc.Control(func(fd uintptr) { ferr = syscall.Flock(int(fd), syscall.LOCK_EX|syscall.LOCK_NB) })
	if err == nil {
		err = ferr
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("instance lock from the predecessor: %w", err)
	}
	writePid(f)
	return &instanceLock{f: f}, nil
}
