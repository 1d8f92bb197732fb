package app

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/proxy/handover"
)

// InstanceLockDir holds the lock files of running proxies (a hostPath in the DaemonSet, so that
// the pods of a rolling update see each other's).
const InstanceLockDir = "/run/kube-userspace-proxy"

// errInstanceRunning: another proxy holds the lock of this network namespace.
var errInstanceRunning = errors.New("another kube-userspace-proxy programs the portals of this network namespace")

// instanceLock is the instance lock while this process holds it: an open file with an
// exclusive flock. A flock belongs to the open file, not the process: a duplicate of the
// descriptor, passed to a successor, holds the same lock (see handover.LockGiver). Its methods
// are safe on a nil lock.
type instanceLock struct {
	mu sync.Mutex
	f  *os.File // nil once released
}

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
	if err := rc.Control(func(fd uintptr) { ferr = syscall.Flock(int(fd), syscall.LOCK_EX|syscall.LOCK_NB) }); err == nil {
		err = ferr
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("instance lock from the predecessor: %w", err)
	}
	writePid(f)
	return &instanceLock{f: f}, nil
}

// writePid names this process in its lock file, for the error of a second proxy.
func writePid(f *os.File) {
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
}

// release lets go of the lock (at once: the next proxy may take it); again, it does nothing.
func (l *instanceLock) release() {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f != nil {
		_ = l.f.Close()
		l.f = nil
	}
}

// dup returns a duplicate of the lock's descriptor: it holds the lock as long as it is open.
func (l *instanceLock) dup() (*os.File, error) {
	if l == nil {
		return nil, errors.New("instance lock: not held")
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return nil, errors.New("instance lock: released")
	}
	return handover.Dup(l.f)
}
