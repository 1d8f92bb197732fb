//go:build !linux

package manifests

import (
	"errors"

	"github.com/rs/zerolog"
)

// watcher is not available without inotify: the directory is polled every Interval.
type watcher struct {
	wake chan struct{}
}

func newWatcher(string, zerolog.Logger) (*watcher, error) {
	return nil, errors.New("inotify is available on Linux only")
}

func (*watcher) ensure()                  {}
func (*watcher) take() *hints             { return nil }
func (*watcher) drain() error             { return nil }
func (*watcher) writtenSince(string) bool { return true }
func (*watcher) polling() bool            { return true }
func (*watcher) fail(error)               {}
func (*watcher) stop()                    {}
