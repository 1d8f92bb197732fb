package manifests

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// pausableClock follows the real clock until paused; while paused, no time passes for the
// debounce, however long the test takes.
type pausableClock struct {
	mu       sync.Mutex
	pausedAt time.Time // zero while running
}

func (c *pausableClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.pausedAt.IsZero() {
		return c.pausedAt
	}
	return time.Now()
}

func (c *pausableClock) pause() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.pausedAt = time.Now()
}

func (c *pausableClock) resume() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.pausedAt = time.Time{}
}

// TestHalfWrittenFileIsNotApplied rewrites a file in place the way a careless writer does:
// truncate, write half, pause for several scans, write the rest. The source must never deliver
// the half: no service of the second half may be deleted (which would reset its connections
// and re-allocate it), and the one change of the rewrite is delivered once the file settles.
func TestHalfWrittenFileIsNotApplied(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "svc.yaml")
	content := func(lastPort int) string {
		var b strings.Builder
		for i := 0; i < 10; i++ {
			port := 80
			if i == 9 {
				port = lastPort
			}
			fmt.Fprintf(&b, "---\n%s", service(fmt.Sprintf("s%d", i), port, ""))
		}
		return b.String()
	}
	if err := os.WriteFile(path, []byte(content(80)), 0o644); err != nil {
		t.Fatal(err)
	}

	r := newRec(t)
	clock := &pausableClock{}
	s := New(dir, Options{Interval: 2 * time.Millisecond, Debounce: 20 * time.Millisecond})
	s.now = clock.now
	scans := make(chan struct{}, 1)
	s.scanned = func() {
		select {
		case scans <- struct{}{}:
		default:
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx, r) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run returned %v", err)
		}
	}()
	// waitScans waits for n scans that started after the caller's last step (the first one
	// seen may have started before).
	waitScans := func(n int) {
		t.Helper()
		for i := 0; i <= n; i++ {
			select {
			case <-scans:
			case <-time.After(hangGuard):
				t.Fatal("the source stopped scanning")
			}
		}
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.After(hangGuard)
		for {
			r.mu.Lock()
			ok := cond()
			r.mu.Unlock()
			if ok {
				return
			}
			select {
			case <-r.notify:
			case <-deadline:
				t.Fatalf("never saw %s", what)
			}
		}
	}
	waitFor("OnSynced", func() bool { return r.synced == 1 })
	if got := r.take(); len(got) != 10 {
		t.Fatalf("initial delivery %v, want the 10 services", got)
	}
	ips := map[string]string{}
	for i := 0; i < 10; i++ {
		ips[fmt.Sprintf("s%d", i)] = r.svc(t, "default", fmt.Sprintf("s%d", i)).Spec.ClusterIP
	}

	// While the writer pauses, no time passes for the debounce: the pause is shorter than
	// Debounce however slow the machine, and the scans still happen.
	clock.pause()
	next := content(81)
	cut := strings.Index(next, "---\n"+service("s5", 80, "")) // half: s0..s4, parsing cleanly
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		t.Fatal(err)
	}
	waitScans(3) // the source sees the empty file
	if _, err := f.WriteString(next[:cut]); err != nil {
		t.Fatal(err)
	}
	waitScans(3) // the source sees the half file, several times
	if _, err := f.WriteString(next[cut:]); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	waitScans(3)
	if got := r.take(); len(got) != 0 {
		t.Fatalf("while the file was being written the handler saw %v, want nothing", got)
	}

	// Time passes: the complete file settles and its one change is delivered.
	clock.resume()
	waitFor("the update of s9", func() bool { return len(r.events) > 0 })
	waitScans(3)
	if got := r.take(); len(got) != 1 || got[0].String() != "update Service default/s9" {
		t.Fatalf("after the rewrite the handler saw %v, want only the update of s9", got)
	}
	for name, ip := range ips {
		if got := r.svc(t, "default", name); got.Spec.ClusterIP != ip {
			t.Errorf("%s moved from %s to %s", name, ip, got.Spec.ClusterIP)
		}
	}
	if p := r.svc(t, "default", "s9").Spec.Ports[0].Port; p != 81 {
		t.Errorf("s9 serves port %d, want 81", p)
	}
}

// TestChangeIsReadOnceSettled follows the debounce scan by scan on a fake clock.
func TestChangeIsReadOnceSettled(t *testing.T) {
	f := newFixture(t, Options{Debounce: time.Second})
	f.write(t, "a.yaml", service("a", 80, ""))
	if due := f.scanOnce(t); due != f.clock.now().Add(time.Second) {
		t.Errorf("first scan: next due %v, want in one Debounce", due)
	}
	expect(t, "new file, not settled", f.rec)
	f.clock.advance(999 * time.Millisecond)
	f.scanOnce(t)
	expect(t, "new file, not settled yet", f.rec)
	f.clock.advance(time.Millisecond)
	if due := f.scanOnce(t); !due.IsZero() {
		t.Errorf("nothing waits, yet next due %v", due)
	}
	expect(t, "settled", f.rec, "add Service default/a")

	// Every change restarts the wait.
	f.write(t, "a.yaml", service("a", 81, ""))
	f.scanOnce(t)
	f.clock.advance(600 * time.Millisecond)
	f.write(t, "a.yaml", service("a", 8222, "")) // a different size: a different stat
	f.scanOnce(t)
	f.clock.advance(600 * time.Millisecond)
	f.scanOnce(t)
	expect(t, "still changing", f.rec)
	f.clock.advance(400 * time.Millisecond)
	f.scanOnce(t)
	expect(t, "settled again", f.rec, "update Service default/a")
	if p := f.rec.svc(t, "default", "a").Spec.Ports[0].Port; p != 8222 {
		t.Errorf("a serves port %d, want 8222", p)
	}

	// A file missing for less than Debounce (moved aside by an editor, written anew) keeps its
	// objects; one missing for Debounce loses them.
	f.remove(t, "a.yaml")
	f.scanOnce(t)
	f.clock.advance(500 * time.Millisecond)
	f.scanOnce(t)
	expect(t, "missing for a moment", f.rec)
	f.write(t, "a.yaml", service("a", 8222, ""))
	f.clock.advance(time.Second)
	f.scanOnce(t)
	f.clock.advance(time.Second)
	f.scanOnce(t)
	expect(t, "back with the same content", f.rec)
	f.remove(t, "a.yaml")
	f.scanOnce(t)
	f.clock.advance(time.Second)
	f.scanOnce(t)
	expect(t, "removed", f.rec, "delete Service default/a")
}

// TestFileChangedWhileReadIsReadAgain: a file written to between the stat that found it settled
// and the end of its read is not decoded, but waits to settle again.
func TestFileChangedWhileReadIsReadAgain(t *testing.T) {
	f := newFixture(t, Options{})
	path := filepath.Join(f.dir, "a.yaml")
	f.write(t, "a.yaml", service("a", 80, ""))
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	f.write(t, "a.yaml", service("a", 80, "")+"---\n"+service("b", 80, ""))
	st := &fileState{}
	read, settled := f.src.readFile(path, st, fi, nil)
	if read || settled || st.decoded || len(st.objects) != 0 {
		t.Fatalf("readFile of a file that changed since its stat: read %v settled %v decoded %v objects %d", read, settled, st.decoded, len(st.objects))
	}
	if fi2, _ := os.Stat(path); st.seen != statKeyOf(fi2) || st.seenSince != f.clock.now() {
		t.Errorf("the new stat was not recorded as seen now")
	}
}

// TestBrokenFileKeepsItsObjects rewrites a good file with content that cannot be decoded as a
// whole, or only in part, each time with an error naming the file: the file's objects keep
// serving as they were.
func TestBrokenFileKeepsItsObjects(t *testing.T) {
	good := service("a", 80, "") + "---\n" + service("b", 80, "")
	goodJSON := `{"apiVersion":"v1","kind":"List","items":[` +
		`{"apiVersion":"v1","kind":"Service","metadata":{"name":"a"},"spec":{"ports":[{"port":80}]}},` +
		`{"apiVersion":"v1","kind":"Service","metadata":{"name":"b"},"spec":{"ports":[{"port":80}]}}]}`
	tests := []struct {
		name, file, content string
	}{
		{"binary", "svc.yaml", "\x00\x01\x02\xff\xfe garbage"},
		{"tab indentation", "svc.yaml", "\t" + good},
		{"not a mapping", "svc.yaml", "just some text\n"},
		{"YAML syntax error in the first document", "svc.yaml", "apiVersion: v1\nkind: Service\nmetadata: [oops\n---\n" + service("b", 80, "")},
		{"second document after an end marker", "svc.yaml", service("a", 80, "") + "...\n" + service("b", 90, "")},
		{"second document on its separator line", "svc.yaml", service("a", 80, "") + "--- {apiVersion: v1, kind: Service, metadata: {name: b}, spec: {ports: [{port: 90}]}}\n"},
		{"JSON cut short", "svc.json", goodJSON[:len(goodJSON)/2]},
		{"JSON file holding YAML documents", "svc.json", service("a", 80, "") + "---\n" + service("b", 90, "")},
		{"List items not a list", "svc.yaml", "apiVersion: v1\nkind: List\nitems: 3\n"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, Options{})
			initial := good
			if strings.HasSuffix(tc.file, ".json") {
				initial = goodJSON
			}
			f.write(t, tc.file, initial)
			f.scan(t)
			expect(t, "initial", f.rec, "add Service default/a", "add Service default/b")
			f.logs.take(t, zerolog.DebugLevel)

			f.write(t, tc.file, tc.content)
			f.scan(t)
			expect(t, "broken", f.rec)
			if got := f.rec.served(); !slices.Equal(got, []string{"Service default/a", "Service default/b"}) {
				t.Errorf("served %q", got)
			}
			for _, name := range []string{"a", "b"} {
				if p := f.rec.svc(t, "default", name).Spec.Ports[0].Port; p != 80 {
					t.Errorf("%s serves port %d, want the last good 80", name, p)
				}
			}
			path := filepath.Join(f.dir, tc.file)
			errs := f.logs.take(t, zerolog.ErrorLevel)
			var summary map[string]any
			for _, e := range errs {
				if e["file"] != path {
					t.Errorf("error %v does not name the file", e)
				}
				if strings.Contains(fmt.Sprint(e["message"]), "keep serving") {
					summary = e
				}
			}
			if summary == nil || len(errs) < 2 {
				t.Fatalf("errors %v, want the file's errors and a line saying its objects keep serving", errs)
			}
		})
	}
}

// TestEmptiedFileDeletesOnceSettled: a file emptied on purpose (and left so for Debounce) is a
// file without objects.
func TestEmptiedFileDeletesOnceSettled(t *testing.T) {
	f := newFixture(t, Options{})
	f.write(t, "svc.yaml", service("a", 80, ""))
	f.scan(t)
	expect(t, "initial", f.rec, "add Service default/a")
	f.write(t, "svc.yaml", "")
	f.scanOnce(t)
	expect(t, "just emptied", f.rec)
	f.clock.advance(f.src.opts.debounce())
	f.scanOnce(t)
	expect(t, "emptied", f.rec, "delete Service default/a")
	if got := f.rec.served(); len(got) != 0 {
		t.Errorf("served %q", got)
	}
}

// TestRunDoesNotWaitForeverForAFileBeingWritten: a file that never stops changing does not hold
// OnSynced back for longer than settleWaits×Debounce; it is named in a warning, and read once it
// settles.
func TestRunDoesNotWaitForeverForAFileBeingWritten(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "busy.yaml")
	if err := os.WriteFile(path, []byte(service("a", 80, "")), 0o644); err != nil {
		t.Fatal(err)
	}
	logs := &logBuf{}
	r := newRec(t)
	clock := newFakeClock()
	const debounce = 10 * time.Millisecond
	s := New(dir, Options{Interval: time.Millisecond, Debounce: debounce, Log: zerolog.New(logs)})
	s.now = clock.now
	var mu sync.Mutex
	writing := true
	// After every scan, half a Debounce passes and the file grows by a comment line.
	s.scanned = func() {
		mu.Lock()
		defer mu.Unlock()
		clock.advance(debounce / 2)
		if !writing {
			return
		}
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
		if err != nil {
			t.Error(err)
			return
		}
		defer f.Close()
		if _, err := f.WriteString("# more\n"); err != nil {
			t.Error(err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx, r) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run returned %v", err)
		}
	}()
	deadline := time.After(hangGuard)
	for synced := false; !synced; {
		select {
		case <-r.notify:
		case <-deadline:
			t.Fatal("OnSynced never came")
		}
		r.mu.Lock()
		synced = r.synced == 1
		r.mu.Unlock()
	}
	// The file was still changing at every scan: OnSynced came without it.
	mu.Lock()
	writing = false
	mu.Unlock()
	if got := r.take(); len(got) != 0 {
		t.Errorf("delivered %v from a file still being written", got)
	}
	var warned bool
	for _, l := range logs.take(t, zerolog.WarnLevel) {
		warned = warned || strings.Contains(fmt.Sprint(l["unsettledFiles"]), path)
	}
	if !warned {
		t.Error("no warning names the file still being written")
	}
	for {
		r.mu.Lock()
		n := len(r.events)
		r.mu.Unlock()
		if n > 0 {
			break
		}
		select {
		case <-r.notify:
		case <-deadline:
			t.Fatal("the file was never read once it settled")
		}
	}
	expect(t, "settled", r, "add Service default/a")
}

// TestOldFilesAreReadAtOnce: files last written more than Debounce ago (by their sub-second
// modification times) are read by the first scan; a file written just now waits for the rest
// of its Debounce, and one whose timestamp has whole seconds only (a coarse file system) waits
// the whole Debounce from when it is first seen.
func TestOldFilesAreReadAtOnce(t *testing.T) {
	f := newFixture(t, Options{Debounce: time.Second})
	now := f.clock.now()
	for _, tc := range []struct {
		name  string
		mtime time.Time
	}{
		{"old", now.Add(-time.Hour + 123*time.Millisecond)},
		{"recent", now.Add(-400*time.Millisecond - mtimeSlack)},
		{"coarse", now.Add(-time.Hour)},
	} {
		f.write(t, tc.name+".yaml", service(tc.name, 80, ""))
		if err := os.Chtimes(filepath.Join(f.dir, tc.name+".yaml"), tc.mtime, tc.mtime); err != nil {
			t.Fatal(err)
		}
	}
	if due := f.scanOnce(t); !due.Equal(now.Add(600 * time.Millisecond)) {
		t.Errorf("first scan: next due in %v, want the rest of the recent file's Debounce (600ms)", due.Sub(now))
	}
	expect(t, "first scan", f.rec, "add Service default/old")
	f.clock.advance(600 * time.Millisecond)
	if due := f.scanOnce(t); !due.Equal(now.Add(time.Second)) {
		t.Errorf("second scan: next due in %v, want the coarse file's Debounce (1s)", due.Sub(now))
	}
	expect(t, "recent file settled", f.rec, "add Service default/recent")
	f.clock.advance(400 * time.Millisecond)
	f.scanOnce(t)
	expect(t, "coarse file settled", f.rec, "add Service default/coarse")
}

// readFile reads and, if its content changed, decodes one file. statErr is the error of the
// stat fi, if any. It reports whether the file's objects may have changed, and whether the file
// was settled: a file that changes while it is read is left to settle again.
func (s *Source) readFile(path string, st *fileState, fi os.FileInfo, statErr error) (read, settled bool) {
	l := s.load(path, st, fi, statErr)
	s.decodeLoads([]*load{l})
	return s.apply(l)
}
