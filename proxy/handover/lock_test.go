//go:build linux

package handover

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// flockFile opens path and takes an exclusive flock on it, without waiting.
func flockFile(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// lockGiver is a giver holding an instance lock (a flock on a file) that it hands over.
type lockGiver struct {
	*giver
	path string
	lock *os.File
	// freeAfterRelease: whether a third process could take the lock once the giver let go
	// (before the successor has it).
	freeAfterRelease bool
}

func (g *lockGiver) LockFile() (*os.File, error) { return Dup(g.lock) }

func (g *lockGiver) Release() {
	g.giver.Release()
	g.lock.Close()
	if f, err := flockFile(g.path); err == nil {
		g.freeAfterRelease = true
		f.Close()
	}
}

// The instance lock travels with released: from the predecessor's release to the successor's
// claim no third process can take it, and the successor holds it until it closes its copy.
func TestReleasedCarriesTheLock(t *testing.T) {
	path := filepath.Join(t.TempDir(), "instance.lock")
	lock, err := flockFile(path)
	if err != nil {
		t.Fatal(err)
	}
	g := &lockGiver{giver: newGiver(t, 2), path: path, lock: lock}
	sock, stop := serve(t, g)
	var held *os.File
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pkg, err := Take(ctx, sock, "test", func(lock *os.File) error {
		if lock == nil {
			return errors.New("the predecessor did not pass its lock on")
		}
		held = lock
		return nil
	}, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	pkg.Close()
	if !stop() {
		t.Fatal("the predecessor did not hand over")
	}
	if g.freeAfterRelease {
		t.Error("the instance lock was free between the predecessor's release and the successor's claim")
	}
	if f, err := flockFile(path); err == nil {
		f.Close()
		t.Fatal("a third process takes the lock the successor holds")
	}
	held.Close()
	f, err := flockFile(path)
	if err != nil {
		t.Fatalf("the lock once the successor let go: %v", err)
	}
	f.Close()
}

// With a version-1 peer the lock is not passed: the predecessor frees it, and the successor
// takes it itself.
func TestVersionOneFreesTheLock(t *testing.T) {
	saved := versions
	versions = []int{1}
	t.Cleanup(func() { versions = saved })
	path := filepath.Join(t.TempDir(), "instance.lock")
	lock, err := flockFile(path)
	if err != nil {
		t.Fatal(err)
	}
	g := &lockGiver{giver: newGiver(t, 1), path: path, lock: lock}
	sock, stop := serve(t, g)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var held *os.File
	pkg, err := Take(ctx, sock, "test", func(passed *os.File) error {
		if passed != nil {
			passed.Close()
			return errors.New("a version-1 predecessor passed a descriptor with released")
		}
		held, err = flockFile(path)
		return err
	}, zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	pkg.Close()
	defer held.Close()
	if !stop() {
		t.Fatal("the predecessor did not hand over")
	}
}
