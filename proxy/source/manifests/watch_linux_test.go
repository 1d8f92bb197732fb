//go:build linux

package manifests

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/sys/unix"
)

// The tests below tell inotify's part from polling's without timing anything: the poll interval
// is an hour, so a prompt delivery is the watcher's doing, and the debounce's clock is paused, so
// a delivery while it is paused is a file read without waiting for Debounce.

// running is a Source run by a test, with its handler, logs, clock and scans.
type running struct {
	src   *Source
	rec   *rec
	logs  *logBuf
	clock *pausableClock
	w     *watcher      // the watcher Run set up, once it has
	scans chan bool     // after each rescan: whether the directory was watched then
	ready chan struct{} // closed once w is set (or setup failed)
}

// runSource runs a Source on dir until the test ends, with the given options (Log is set) and
// hook (called before Run, e.g. to replace newWatcher), and waits for OnSynced. The test fails
// if an inotify descriptor is left open once Run has returned.
func runSource(t *testing.T, dir string, opts Options, hook func(*Source)) *running {
	t.Helper()
	before := inotifyFDs(t)
	r := &running{rec: newRec(t), logs: &logBuf{}, clock: &pausableClock{}, scans: make(chan bool, 100), ready: make(chan struct{})}
	opts.Log = zerolog.New(r.logs).Level(zerolog.DebugLevel)
	r.src = New(dir, opts)
	r.src.now = r.clock.now
	if hook != nil {
		hook(r.src)
	}
	setup := r.src.newWatcher
	r.src.newWatcher = func(dir string, log zerolog.Logger) (*watcher, error) {
		defer close(r.ready)
		w, err := setup(dir, log)
		r.w = w
		return w, err
	}
	r.src.scanned = func() {
		watched := r.src.watch != nil && !r.src.watch.polling()
		select {
		case r.scans <- watched:
		default:
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.src.Run(ctx, r.rec) }()
	t.Cleanup(func() {
		r.clock.resume()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run returned %v", err)
		}
		if after := inotifyFDs(t); after != before {
			t.Errorf("%d inotify descriptors open after Run returned, %d before", after, before)
		}
	})
	r.waitFor(t, "OnSynced", func() bool { return r.rec.synced == 1 })
	<-r.ready
	return r
}

// inotifyFDs counts the process's open inotify instances.
func inotifyFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if target, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); err == nil && target == "anon_inode:inotify" {
			n++
		}
	}
	return n
}

// waitFor waits until cond, called with the handler's lock held, holds.
func (r *running) waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.After(hangGuard)
	for {
		r.rec.mu.Lock()
		ok := cond()
		r.rec.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-r.rec.notify:
		case <-deadline:
			t.Fatalf("never saw %s", what)
		}
	}
}

// waitEvents waits for the handler's next calls and checks them.
func (r *running) waitEvents(t *testing.T, step string, want ...string) {
	t.Helper()
	r.waitFor(t, step, func() bool { return len(r.rec.events) >= len(want) })
	expect(t, step, r.rec, want...)
}

// waitScan drops the scans reported so far and waits for the next one; it returns whether the
// directory was watched then.
func (r *running) waitScan(t *testing.T) bool {
	t.Helper()
	for {
		select {
		case <-r.scans:
			continue
		default:
		}
		break
	}
	select {
	case watched := <-r.scans:
		return watched
	case <-time.After(hangGuard):
		t.Fatal("the source stopped scanning")
		return false
	}
}

// renameIn writes content to a dotfile in dir and renames it to name, as a careful editor does.
func renameIn(t *testing.T, dir, name, content string) {
	t.Helper()
	tmp := filepath.Join(dir, "."+name+".tmp")
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, name)); err != nil {
		t.Fatal(err)
	}
}

const hour = time.Hour

// TestRenamedFileIsDeliveredAtOnce: with an hour between polls and no time passing for the
// debounce, only the watcher can deliver a file renamed into the directory, and only by taking
// it as complete.
func TestRenamedFileIsDeliveredAtOnce(t *testing.T) {
	dir := t.TempDir()
	r := runSource(t, dir, Options{Interval: hour}, nil)
	if r.w == nil {
		t.Fatal("no watcher")
	}
	r.clock.pause()
	renameIn(t, dir, "a.yaml", service("a", 80, ""))
	r.waitEvents(t, "renamed in", "add Service default/a")
	renameIn(t, dir, "a.yaml", service("a", 81, ""))
	r.waitEvents(t, "renamed over", "update Service default/a")
	if p := r.rec.svc(t, "default", "a").Spec.Ports[0].Port; p != 81 {
		t.Errorf("a serves port %d, want 81", p)
	}
}

// TestWriteInPlaceStillSettles: a file written in place wakes a scan, but is read only once
// Debounce has passed.
func TestWriteInPlaceStillSettles(t *testing.T) {
	dir := t.TempDir()
	r := runSource(t, dir, Options{Interval: hour, Debounce: 50 * time.Millisecond}, nil)
	r.clock.pause()
	if err := os.WriteFile(filepath.Join(dir, "a.yaml"), []byte(service("a", 80, "")), 0o644); err != nil {
		t.Fatal(err)
	}
	if !r.waitScan(t) {
		t.Error("the directory is not watched")
	}
	r.waitScan(t) // a scan that started after the write's events (the first may have been before)
	expect(t, "written in place, not settled", r.rec)
	r.clock.resume()
	r.waitEvents(t, "settled", "add Service default/a")
}

// TestNoInotifyFallsBackToPolling: when the watch cannot be set up, the directory is polled
// every Interval, and a renamed file is not known complete.
func TestNoInotifyFallsBackToPolling(t *testing.T) {
	dir := t.TempDir()
	r := runSource(t, dir, Options{Interval: 5 * time.Millisecond, Debounce: 50 * time.Millisecond}, func(s *Source) {
		s.newWatcher = func(string, zerolog.Logger) (*watcher, error) { return nil, errors.New("no inotify in this test") }
	})
	if got := r.src.pollInterval(); got != 5*time.Millisecond {
		t.Errorf("poll interval %v, want Interval", got)
	}
	warned := false
	for _, l := range r.logs.take(t, zerolog.WarnLevel) {
		warned = warned || strings.Contains(fmt.Sprint(l["error"]), "no inotify in this test")
	}
	if !warned {
		t.Error("no warning says the directory is not watched")
	}
	r.clock.pause()
	renameIn(t, dir, "a.yaml", service("a", 80, ""))
	for range 3 {
		if r.waitScan(t) {
			t.Fatal("a scan says the directory is watched")
		}
	}
	expect(t, "found by polling, not settled", r.rec)
	r.clock.resume()
	r.waitEvents(t, "settled", "add Service default/a")
}

// TestOverflowRescans: a write in place that keeps its file open raises IN_MODIFY only, which
// wakes no scan; an overflow of the queue does, and the scan finds the change.
func TestOverflowRescans(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "a.yaml")
	if err := os.WriteFile(path, []byte(service("a", 80, "")), 0o644); err != nil {
		t.Fatal(err)
	}
	r := runSource(t, dir, Options{Interval: hour, Debounce: 20 * time.Millisecond}, nil)
	expect(t, "initial", r.rec, "add Service default/a")
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString("---\n" + service("b", 80, "")); err != nil {
		t.Fatal(err)
	}
	r.w.mu.Lock()
	wake := r.w.recordLocked(-1, unix.IN_Q_OVERFLOW, "")
	r.w.mu.Unlock()
	if !wake {
		t.Fatal("an overflow does not call for a scan")
	}
	r.w.signal()
	r.waitEvents(t, "after the overflow", "add Service default/b")
}

// TestHintsAfterOverflowOrWrite: at the scan level, a renamed file is read at once; not when the
// queue overflowed, nor when it was written to after the rename (found by the drain after its
// read), when it settles as any file written in place.
func TestHintsAfterOverflowOrWrite(t *testing.T) {
	for _, tc := range []struct {
		name  string
		after func(t *testing.T, f *fixture, w *watcher)
		want  []string // at once; else once settled
	}{
		{"renamed", func(*testing.T, *fixture, *watcher) {}, []string{"add Service default/a"}},
		{"overflow", func(_ *testing.T, _ *fixture, w *watcher) {
			w.mu.Lock()
			w.recordLocked(-1, unix.IN_Q_OVERFLOW, "")
			w.mu.Unlock()
		}, nil},
		{"written after the hint", func(t *testing.T, f *fixture, _ *watcher) {
			a, err := os.OpenFile(filepath.Join(f.dir, "a.yaml"), os.O_WRONLY|os.O_APPEND, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			if _, err := a.WriteString("---\n" + service("b", 80, "")); err != nil {
				t.Fatal(err)
			}
		}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, Options{})
			f.scanOnce(t)
			w, err := newWatcher(f.dir, zerolog.Nop())
			if err != nil {
				t.Fatal(err)
			}
			defer w.stop()
			f.src.watch = w
			defer func() { f.src.watch = nil }()
			renameIn(t, f.dir, "a.yaml", service("a", 80, ""))
			if err := w.drain(); err != nil {
				t.Fatal(err)
			}
			if tc.name == "overflow" {
				tc.after(t, f, w)
			}
			f.src.hint = w.take()
			if tc.name != "overflow" {
				tc.after(t, f, w)
			}
			f.scanOnce(t)
			f.src.hint = nil
			expect(t, "at once", f.rec, tc.want...)
			if tc.want != nil {
				return
			}
			f.clock.advance(time.Hour) // the file's mtime is now: its Debounce is from now
			f.scanOnce(t)
			want := []string{"add Service default/a"}
			if tc.name == "written after the hint" {
				want = append(want, "add Service default/b")
			}
			expect(t, "settled", f.rec, want...)
		})
	}
}

// TestDirectoryRemovedAndRecreated: once the directory is gone it is polled every Interval (its
// objects keep serving); once it is back it is watched again, and a file renamed into it is read
// at once.
func TestDirectoryRemovedAndRecreated(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "manifests")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	renameIn(t, dir, "a.yaml", service("a", 80, ""))
	r := runSource(t, dir, Options{Interval: 5 * time.Millisecond, Debounce: 20 * time.Millisecond}, func(s *Source) {
		s.watchedPoll = hour
	})
	expect(t, "initial", r.rec, "add Service default/a")
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	for r.waitScan(t) { // until a scan finds the directory gone (and keeps its objects)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for !r.waitScan(t) {
	}
	r.waitEvents(t, "directory empty", "delete Service default/a")
	r.clock.pause()
	renameIn(t, dir, "b.yaml", service("b", 80, ""))
	r.waitEvents(t, "renamed into the new directory", "add Service default/b")
}

// TestConfigMapDataSwap builds a directory as the kubelet does for a ConfigMap volume: the
// files are symlinks through "..data", a symlink to a timestamped directory, swapped by rename
// for a new version. A swap delivers the new content at once; a key added after the swap (a new
// symlink) settles.
func TestConfigMapDataSwap(t *testing.T) {
	dir := t.TempDir()
	version := func(name string, files map[string]string) {
		t.Helper()
		if err := os.Mkdir(filepath.Join(dir, name), 0o755); err != nil {
			t.Fatal(err)
		}
		for f, content := range files {
			if err := os.WriteFile(filepath.Join(dir, name, f), []byte(content), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Symlink(name, filepath.Join(dir, "..data_tmp")); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, dataLink)); err != nil {
			t.Fatal(err)
		}
	}
	link := func(f string) {
		t.Helper()
		if err := os.Symlink(filepath.Join(dataLink, f), filepath.Join(dir, f)); err != nil {
			t.Fatal(err)
		}
	}
	version("..v1", map[string]string{"svc.yaml": service("a", 80, "")})
	link("svc.yaml")
	r := runSource(t, dir, Options{Interval: hour, Debounce: 20 * time.Millisecond}, nil)
	expect(t, "initial", r.rec, "add Service default/a")

	r.clock.pause()
	version("..v2", map[string]string{"svc.yaml": service("a", 81, "")})
	r.waitEvents(t, "..data swapped", "update Service default/a")
	if p := r.rec.svc(t, "default", "a").Spec.Ports[0].Port; p != 81 {
		t.Errorf("a serves port %d, want 81", p)
	}

	version("..v3", map[string]string{"svc.yaml": service("a", 81, ""), "more.yaml": service("b", 80, "")})
	link("more.yaml")
	r.waitScan(t)
	r.waitScan(t)
	expect(t, "new key, not settled", r.rec)
	r.clock.resume()
	r.waitEvents(t, "new key settled", "add Service default/b")
}
