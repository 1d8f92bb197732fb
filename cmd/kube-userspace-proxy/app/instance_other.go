//go:build !linux

package app

import "errors"

// lockInstance fails off Linux: the lock is per network namespace (/proc/self/ns/net), and only
// the portals it guards need it (--portal-mode none takes no lock).
func lockInstance(string) (release func(), err error) {
	return nil, errors.New("instance lock: not supported on this OS (Linux only); use --portal-mode none")
}
