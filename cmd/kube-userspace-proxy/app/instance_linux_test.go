package app

import (
	"os"
	"path/filepath"
	"testing"
)

// TestAdoptInstanceLock: a duplicate of the holder's descriptor adopts the lock; a descriptor of
// the same lock file opened anew (an open file that does not hold the lock) is refused while
// the holder keeps it.
func TestAdoptInstanceLock(t *testing.T) {
	dir := t.TempDir()
	lock, err := lockInstance(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.release()

	paths, err := filepath.Glob(filepath.Join(dir, "netns-*.lock"))
	if err != nil || len(paths) != 1 {
		t.Fatalf("lock files in %s: %v (%v)", dir, paths, err)
	}
	stranger, err := os.OpenFile(paths[0], os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if l, err := adoptInstanceLock(stranger); err == nil {
		l.release()
		t.Fatal("adopted the lock through a descriptor that does not hold it")
	}

	dup, err := lock.dup()
	if err != nil {
		t.Fatal(err)
	}
	adopted, err := adoptInstanceLock(dup)
	if err != nil {
		t.Fatalf("adopt a duplicate of the holder's descriptor: %v", err)
	}
	adopted.release()
}
