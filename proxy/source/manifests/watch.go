package manifests

// Waking the scans on a change (see the package doc): a watcher (inotify, watch_linux.go) tells
// Run's loop that the directory changed, with hints naming the files renamed into it since the
// last scan; Run scans at once. A file known to be complete by a rename is read without waiting
// for Debounce; every other change settles as it would have been found by polling. The poll goes
// on as a fallback: every watchedPollFactor×Interval while the watch works, every Interval when
// the directory cannot be watched (no inotify, the directory gone, a network file system whose
// remote changes inotify does not see).

import (
	"os"
	"path/filepath"
	"slices"
	"time"
)

// watchedPollFactor: while the directory is watched, it is still polled every
// watchedPollFactor×Interval, for what inotify cannot tell.
const watchedPollFactor = 10

// dataLink is the symlink a Kubernetes ConfigMap or Secret volume swaps, by rename, to publish
// a new version of all its files at once; the files in the directory are symlinks through it.
const dataLink = "..data"

// hints is what the watcher saw between two scans. Events are numbered in the order of the
// kernel's queue; a file's last rename into the directory (or the last swap of dataLink, for a
// symlink) is compared with the last event that could have written it since.
type hints struct {
	renamed  map[string]uint64 // by file name: the last IN_MOVED_TO
	dirty    map[string]uint64 // by file name: the last write, create, delete or move away
	data     uint64            // the last rename or creation of dataLink
	overflow bool              // events were lost: no hint can be trusted
}

// complete reports whether the file name (a symlink when symlink is set) is known, from the
// hints, to hold a whole content: it was renamed into the directory, or it is a symlink and
// dataLink was swapped, and nothing wrote it since. A nil hints knows nothing.
func (h *hints) complete(name string, symlink bool) bool {
	if h == nil || h.overflow {
		return false
	}
	r := h.renamed[name]
	if symlink {
		r = max(r, h.data)
	}
	return r != 0 && r > h.dirty[name]
}

// note records the event number seq for name in m, creating the map.
func note(m *map[string]uint64, name string, seq uint64) {
	if *m == nil {
		*m = map[string]uint64{}
	}
	(*m)[name] = seq
}

// startWatch sets up the watcher, or logs that changes are found by polling alone.
func (s *Source) startWatch() {
	w, err := s.newWatcher(s.dir, s.log)
	if err != nil {
		s.log.Warn().Err(err).Dur("interval", s.opts.interval()).
			Msg("cannot watch the manifest directory with inotify; changes are found by polling alone")
		return
	}
	s.watch = w
	s.log.Debug().Dur("fallbackInterval", s.pollInterval()).Msg("watching the manifest directory with inotify")
}

// stopWatch stops the watcher, if any: its goroutine has returned and its descriptors are
// closed when stopWatch returns.
func (s *Source) stopWatch() {
	if s.watch != nil {
		s.watch.stop()
		s.watch = nil
	}
}

// pollInterval is how long Run waits for a change before it scans anyway.
func (s *Source) pollInterval() time.Duration {
	if s.watch == nil || s.watch.polling() {
		return s.opts.interval()
	}
	if s.watchedPoll > 0 {
		return s.watchedPoll
	}
	return watchedPollFactor * s.opts.interval()
}

// wakeups is the channel on which a change wakes Run's loop; nil (never ready) without a
// watcher.
func (s *Source) wakeups() <-chan struct{} {
	if s.watch == nil {
		return nil
	}
	return s.watch.wake
}

// takeHints watches the directory anew if it was replaced, and returns the hints gathered since
// the last call, up to the events queued now (nil without a watcher).
func (s *Source) takeHints() *hints {
	if s.watch == nil {
		return nil
	}
	s.watch.ensure()
	if err := s.watch.drain(); err != nil {
		s.watch.fail(err)
	}
	return s.watch.take()
}

// isSymlink reports whether a directory entry is a symlink.
func isSymlink(de os.DirEntry) bool { return de.Type()&os.ModeSymlink != 0 }

// recheck looks, once the loads are read, for writes to the files taken as complete by a hint
// since the hints were taken: such a file may have been read half-written, and is left to
// settle as any file written in place.
func (s *Source) recheck(loads []*load) {
	if s.watch == nil || !slices.ContainsFunc(loads, func(l *load) bool { return l.complete }) {
		return
	}
	if err := s.watch.drain(); err != nil {
		s.watch.fail(err) // and writtenSince says yes: the files settle
	}
	for _, l := range loads {
		if l.complete && s.watch.writtenSince(filepath.Base(l.path)) {
			l.complete, l.suspect = false, true
		}
	}
}
