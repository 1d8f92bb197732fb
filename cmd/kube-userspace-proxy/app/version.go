package app

import (
	"fmt"
	"runtime/debug"
)

// Version and Commit are set at build time (-ldflags "-X ..."). When they are not, --version
// falls back to what the Go toolchain recorded in the binary (see versionLine).
var (
	Version = "dev"
	Commit  = "unknown"
)

// Values of Version and Commit that mean "not stamped".
const (
	unstampedVersion = "dev"
	unstampedCommit  = "unknown"
)

// versionLine returns what --version prints: "kube-userspace-proxy VERSION (commit COMMIT)".
// version and commit are Version and Commit; where they were not stamped, buildInfo (normally
// debug.ReadBuildInfo) supplies the module version (for `go install ...@vX`) and the VCS
// revision that `go build` records in a git checkout (12 hex digits, "-dirty" when the tree had
// local changes, as `git describe --dirty` marks it).
func versionLine(version, commit string, buildInfo func() (*debug.BuildInfo, bool)) string {
	if version == unstampedVersion || commit == unstampedCommit {
		if bi, ok := buildInfo(); ok && bi != nil {
			if version == unstampedVersion && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
				version = bi.Main.Version
			}
			if commit == unstampedCommit {
				commit = vcsCommit(bi, commit)
			}
		}
	}
	return fmt.Sprintf("kube-userspace-proxy %s (commit %s)", version, commit)
}

// vcsCommit returns the revision recorded in bi (shortened, "-dirty" if modified), or def.
func vcsCommit(bi *debug.BuildInfo, def string) string {
	var rev string
	var modified bool
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			modified = s.Value == "true"
		}
	}
	if rev == "" {
		return def
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	if modified {
		rev += "-dirty"
	}
	return rev
}
