package layout

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/internal/testenv"
)

// trackedFile is one file of the git checkout, read from the work tree.
type trackedFile struct {
	path string // relative to the repository's root, with forward slashes
	data []byte
}

// trackedTextFiles returns every text file git tracks in this checkout (binary files, those with
// a NUL byte in their first 8,000 bytes as git judges them, are left out; so are tracked files
// deleted from the work tree). Outside a git checkout it skips the test, saying why, through
// testenv: under KUP_TEST_ALL=1 (CI, which always has the checkout) that is a failure.
func trackedTextFiles(t *testing.T) (root string, files []trackedFile) {
	t.Helper()
	top, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if err != nil {
		testenv.Need(t, fmt.Sprintf("a git checkout, whose tracked files are checked (git rev-parse: %v)", err))
	}
	root = strings.TrimSpace(string(top))
	cmd := exec.Command("git", "ls-files", "-z")
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("git ls-files: %v: %s", err, stderr.String())
	}
	for _, name := range strings.Split(strings.TrimRight(string(out), "\x00"), "\x00") {
		data, err := os.ReadFile(filepath.Join(root, filepath.FromSlash(name)))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			t.Fatalf("read %s: %v", name, err)
		}
		if bytes.IndexByte(data[:min(len(data), 8000)], 0) >= 0 {
			continue
		}
		files = append(files, trackedFile{path: name, data: data})
	}
	if len(files) < 100 {
		t.Fatalf("only %d tracked text files found under %s: the checks would pass vacuously", len(files), root)
	}
	return root, files
}

// lines calls fn with each line of data and its 1-based number.
func lines(data []byte, fn func(n int, line string)) {
	for i, l := range strings.Split(string(data), "\n") {
		fn(i+1, l)
	}
}
