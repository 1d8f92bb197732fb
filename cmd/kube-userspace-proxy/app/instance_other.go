//go:build !linux

package app

import (
	"errors"
	"os"
)

// errInstanceLockOS: the lock is per network namespace (/proc/self/ns/net), and only the
// portals it guards need it (--portal-mode none takes no lock).
var errInstanceLockOS = errors.New("instance lock: not supported on this OS (Linux only); use --portal-mode none")

// lockInstance fails off Linux (errInstanceLockOS).
func lockInstance(string) (*instanceLock, error) { return nil, errInstanceLockOS }

// adoptInstanceLock fails off Linux, where no hand-over passes a lock.
func adoptInstanceLock(f *os.File) (*instanceLock, error) {
	f.Close()
	return nil, errInstanceLockOS
}
