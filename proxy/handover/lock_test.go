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
