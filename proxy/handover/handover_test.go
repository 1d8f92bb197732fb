package handover

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// giver hands over n pipes' write ends; each record's meta is its index. It records what
// happened to it.
type giver struct {
	n       int
	readers []*os.File // the read ends, kept by the test

	mu              sync.Mutex
	froze, released int
	resumed         *Package
	freezeErr       error
	writers         []*os.File // the giver's own write ends
}

func (g *giver) Freeze(context.Context) (*Package, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.froze++
	if g.freezeErr != nil {
		return nil, g.freezeErr
	}
	pkg := &Package{}
	for i := range g.n {
		dup, err := Dup(g.writers[i])
		if err != nil {
			return nil, err
		}
		r, err := NewRecord("pipe", i, dup)
		if err != nil {
			return nil, err
		}
		pkg.Records = append(pkg.Records, r)
	}
	return pkg, nil
}

func (g *giver) Release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.released++
	closeFiles(g.writers)
	g.writers = nil
}

func (g *giver) Resume(pkg *Package) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.resumed = pkg
}

func newGiver(t *testing.T, n int) *giver {
	t.Helper()
	g := &giver{n: n}
	for range n {
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		g.readers = append(g.readers, r)
		g.writers = append(g.writers, w)
	}
	t.Cleanup(func() {
		closeFiles(g.readers)
		g.mu.Lock()
		closeFiles(g.writers)
		g.mu.Unlock()
	})
	return g
}

// serve runs a Listener for g in the background and returns the socket's path and a function
// that stops it and returns whether Serve reported a hand-over.
func serve(t *testing.T, g Giver) (string, func() bool) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "handover.sock")
	l, err := Listen(path, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan bool, 1)
	go func() { done <- l.Serve(ctx, g, 10*time.Second) }()
	var once sync.Once
	var handed bool
	stop := func() bool {
		once.Do(func() {
			cancel()
			handed = <-done
			if err := l.Close(); err != nil {
				t.Errorf("close: %v", err)
			}
		})
		return handed
	}
	t.Cleanup(func() { stop() })
	return path, stop
}

func take(t *testing.T, path string, claim func() error) (*Package, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return Take(ctx, path, "test", func(lock *os.File) error {
		if lock != nil {
			lock.Close()
		}
		return claim()
	}, zerolog.Nop())
}

func claimOK() error { return nil }

// Every record arrives, with its own descriptor, across several messages; the giver lets go.
func TestHandOverEverything(t *testing.T) {
	const n = 600 // more than two messages' worth of descriptors
	g := newGiver(t, n)
	path, stop := serve(t, g)
	pkg, err := take(t, path, claimOK)
	if err != nil {
		t.Fatal(err)
	}
	defer pkg.Close()
	if !stop() {
		t.Error("Serve did not report the hand-over")
	}
	if len(pkg.Records) != n || pkg.Files() != n {
		t.Fatalf("%d records with %d files, want %d", len(pkg.Records), pkg.Files(), n)
	}
	for i, r := range pkg.Records {
		var idx int
		if err := json.Unmarshal(r.Meta, &idx); err != nil || idx != i || r.Kind != "pipe" {
			t.Fatalf("record %d: kind %q meta %s (%v)", i, r.Kind, r.Meta, err)
		}
		// The received descriptor is the same pipe: what it writes, the test's read end reads.
		msg := fmt.Sprintf("record %d", i)
		if _, err := r.Files[0].WriteString(msg); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, len(msg))
		if _, err := io.ReadFull(g.readers[i], buf); err != nil || string(buf) != msg {
			t.Fatalf("pipe %d: read %q, %v", i, buf, err)
		}
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.froze != 1 || g.released != 1 || g.resumed != nil {
		t.Errorf("froze %d, released %d, resumed %v", g.froze, g.released, g.resumed != nil)
	}
}

// A successor that speaks no version of ours is refused, and the predecessor still serves the
// next one.
func TestRefusedVersion(t *testing.T) {
	g := newGiver(t, 3)
	path, stop := serve(t, g)
	uc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	c := &conn{uc: uc}
	if err := c.send(message{Type: msgHello, Versions: []int{Version + 100}}, nil); err != nil {
		t.Fatal(err)
	}
	var m message
	if _, err := c.recv(&m); err != nil {
		t.Fatal(err)
	}
	uc.Close()
	if m.Type != msgRefuse || !strings.Contains(m.Reason, "no common protocol version") {
		t.Fatalf("answer %+v, want a refusal naming the versions", m)
	}
	pkg, err := take(t, path, claimOK)
	if err != nil {
		t.Fatalf("next successor: %v", err)
	}
	pkg.Close()
	if !stop() {
		t.Error("Serve did not report the hand-over")
	}
	if g.froze != 1 {
		t.Errorf("froze %d times, want 1 (not for the refused successor)", g.froze)
	}
}

// A successor that goes away after the records, before ready, leaves the predecessor resumed
// with its own copies; nothing was released.
func TestSuccessorDiesBeforeReady(t *testing.T) {
	g := newGiver(t, 5)
	path, stop := serve(t, g)
	uc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	c := &conn{uc: uc}
	if err := c.send(message{Type: msgHello, Versions: versions}, nil); err != nil {
		t.Fatal(err)
	}
	var m message
	if _, err := c.recv(&m); err != nil || m.Type != msgWelcome {
		t.Fatalf("welcome: %+v, %v", m, err)
	}
	pkg, err := recvPackage(c)
	if err != nil {
		t.Fatal(err)
	}
	pkg.Close()
	uc.Close() // no ready
	deadline := time.Now().Add(10 * time.Second)
	for {
		g.mu.Lock()
		resumed := g.resumed
		g.mu.Unlock()
		if resumed != nil {
			if len(resumed.Records) != 5 || resumed.Files() != 5 {
				t.Errorf("resumed with %d records, %d files", len(resumed.Records), resumed.Files())
			}
			resumed.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the predecessor did not resume")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if stop() {
		t.Error("Serve reported a hand-over")
	}
	if g.released != 0 {
		t.Errorf("released %d times", g.released)
	}
}

// When the instance lock cannot be taken after ready, the successor drops what it received.
func TestClaimFails(t *testing.T) {
	g := newGiver(t, 2)
	path, _ := serve(t, g)
	held := errors.New("lock held")
	pkg, err := take(t, path, func() error { return held })
	if pkg != nil || !errors.Is(err, held) {
		t.Fatalf("Take = %v, %v; want no package and the claim's error", pkg, err)
	}
}

// A predecessor whose Freeze fails refuses with the reason and serves on.
func TestFreezeFails(t *testing.T) {
	g := newGiver(t, 1)
	g.freezeErr = errors.New("cannot freeze")
	path, stop := serve(t, g)
	_, err := take(t, path, claimOK)
	if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "cannot freeze") {
		t.Fatalf("Take: %v, want a refusal with the reason", err)
	}
	if stop() {
		t.Error("Serve reported a hand-over")
	}
}

// Garbage on the socket neither crashes the predecessor nor stops it answering.
func TestGarbage(t *testing.T) {
	g := newGiver(t, 1)
	path, _ := serve(t, g)
	for _, junk := range []string{"", "\x00\x00\x00\x05hello", "\xff\xff\xff\xff", "\x00\x00\x00\x02{}", "\x00\x00\x00\x10{\"type\":\"ready\"}"} {
		uc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		_, _ = uc.Write([]byte(junk))
		uc.CloseWrite()
		_, _ = io.ReadAll(uc)
		uc.Close()
	}
	pkg, err := take(t, path, claimOK)
	if err != nil {
		t.Fatalf("after the garbage: %v", err)
	}
	pkg.Close()
}

// No predecessor: Take fails at once, naming the socket.
func TestNoPredecessor(t *testing.T) {
	path := filepath.Join(t.TempDir(), "none.sock")
	if _, err := take(t, path, claimOK); err == nil || !strings.Contains(err.Error(), "none.sock") {
		t.Fatalf("Take: %v", err)
	}
}

// After a hand-over the predecessor closes its listener without touching the path, where the
// successor's socket now is.
func TestCloseHandedOverKeepsSuccessorSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "h.sock")
	old, err := Listen(path, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	successor, err := Listen(path, zerolog.Nop()) // replaces the old one's file
	if err != nil {
		t.Fatal(err)
	}
	defer successor.Close()
	if err := old.CloseHandedOver(); err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("the successor's socket after the predecessor closed: %v", err)
	}
	c.Close()
}

// A record cannot carry a missing descriptor: NewRecord says so, and a send of one fails
// instead of falling over it.
func TestRecordWithMissingDescriptor(t *testing.T) {
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := NewRecord("tcp-conn", struct{}{}, f, nil); err == nil {
		t.Error("NewRecord took a nil file")
	}
	if _, err := rawFD(nil); err == nil {
		t.Error("rawFD of a nil file: no error")
	}
}
