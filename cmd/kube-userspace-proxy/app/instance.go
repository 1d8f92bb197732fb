package app

import (
	"errors"
	"os"
	"strconv"
	"sync"

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
// are safe on a nil lock. lockInstance and adoptInstanceLock (instance_linux.go) make one; off
// Linux both fail.
type instanceLock struct {
	mu sync.Mutex
	f  *os.File // nil once released
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
