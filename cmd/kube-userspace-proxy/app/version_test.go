package app

import (
	"bytes"
	"debug/buildinfo"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/internal/testenv"
)

func TestVersionLine(t *testing.T) {
	vcs := func(rev, modified string) *debug.BuildInfo {
		bi := &debug.BuildInfo{Main: debug.Module{Version: "(devel)"}}
		if rev != "" {
			bi.Settings = append(bi.Settings, debug.BuildSetting{Key: "vcs.revision", Value: rev})
		}
		if modified != "" {
			bi.Settings = append(bi.Settings, debug.BuildSetting{Key: "vcs.modified", Value: modified})
		}
		return bi
	}
	const rev = "0123456789abcdef0123456789abcdef01234567"
	tests := []struct {
		name            string
		version, commit string
		bi              *debug.BuildInfo // nil: no build information
		want            string
	}{
		{name: "stamped by -ldflags", version: "v1.2.3", commit: "abc1234", bi: vcs(rev, "true"),
			want: "kube-userspace-proxy v1.2.3 (commit abc1234)"},
		{name: "go build in a clean checkout", version: "dev", commit: "unknown", bi: vcs(rev, "false"),
			want: "kube-userspace-proxy dev (commit 0123456789ab)"},
		{name: "go build with local changes", version: "dev", commit: "unknown", bi: vcs(rev, "true"),
			want: "kube-userspace-proxy dev (commit 0123456789ab-dirty)"},
		{name: "no VCS information (-buildvcs=false)", version: "dev", commit: "unknown", bi: vcs("", ""),
			want: "kube-userspace-proxy dev (commit unknown)"},
		{name: "no build information", version: "dev", commit: "unknown",
			want: "kube-userspace-proxy dev (commit unknown)"},
		{name: "go install module@version", version: "dev", commit: "unknown",
			bi:   &debug.BuildInfo{Main: debug.Module{Version: "v0.4.0"}},
			want: "kube-userspace-proxy v0.4.0 (commit unknown)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := versionLine(tt.version, tt.commit, func() (*debug.BuildInfo, bool) { return tt.bi, tt.bi != nil })
			if got != tt.want {
				t.Errorf("got %q, want %q", got, tt.want)
			}
		})
	}
}

// versionFormat is the one line --version prints.
var versionFormat = regexp.MustCompile(`^kube-userspace-proxy (\S+) \(commit (\S+)\)\n$`)

func TestVersionFlag(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := Main([]string{"--version"}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit code %d, stderr %q", code, stderr.String())
	}
	if !versionFormat.MatchString(stdout.String()) {
		t.Errorf("--version printed %q, want a match of %s", stdout.String(), versionFormat)
	}
}

// TestVersionPlainBuild: a plain `go build` in the repository (VCS stamping on, no -ldflags)
// prints the commit the toolchain recorded.
func TestVersionPlainBuild(t *testing.T) {
	// The go command stamps the commit only where .git is a directory: not in a git worktree,
	// whose .git is a file naming the repository's.
	top, err := exec.Command("git", "rev-parse", "--show-toplevel").Output()
	if err != nil {
		testenv.Need(t, fmt.Sprintf("a git checkout (git rev-parse: %v)", err))
	}
	if fi, err := os.Stat(filepath.Join(strings.TrimSpace(string(top)), ".git")); err != nil || !fi.IsDir() {
		testenv.Need(t, "a checkout whose .git is a directory, which go build stamps (a worktree's .git is a file)")
	}
	bin := filepath.Join(t.TempDir(), "kube-userspace-proxy")
	if out, err := exec.Command("go", "build", "-buildvcs=true", "-o", bin, "github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy").CombinedOutput(); err != nil {
		t.Fatalf("go build -buildvcs=true (needs git and the repository's .git): %v\n%s", err, out)
	}
	bi, err := buildinfo.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	want := vcsCommit(bi, "")
	if !regexp.MustCompile(`^[0-9a-f]{12}(-dirty)?$`).MatchString(want) {
		t.Fatalf("recorded revision %q: not 12 hex digits (settings %v)", want, bi.Settings)
	}
	out, err := exec.Command(bin, "--version").Output()
	if err != nil {
		t.Fatal(err)
	}
	m := versionFormat.FindStringSubmatch(string(out))
	if m == nil || m[2] != want {
		t.Errorf("--version printed %q, want commit %s", out, want)
	}
}
