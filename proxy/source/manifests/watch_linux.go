//go:build linux

package manifests

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// watchMask is what the directory's inotify watch asks for. IN_MODIFY does not wake a scan (see
// wakeMask) but tells that a file renamed in was written to since.
const watchMask = unix.IN_CLOSE_WRITE | unix.IN_MOVED_TO | unix.IN_CREATE | unix.IN_DELETE | unix.IN_MOVED_FROM |
	unix.IN_ATTRIB | unix.IN_MODIFY | unix.IN_DELETE_SELF | unix.IN_MOVE_SELF | unix.IN_ONLYDIR

// wakeMask: the events of a manifest file that wake a scan. A write in place (IN_MODIFY) wakes
// none: the file is not settled before the writer stops, and IN_CLOSE_WRITE then wakes the scan
// that starts its Debounce (from its modification time, so not later than polling would).
const wakeMask = unix.IN_CLOSE_WRITE | unix.IN_MOVED_TO | unix.IN_CREATE | unix.IN_DELETE | unix.IN_MOVED_FROM | unix.IN_ATTRIB

// dirtyMask: the events after which a file renamed into the directory is no longer known
// complete.
const dirtyMask = unix.IN_MODIFY | unix.IN_CLOSE_WRITE | unix.IN_CREATE | unix.IN_DELETE | unix.IN_MOVED_FROM

// goneMask: the events that end the directory's watch (the directory removed, moved away, or
// its file system unmounted); it is watched anew when the path is a directory again.
const goneMask = unix.IN_DELETE_SELF | unix.IN_MOVE_SELF | unix.IN_IGNORED | unix.IN_UNMOUNT

// remoteMagics are the file systems whose changes made by other machines inotify does not
// report: on them the directory is polled every Interval as well as watched.
var remoteMagics = map[int64]string{
	unix.NFS_SUPER_MAGIC: "nfs", unix.SMB_SUPER_MAGIC: "smb", unix.SMB2_SUPER_MAGIC: "smb2",
	unix.CIFS_SUPER_MAGIC: "cifs", unix.FUSE_SUPER_MAGIC: "fuse", unix.V9FS_MAGIC: "9p",
	unix.CEPH_SUPER_MAGIC: "ceph", unix.AFS_SUPER_MAGIC: "afs", unix.CODA_SUPER_MAGIC: "coda",
}

// watcher watches one directory with inotify. Its goroutine, started by newWatcher and owned
// by Run (which calls stop before it returns), waits for events, records them as hints and
// signals wake; Run's goroutine takes the hints (take), drains the queue itself when it needs
// the latest events (drain), and watches the path anew when the directory was replaced
// (ensure). stop ends the goroutine and then closes the descriptors.
type watcher struct {
	dir    string
	log    zerolog.Logger
	fd     int           // the inotify instance, non-blocking
	stopFd int           // an eventfd that stop writes to end the goroutine's poll
	wake   chan struct{} // capacity 1: a change since the last take
	done   chan struct{} // closed when the goroutine has returned

	// mu is held across each read of the queue and the recording of its events, so that what
	// drain returns holds every event queued before it.
	mu     sync.Mutex
	buf    []byte
	wd     int      // the directory's watch; -1 when none
	id     [2]int64 // device and inode of the watched directory
	lost   bool     // the watched directory is gone (removed, moved away, unmounted)
	broken bool     // the queue cannot be read: polling only, for good
	remote bool     // a network file system: polled every Interval as well
	seq    uint64
	pend   hints
}

// newWatcher watches dir and starts the watcher's goroutine; stop it with stop.
func newWatcher(dir string, log zerolog.Logger) (*watcher, error) {
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("inotify_init1: %w", err)
	}
	stopFd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	w := &watcher{dir: dir, log: log, fd: fd, stopFd: stopFd, wd: -1, buf: make([]byte, 64<<10),
		wake: make(chan struct{}, 1), done: make(chan struct{})}
	w.mu.Lock()
	err = w.addLocked()
	w.mu.Unlock()
	if err != nil {
		unix.Close(fd)
		unix.Close(stopFd)
		return nil, err
	}
	go w.run()
	return w, nil
}

// addLocked (re)places the directory's watch on the path dir. w.mu is held.
func (w *watcher) addLocked() error {
	if w.wd >= 0 {
		// The old watch may be gone with its directory already: nothing to undo then.
		_, _ = unix.InotifyRmWatch(w.fd, uint32(w.wd))
		w.wd = -1
	}
	// The stat comes first: should the path change between the two, ensure sees a different
	// directory and watches again, rather than keeping a watch on the old one.
	var st unix.Stat_t
	if err := unix.Stat(w.dir, &st); err != nil {
		return fmt.Errorf("stat %s: %w", w.dir, err)
	}
	wd, err := unix.InotifyAddWatch(w.fd, w.dir, watchMask)
	if err != nil {
		return fmt.Errorf("inotify_add_watch %s: %w", w.dir, err)
	}
	w.wd, w.id, w.lost = wd, [2]int64{int64(st.Dev), int64(st.Ino)}, false
	var fs unix.Statfs_t
	if err := unix.Statfs(w.dir, &fs); err == nil {
		_, w.remote = remoteMagics[int64(fs.Type)]
	}
	return nil
}

// ensure watches the path anew when the watched directory is gone or the path now names
// another directory; while there is none, the watcher is lost and the directory polled.
func (w *watcher) ensure() {
	var st unix.Stat_t
	statErr := unix.Stat(w.dir, &st)
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.broken || (statErr == nil && !w.lost && w.id == [2]int64{int64(st.Dev), int64(st.Ino)}) {
		return
	}
	if statErr != nil {
		w.markLostLocked("the manifest directory is gone")
		return
	}
	wasLost := w.lost
	if err := w.addLocked(); err != nil {
		w.markLostLocked(err.Error())
		return
	}
	w.pend = hints{} // about the old directory
	if wasLost {
		w.log.Info().Msg("watching the manifest directory again")
	}
}

// markLostLocked records that the directory is not watched, logging it once. w.mu is held.
func (w *watcher) markLostLocked(why string) {
	if !w.lost {
		w.log.Info().Str("reason", why).Msg("not watching the manifest directory until it is back; polling it every interval")
	}
	w.lost = true
}

// run is the watcher's goroutine: it waits for events or stop.
func (w *watcher) run() {
	defer close(w.done)
	fds := []unix.PollFd{{Fd: int32(w.fd), Events: unix.POLLIN}, {Fd: int32(w.stopFd), Events: unix.POLLIN}}
	for {
		fds[0].Revents, fds[1].Revents = 0, 0
		if _, err := unix.Poll(fds, -1); err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			w.fail(fmt.Errorf("poll: %w", err))
			return
		}
		if fds[1].Revents != 0 {
			return
		}
		if err := w.drain(); err != nil {
			w.fail(err)
			return
		}
	}
}

// fail gives up watching: the directory is polled every Interval from now on.
func (w *watcher) fail(err error) {
	w.mu.Lock()
	w.broken = true
	w.mu.Unlock()
	w.log.Error().Err(err).Msg("cannot read inotify events; changes are found by polling alone")
	w.signal()
}

// drain reads every event queued and records it, then signals wake if one calls for a scan.
func (w *watcher) drain() error {
	w.mu.Lock()
	wake, err := w.readLocked()
	w.mu.Unlock()
	if wake {
		w.signal()
	}
	return err
}

// readLocked reads the queue until it is empty. w.mu is held.
func (w *watcher) readLocked() (wake bool, err error) {
	if w.broken {
		return false, nil
	}
	for {
		n, err := unix.Read(w.fd, w.buf)
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case errors.Is(err, unix.EAGAIN):
			return wake, nil
		case err != nil:
			return wake, fmt.Errorf("read inotify events: %w", err)
		case n <= 0:
			return wake, nil
		}
		wake = w.parseLocked(w.buf[:n]) || wake
	}
}

// parseLocked records the events in b, a whole number of them as read(2) returns. w.mu is held.
func (w *watcher) parseLocked(b []byte) (wake bool) {
	for len(b) >= unix.SizeofInotifyEvent {
		wd := int32(binary.NativeEndian.Uint32(b[0:4]))
		mask := binary.NativeEndian.Uint32(b[4:8])
		end := unix.SizeofInotifyEvent + int(binary.NativeEndian.Uint32(b[12:16]))
		if end > len(b) {
			break
		}
		name := strings.TrimRight(string(b[unix.SizeofInotifyEvent:end]), "\x00")
		wake = w.recordLocked(wd, mask, name) || wake
		b = b[end:]
	}
	return wake
}

// recordLocked records one event as hints and reports whether it calls for a scan. w.mu is
// held.
func (w *watcher) recordLocked(wd int32, mask uint32, name string) bool {
	if mask&unix.IN_Q_OVERFLOW != 0 {
		w.pend.overflow = true
		w.log.Warn().Msg("inotify queue overflowed: events were lost; rescanning the whole directory")
		return true
	}
	if int(wd) != w.wd || w.lost {
		return false // a watch replaced since
	}
	if mask&goneMask != 0 {
		w.markLostLocked("the watched directory was removed, moved or unmounted")
		return true
	}
	w.seq++
	if name == dataLink {
		if mask&(unix.IN_MOVED_TO|unix.IN_CREATE) == 0 {
			return false
		}
		w.pend.data = w.seq
		return true
	}
	if !isManifestFile(name) {
		return false
	}
	if mask&unix.IN_MOVED_TO != 0 {
		note(&w.pend.renamed, name, w.seq)
	}
	if mask&dirtyMask != 0 {
		note(&w.pend.dirty, name, w.seq)
	}
	return mask&wakeMask != 0
}

// signal wakes Run's loop, or leaves the pending wake in place.
func (w *watcher) signal() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// take returns the hints gathered since the last take, and forgets them; nil once the watcher
// is broken.
func (w *watcher) take() *hints {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.broken {
		return nil
	}
	h := w.pend
	w.pend = hints{}
	return &h
}

// writtenSince reports whether, since the last take, the file name may have been written to (or
// events were lost). Call drain first to see the events queued until then.
func (w *watcher) writtenSince(name string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.broken || w.pend.overflow || w.pend.dirty[name] != 0
}

// polling reports whether the directory must be polled every Interval: it is not watched, or
// changes made elsewhere would not be seen.
func (w *watcher) polling() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.lost || w.broken || w.remote
}

// stop ends the goroutine, waits for it and closes the descriptors.
func (w *watcher) stop() {
	var one [8]byte
	binary.NativeEndian.PutUint64(one[:], 1)
	if _, err := unix.Write(w.stopFd, one[:]); err != nil {
		w.log.Error().Err(err).Msg("cannot stop the inotify goroutine")
	}
	<-w.done
	unix.Close(w.fd)
	unix.Close(w.stopFd)
}
